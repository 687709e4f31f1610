"""The tiny recipe's inputs (a fitted tiny target, its regenerated chat data), built once per session, and
the helpers that run it: shared by the training, data and inference tests."""

from __future__ import annotations

import json
from pathlib import Path

FAST = ["logging.progress=false", "eval.at_start=false", "eval.true_tau_prompts=0", "checkpoint.every=0"]


_INPUTS: dict[str, Path] = {}


def tiny_input_dirs(tmp_path_factory) -> dict[str, Path]:
    """``target``, ``data`` and ``packed`` (the same documents packed) folders, built once per session.

    Shared by every test that trains the tiny recipe: fitting the tiny target is most of the cost.
    """
    if not _INPUTS:
        from data.prepare import prepare
        from data.tiny_chat import write
        from train.tiny import build_tiny_target

        root = tmp_path_factory.mktemp("tiny_inputs")
        target = build_tiny_target(root / "target", log=lambda *_: None)
        source = write(root / "tiny_chat.jsonl", n=320, seed=0)
        prepare(str(target), str(source), root / "data", regenerate="local", thinking=False, max_length=256,
                progress=False, gen_kwargs={"max_tokens": 40, "batch_size": 64})
        # The packed variant re-reads the target's regenerated answers: no second regeneration.
        prepare(str(target), str(root / "data" / "regenerated.jsonl"), root / "packed", thinking=False,
                max_length=256, pack=True, progress=False)
        _INPUTS.update(target=target, data=root / "data", packed=root / "packed")
    return _INPUTS


def run(out_dir, *args):
    from train.config import load_config
    from train.distill import train

    return train(load_config(["recipe=tiny", f"out_dir={out_dir}", *args]))


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line]


def losses(out_dir, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics(out_dir) if key in r}


def golden_input_dirs(root: Path) -> list[str]:
    """The golden 2-step run's inputs: the seeded (unfitted) tiny target and the tiny chat data as written.

    Not the recipe's fitted target and regenerated answers: fitting (100 AdamW steps) and greedy
    regeneration amplify the last bit of a float sum, so the prepared rows, and the losses, differed between
    CPUs whose kernels round differently (AVX2 / AVX-512: 1e-3 at step 2). On these inputs the losses agree to
    1e-6 across them, so the golden pins the objective, not the machine.
    """
    from data.prepare import prepare
    from data.tiny_chat import write
    from models.tiny import save_tiny_target

    root = Path(root)
    target = save_tiny_target(root / "target", "qwen3", seed=0, num_layers=6)
    source = write(root / "tiny_chat.jsonl", n=320, seed=0)
    prepare(str(target), str(source), root / "data", thinking=False, max_length=256, progress=False)
    return [f"target.path={target}", f"data.prepared={root / 'data'}"]
