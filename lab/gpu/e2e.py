"""A recipe's whole training run on a GPU beside the bench, their MFU compared (lab/gpu/measure.sh, issue 45).

    python lab/gpu/e2e.py qwen35-9b --work /dev/shm/measure --jsonl OUT/measure.jsonl    # CUDA, a few minutes
    python lab/gpu/e2e.py qwen35-9b --work /tmp/measure --jsonl /tmp/measure.jsonl --dry  # CPU, tiny shapes

1. A random-weight target of the recipe's exact shape (``models.random_target.recipe_target``, bf16, built on
   the GPU) is saved to ``--work`` with the tiny byte tokenizer (``models.tiny``): a folder ``target.path`` names.
2. ``python -m train.bench --e2e RECIPE --compile``: the bench's MFU at this commit, on this card.
3. ``accelerate launch train/distill.py recipe=RECIPE`` with the recipe's settings (``train.compile`` left at
   its default), ``train.max_steps=60``, ``data.regenerate=none`` on a synthetic chat source whose rows fill
   ``data.max_length`` (a quarter prompt, the rest answer, as the bench's rows), no held-out rows (a true-tau
   generation on a random 9B target would take minutes and measure nothing).
4. One JSON line each (``--jsonl``): the target's build, the bench row, the run's logged rows and the
   comparison (median logged MFU of steps 20-60 against the bench's, within 5%?). The folders are deleted.

``--dry``: the same plumbing on a CPU: a tiny random target of the recipe's architecture, the run cut to 2
steps of short rows, the bench's ``--e2e tiny`` (no compile, no MFU: CPU runs log none).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # lab/ is never installed: run from the checkout

WORDS = ("the model drafts a block of tokens and the target verifies them in one pass while the cache rolls back to "
         "what was accepted so each cycle commits one or more tokens").split()
ARCH = {"qwen3": "qwen3", "qwen3_5": "qwen3_5", "llama": "llama"}  # a recipe's model_type -> its tiny twin


def note(path: str | None, row: dict) -> None:
    """One JSON line to ``--jsonl`` and to stdout."""
    line = json.dumps(row)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def write_chats(path: Path, n: int, prompt_chars: int, answer_chars: int, seed: int = 0) -> Path:
    """``n`` conversations (OpenAI messages JSONL): a user turn, then an assistant answer. With the byte tokenizer
    a character is a token, so a prompt of a quarter of ``data.max_length`` and a longer answer fill the row as
    the bench's rows do (loss on the last three quarters)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "user", "content": f"{i}: " + text(rng, prompt_chars)},
                        {"role": "assistant", "content": text(rng, answer_chars)}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def save_random_target(recipe: str, out: Path, dry: bool) -> dict:
    """A random-weight target of ``recipe``'s shape (dry: its tiny twin) with the tiny byte tokenizer, saved."""
    import torch

    from models.random_target import recipe_spec, recipe_target
    from models.tiny import tiny_target, tiny_tokenizer

    t0 = time.perf_counter()
    kind = recipe_spec(recipe)["target"]["model_type"]
    if dry:
        model = tiny_target(ARCH[kind], num_layers=8, dtype=torch.float32)
    else:
        model = recipe_target(recipe, "cuda", torch.bfloat16).model
    built = time.perf_counter() - t0
    model.save_pretrained(out, max_shard_size="5GB")
    tiny_tokenizer("llama3" if kind == "llama" else "chatml").save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    if not dry:
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {"measure": "random_target", "recipe": recipe, "model_type": kind, "parameters": params,
            "bytes": size, "build_s": round(built, 1), "save_s": round(time.perf_counter() - t0 - built, 1),
            "folder": str(out)}


