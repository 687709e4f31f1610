"""Regenerate tests/golden/train_tiny_2step.json: the tiny recipe's first two step losses.

    python tests/golden/make_train_golden.py

Run it when the objective, the tiny target/data builders or the tiny recipe change on purpose,
and say why in the commit.
"""

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    import torch

    torch.set_num_threads(1)  # as tests/conftest.py (the value is the same with 2 threads)
    from data.prepare import prepare
    from data.tiny_chat import write
    from train.config import load_config
    from train.distill import train
    from train.tiny import build_tiny_target

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = build_tiny_target(root / "target", log=lambda *_: None)
        source = write(root / "tiny_chat.jsonl", n=320, seed=0)
        prepare(str(target), str(source), root / "data", regenerate="local", thinking=False, max_length=256,
                progress=False, gen_kwargs={"max_tokens": 40, "batch_size": 64})
        train(load_config(["recipe=tiny", f"out_dir={root / 'run'}", f"target.path={target}",
                           f"data.prepared={root / 'data'}", "logging.progress=false", "eval.at_start=false",
                           "eval.true_tau_prompts=0", "checkpoint.every=0", "train.max_steps=2", "logging.every=1"]))
        rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines() if x]
        got = [r["loss"] for r in rows if "loss" in r]
    out = Path(__file__).with_name("train_tiny_2step.json")
    out.write_text(json.dumps({"losses": got, "torch": torch.__version__}, indent=2) + "\n")
    print(out, got)


if __name__ == "__main__":
    main()
