"""Benchmarks for the feature path; one JSON line per result (tests run it at toy sizes only).

    python -m data.bench                                  # random-weight Qwen3-shaped target, CPU or CUDA
    python -m data.bench --hidden 2048 --layers 24 --rows 64 --seq 1024 --device cuda

Prints:

- ``forward``:  plain target forward (logits) tokens/s over the benchmark batches
- ``tapped_forward``: the target forward that returns only the tapped layers (what extraction runs)
- ``extract``:  per dtype, extraction tokens/s (target forward + quantize + shard write + checksum)
  and its overhead in % over the plain forward (negative is possible: the tapped forward stops
  at the deepest tap) and over the tapped forward (the cost of the store itself); the same
  without the final drain (``drain_s``: the last shards' writes after the last forward, paid once
  per job), and the disk's own ceiling for the store's bytes (``bound``: disk or forward)
- ``bytes``:    per dtype, feature bytes per token and whole-store bytes per token
- ``read``:     per dtype, store read throughput (tokens/s, MB/s) with and without checksum verification
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from data.extract import extract
from data.store import DTYPES, FeatureStore
from models.config import default_layer_ids


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def check_device(p: argparse.ArgumentParser, device: str | None) -> str:
    """``--device`` up front (``models.support.check_device``, cpu or cuda only): a malformed name is an argparse
    error, CUDA where torch sees none one line, not torch's "not compiled with CUDA"
    assertion after the model is built. None: cuda when there is one, else cpu."""
    from models.support import DeviceNameError
    from models.support import check_device as check

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return check(device, kinds=("cpu", "cuda"))
    except DeviceNameError as e:
        p.error(str(e))


def check_at_least(p: argparse.ArgumentParser, a: argparse.Namespace, **lows: int) -> None:
    """Integer flags below their smallest useful value end in one argparse line naming the flag and range."""
    for name, low in lows.items():
        for v in (getattr(a, name) if isinstance(getattr(a, name), list) else [getattr(a, name)]):
            if v is not None and v < low:
                p.error(f"--{name.replace('_', '-')} {v}: use {low} or more")


def disk_speed(nbytes: int) -> dict:
    """Sequential write + fsync and sha256 speed where the stores go: the ceiling of extraction is
    ``min(write, hash x writers) / store bytes per token`` whatever the GPU does."""
    buf = torch.randint(0, 255, (min(nbytes, 1 << 30),), dtype=torch.uint8).numpy()
    with tempfile.TemporaryDirectory(prefix="dsbench-disk-") as d:
        t0 = time.perf_counter()
        with open(os.path.join(d, "x"), "wb") as f:
            f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        write = buf.nbytes / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    sha = buf.nbytes / (time.perf_counter() - t0)
    return {"write_MB_per_s": round(write / 2**20, 1), "sha256_MB_per_s": round(sha / 2**20, 1)}


def random_data(rows: int, seq: int, vocab: int):
    # start-up time (data.bench --help)
    import pyarrow as pa
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq), generator=g).tolist()
    table = pa.table({"input_ids": ids, "loss_mask": [[0] * (seq // 4) + [1] * (seq - seq // 4)] * rows,
                      "doc_ids": [[0] * seq] * rows, "position_ids": [list(range(seq))] * rows,
                      "num_tokens": [seq] * rows, "num_loss_tokens": [seq - seq // 4] * rows})
    # A named fingerprint: the default one pickles the whole table with dill, which failed on a GPU node
    # ("Can't pickle <class 'MonthDayNano'>": dill pickles pyarrow by value where pyarrow lies outside the
    # interpreter's prefixes and outside site-packages, on any Python), and these rows are a pure function of
    # the arguments anyway.
    return Dataset(table, fingerprint=f"bench-random-{rows}x{seq}-v{vocab}")


def extract_figures(tokens: int, seconds: float, drain: float, forward_tps: float, tapped_tps: float,
                    disk_tps: float) -> dict:
    """The ``extract`` line's figures from one timed extraction of ``tokens`` in ``seconds``.

    ``drain`` (the wait for the last shards' writes after the last forward) is a fixed cost per job,
    not per token: a store of thousands of shards pays it once, a 16-row benchmark pays it on every
    row. ``steady_*`` leave it out. ``disk_bound_tokens_per_s`` is the rate at which this disk takes
    the store's bytes: where it is below the tapped forward, extraction cannot reach the forward's
    speed, and the overhead that the store itself adds is measured against the disk (``bound``).
    """
    tps, steady = tokens / seconds, tokens / max(seconds - drain, 1e-9)
    ceiling = min(tapped_tps, disk_tps)
    pct = lambda ref, x: round((ref / x - 1) * 100, 1)  # noqa: E731
    return {"tokens_per_s": round(tps, 1), "overhead_pct_vs_forward": pct(forward_tps, tps),
            "overhead_pct_vs_tapped_forward": pct(tapped_tps, tps), "drain_s": round(drain, 3),
            "steady_tokens_per_s": round(steady, 1), "steady_overhead_pct_vs_tapped_forward": pct(tapped_tps, steady),
            "disk_bound_tokens_per_s": round(disk_tps, 1), "bound": "disk" if disk_tps < tapped_tps else "forward",
            "steady_overhead_pct_vs_bound": pct(ceiling, steady)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m data.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="target hidden size (default 512)")
    p.add_argument("--layers", type=int, default=12, help="target layers (default 12)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--rows", type=int, default=16, help="rows of random tokens (default 16)")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (default 512)")
    p.add_argument("--batch-size", type=int, default=4, help="rows per forward (default 4)")
    p.add_argument("--taps", type=int, default=5, help="tapped layers (default 5)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["bf16", "fp8"],
                   help="store dtypes to measure (default: bf16 fp8)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats; the best is reported (default 2)")
    p.add_argument("--shard-rows", type=int, default=4, help="rows per shard (default 4: many shards, so the "
                   "steady state is timed rather than the last shard's write)")
    p.add_argument("--writers", type=int, default=2, help="background shard writers of extraction (default 2)")
    p.add_argument("--keep-stores", action="store_true",
                   help="keep the feature stores written (one per dtype; the path is printed) instead of deleting "
                        "them at the end: a default CUDA run writes tens of GB")
    a = p.parse_args(argv)
    check_at_least(p, a, hidden=4, layers=1, vocab=1, rows=1, seq=1, batch_size=1, taps=1, repeats=1,
                   shard_rows=1, writers=1)
    if a.hidden < 256 and a.hidden % 4:  # below 256 the random target has 2 heads of hidden / 2: RoPE wants it even
        p.error(f"--hidden {a.hidden}: use a multiple of 4 below 256")
    device = check_device(p, a.device)
    # One folder for every store, removed at the end whatever happens (error, Ctrl-C) unless kept.
    root = tempfile.mkdtemp(prefix="dsbench-")
    try:
        _run(a, device, root)
    finally:
        if a.keep_stores:
            print(f"feature stores kept in {root} (one folder per dtype; delete it when done)", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def _run(a: argparse.Namespace, device: str, root: str) -> None:
    from models.random_target import qwen3_target  # start-up time (data.bench --help): transformers' models

    layer_ids = default_layer_ids(a.layers, a.taps)  # too many taps for the layers: one line before any build
    target = qwen3_target(a.hidden, a.layers, a.vocab, device, torch.bfloat16)
    data = random_data(a.rows, a.seq, a.vocab)
    tokens = a.rows * a.seq
    common = {"device": device, "hidden": a.hidden, "layers": a.layers, "taps": layer_ids, "rows": a.rows, "seq": a.seq}

    batches = [torch.tensor(data[i:i + a.batch_size]["input_ids"], device=device)
               for i in range(0, a.rows, a.batch_size)]
    with torch.no_grad():
        target.model(batches[0])  # warm-up
        best = float("inf")
        for _ in range(a.repeats):
            _sync(device)
            t0 = time.perf_counter()
            for b in batches:
                target.model(b)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    forward_tps = tokens / best
    print(json.dumps({"bench": "forward", **common, "tokens_per_s": round(forward_tps, 1)}), flush=True)
    with torch.no_grad():
        best = float("inf")
        for _ in range(a.repeats):
            _sync(device)
            t0 = time.perf_counter()
            for b in batches:
                target.forward(b, layer_ids, with_logits=False)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    tapped_tps = tokens / best
    print(json.dumps({"bench": "tapped_forward", **common, "tokens_per_s": round(tapped_tps, 1)}), flush=True)

    disk = disk_speed(a.rows * a.seq * len(layer_ids) * a.hidden)
    print(json.dumps({"bench": "disk", **common, **disk}), flush=True)
    for dtype in a.dtypes:
        best, drain, store_dir = float("inf"), 0.0, Path(root) / dtype
        for _ in range(a.repeats):
            shutil.rmtree(store_dir, ignore_errors=True)  # the last repeat's store is the one read below
            _sync(device)
            t0 = time.perf_counter()
            report = extract(target, data, store_dir, layer_ids=layer_ids, dtype=dtype, batch_size=a.batch_size,
                             shard_tokens=a.shard_rows * a.seq, progress=False, writers=a.writers)
            _sync(device)
            dt = time.perf_counter() - t0
            if dt < best:  # the drain of the repeat reported
                best, drain = dt, min(report.drain_seconds, dt)
        store = FeatureStore(store_dir)
        shards = store.index["shards"].values()
        feat_bytes = sum(s["feature_bytes"] for s in shards)
        file_bytes = sum(s["bytes"] for s in shards)
        print(json.dumps({"bench": "extract", **common, "dtype": dtype,
                          **extract_figures(tokens, best, drain, forward_tps, tapped_tps,
                                            disk["write_MB_per_s"] * 2**20 * tokens / file_bytes)}), flush=True)
        print(json.dumps({"bench": "bytes", **common, "dtype": dtype, "feature_bytes_per_token": feat_bytes / tokens,
                          "store_bytes_per_token": round(file_bytes / tokens, 1),
                          "bf16_feature_bytes_per_token": len(layer_ids) * a.hidden * 2}), flush=True)
        for verify in (True, False):
            s = FeatureStore(store_dir, verify=verify, device=device)
            _sync(device)
            t0 = time.perf_counter()
            for i in range(0, len(s), a.batch_size):
                s.get_batch(range(i, min(i + a.batch_size, len(s))))
            _sync(device)  # the last batch's copy to the GPU (and fp8 dequantisation) is queued, not done
            dt = time.perf_counter() - t0
            print(json.dumps({"bench": "read", **common, "dtype": dtype, "verify_checksums": verify,
                              "tokens_per_s": round(tokens / dt, 1), "MB_per_s": round(file_bytes / dt / 2**20, 1)}),
                  flush=True)


if __name__ == "__main__":
    from models.support import run_cli

    run_cli(main)