def run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, float, str]:
    """``cmd`` with its output appended to ``log`` as it comes (a run stopped by the time cap keeps what it said);
    (return code, seconds, what it printed)."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        start = f.tell()
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    with open(log, errors="replace") as f:
        f.seek(start)
        said = f.read()
    return code, time.perf_counter() - t0, said


def json_lines(out: str) -> list[dict]:
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def logged_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def compare(recipe: str, rows: list[dict], bench: dict | None, tolerance: float = 0.05) -> dict:
    """The run's logged MFU (median over the rows of steps 20 on: the first row's window holds the steps right
    after compilation) against the bench's; ``within`` is |run / bench - 1| <= tolerance."""
    steps = [r for r in rows if "loss" in r]
    late = [r for r in steps if r["step"] >= 20] or steps
    mfu = [r["mfu"] for r in late if r.get("mfu") is not None]
    run_mfu = statistics.median(mfu) if mfu else None
    bench_mfu = (bench or {}).get("mfu")
    ratio = run_mfu / bench_mfu if run_mfu and bench_mfu else None
    return {"measure": "mfu_compare", "recipe": recipe, "run_mfu_median": run_mfu, "run_mfu": mfu,
            "bench_mfu": bench_mfu, "ratio": None if ratio is None else round(ratio, 4),
            "within": None if ratio is None else abs(ratio - 1) <= tolerance, "tolerance": tolerance,
            "run_tokens_per_s": [r.get("tokens_per_s") for r in late],
            "bench_tokens_per_s": (bench or {}).get("tokens_per_s"),
            "compile_s": next((r["compile_s"] for r in steps if "compile_s" in r), None),
            "device": (bench or {}).get("device")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="a recipe with a random-target shape: qwen35-9b, qwen3-8b, ...")
    p.add_argument("--work", required=True, help="folder for the target, the data and the run (deleted after)")
    p.add_argument("--jsonl", default=None, help="append the JSON lines to this file")
    p.add_argument("--log", default=None, help="the commands' output (default: WORK/../RECIPE.log)")
    p.add_argument("--steps", type=int, default=60, help="training steps of the run (default 60)")
    p.add_argument("--bench-steps", type=int, default=3, help="timed bench steps (default 3, one warm-up)")
    p.add_argument("--skip-bench", action="store_true", help="the run alone")
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU: the plumbing, no figures")
    p.add_argument("--keep", action="store_true", help="keep the target and run folders")
    a = p.parse_args(argv)
    work = Path(a.work) / a.recipe
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = Path(a.log) if a.log else work.parent / f"{a.recipe}.log"
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if a.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        row = save_random_target(a.recipe, work / "target", a.dry)
        note(a.jsonl, row)
        bench = None
        if not a.skip_bench:
            cmd = [py, "-m", "train.bench", "--e2e", "tiny" if a.dry else a.recipe, "--steps", str(a.bench_steps),
                   "--warmup", "1"] + ([] if a.dry else ["--compile"])
            rc, seconds, out = run(cmd, log, env)
            rows = json_lines(out)
            bench = next((r for r in rows if r.get("bench") == "train_e2e"), None)
            note(a.jsonl, {"measure": "bench", "recipe": a.recipe, "rc": rc, "seconds": round(seconds, 1),
                           "command": " ".join(cmd[1:]), "row": bench,
                           "parts": next((r for r in rows if r.get("bench") == "train_parts"), None)})
        seq = 256 if a.dry else 3072  # the recipe's data.max_length
        chats = write_chats(work / "chats.jsonl", n=16 if a.dry else 64, prompt_chars=seq // 4 - 24,
                            answer_chars=seq)
        overrides = [f"recipe={a.recipe}", f"target.path={work / 'target'}", f"data.source={chats}",
                     "data.split=train", "data.regenerate=none", "data.eval_rows=0", f"data.prepared={work / 'data'}",
                     f"out_dir={work / 'run'}", f"train.max_steps={a.steps}", "logging.progress=false",
                     "logging.every=10", "checkpoint.every=0"]
        if a.dry:  # short rows, few blocks, a drafter a CPU trains in seconds; taps that fit 8 layers
            overrides += [f"data.max_length={seq}", "train.anchors=16", "train.grad_accum=1", "logging.every=1",
                          "drafter.num_taps=3", "drafter.num_hidden_layers=1"]
            cmd = [py, "train/distill.py", *overrides]
        else:
            cmd = [py, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
                   "--mixed_precision", "bf16", "--dynamo_backend", "no", "train/distill.py", *overrides]
        rc, seconds, said = run(cmd, log, env)
        rows = logged_rows(work / "run")
        note(a.jsonl, {"measure": "distill", "recipe": a.recipe, "rc": rc, "seconds": round(seconds, 1),
                       "command": " ".join(cmd[cmd.index("train/distill.py"):]),
                       "compile_line": next(iter(re.findall(r"train\.compile: .*", said)), None),
                       "fell_back": "compiling the layers failed" in said, "rows": rows})
        note(a.jsonl, compare(a.recipe, rows, bench))
        return rc
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
