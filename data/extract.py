"""Extract target features once, to a sharded offline store (:mod:`data.store`).

    python -m data.extract --target Qwen/Qwen3-8B --data data/qwen3-8b --out feats/qwen3-8b --dtype fp8
    python -m data.extract --target ./tiny-target --data /tmp/tiny-data --out /tmp/tiny-feats \\
        --layers 1 3 5 --dtype bf16 --topk 32

``--data`` is a folder written by ``python -m data.prepare``. Layers default to the drafter
default (5 taps spread over the target, see ``models.config.default_layer_ids``). Rows are split
into shards of about ``--shard-mb`` MiB (the plan is fixed in the index when the store is
created); each shard is computed in batches of ``--batch-size`` rows with the same code as the
online provider, written atomically and checksummed. Re-running the same command resumes: intact
finished shards are kept, the rest are computed. A store made for another target, other layers,
dtype or data refuses to be resumed into.

Data-parallel, on every GPU of every node sharing a filesystem (one process per GPU):

    accelerate launch --num_processes 8 -m data.extract --target Qwen/Qwen3-8B --data data/q --out feats/q
    torchrun --nnodes 2 --node-rank $RANK --nproc-per-node 8 --rdzv-endpoint $HEAD:29500 -m data.extract ...

The shard plan is fixed in the index, so process ``r`` of ``w`` computes every ``w``-th of the
shards still missing (``todo[r::w]``), each on its own GPU. Process 0 creates or resumes the index
before the others start and writes the finished index after they all stop; the others only write
their shards (and a sidecar entry per shard, see :class:`data.store_writer.StoreWriter`). The store is
byte-identical to a one-process run; re-running the same command after a kill (of any rank, with
any number of processes) computes only what is missing. A target too large for one GPU:
``--device-map auto`` (one process per node) spreads its layers over the node's GPUs, within
``--max-memory`` per device. While it runs, process 0 holds ``--out/.extract.lock``: a second
extraction into the same store (relaunched while the first still runs) is refused before its target loads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm

from data.chat import tokenizer_fingerprint
from data.features import FeatureRow, OnlineFeatures, check_layer_ids
from data.prepare import check_target_tokenizer, load_prepared, require_prepared
from data.store import DTYPES, quantize_fp8, target_identity
from data.store_writer import StoreWriter, check_store_folder
from data.store_writer import LOCK  # in the store folder, held by rank 0 while an extraction writes there
from models.config import default_layer_ids
from models.config_keys import ConfigError


@dataclass
class Ranks:
    """This process's share of a data-parallel extraction (``rank`` of ``world``, and a barrier)."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=lambda: None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, todo: list[int]) -> list[int]:
        """Every ``world``-th missing shard: balanced, disjoint, and the same split on every rank."""
        return todo[self.rank::self.world]


@dataclass
class ExtractReport:
    rank: int = 0
    world: int = 1
    complete: bool | None = None  # every shard of the plan is in the index (rank 0 knows; None on the others)
    shards: int = 0
    shards_skipped: int = 0
    shards_written: int = 0
    rows: int = 0
    tokens: int = 0
    tokens_extracted: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    # Of ``seconds``, the wait for the last shards' writes after the last forward: a fixed cost per
    # job (at most ``writers`` shards), which a short benchmark would otherwise read as per-token overhead.
    drain_seconds: float = 0.0
    out: str = ""

    def line(self) -> str:
        return json.dumps({"extract": asdict(self)})


def bytes_per_token(hidden: int, taps: int, dtype: str, topk: int = 0) -> int:
    """Stored bytes per token (features + ids/mask/docs + top-k)."""
    feat = taps * hidden * 2 if dtype == "bf16" else taps * hidden + taps * 2
    return feat + 4 + 1 + 4 + 4 + topk * 6


def shard_plan(lengths: list[int], tokens_per_shard: int) -> list[tuple[int, int]]:
    """Consecutive row ranges of about ``tokens_per_shard`` tokens (at least one row each)."""
    plan, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if used and used + n > tokens_per_shard:
            plan.append((start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        plan.append((start, len(lengths)))
    return plan


def extract(target, data, out: str | Path, *, layer_ids: list[int] | None = None, dtype: str = "bf16",
            topk: int = 0, batch_size: int = 8, shard_mb: float = 2048, shard_tokens: int | None = None,
            max_shards: int | None = None, progress: bool = True, ranks: Ranks | None = None,
            writers: int = 1, force_target: bool = False) -> ExtractReport:
    """Extract features of prepared ``data`` (folder or loaded dataset) with ``target`` into ``out``.

    ``max_shards`` stops after writing that many new shards (tests use it to interrupt a run).
    ``ranks``: this process's share when several extract into one store (see the module docstring).
    ``writers``: shards serialised, hashed and written at once by background threads while the
    target computes the next ones (each holds one shard in host memory; the CLI uses 2).
    """
    from models.target import TargetModel  # start-up time (data.extract --help)

    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {DTYPES}")
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: use 1 or more rows per target forward")
    if isinstance(target, (str, Path)):
        target = TargetModel.from_pretrained(target)
    if not 0 <= topk <= target.vocab_size:  # torch's "selected index k out of range" came mid-extraction
        raise ValueError(f"--topk {topk}: use 0 (off) up to the target's vocabulary size {target.vocab_size} "
                         "(e.g. 32)")
    meta = {}
    if isinstance(data, (str, Path)):
        # answers another target regenerated: training refuses their store, so refuse before hours of extraction
        dataset, meta = load_prepared(data, tokenizer=target.tokenizer, target=target, force=force_target,
                                      fix="prepare the data with this target, or pass --force-target to extract "
                                          "anyway (training then needs data.force_target=true)")
    else:
        dataset = data
    if not layer_ids:
        try:
            layer_ids = default_layer_ids(target.num_layers)
        except ConfigError:
            raise ValueError(f"the default 5 taps do not fit a {target.num_layers}-layer target (they lie in layers "
                             "1..L-3): pass --layers with the drafter's target_layer_ids, e.g. --layers "
                             + " ".join(map(str, range(1, max(target.num_layers - 2, 2))))) from None
    layer_ids = list(layer_ids)
    provider = OnlineFeatures(target, layer_ids, dataset, topk=topk)
    lengths = [int(n) for n in dataset["num_tokens"]]
    per_token = bytes_per_token(target.hidden_size, len(layer_ids), dtype, topk)
    plan = shard_plan(lengths, shard_tokens or max(1, int(shard_mb * 2**20 / per_token)))
    header = {**target_identity(target), "layer_ids": layer_ids, "hidden_size": target.hidden_size,
              "feature_dim": target.hidden_size * len(layer_ids), "dtype": dtype, "topk": topk,
              "pad_id": provider.pad_id,
              "tokenizer_hash": tokenizer_fingerprint(target.tokenizer) if target.tokenizer is not None else None,
              "data": str(data) if isinstance(data, (str, Path)) else "<in-memory>",
              "data_fingerprint": getattr(dataset, "_fingerprint", None), "data_meta": meta,
              "rows": len(lengths), "tokens": sum(lengths)}
    ranks = ranks or Ranks()
    if ranks.is_main:  # creates or resumes the index (adopting shards a killed run finished) first
        writer = StoreWriter(out, header, plan)
    ranks.barrier()
    if not ranks.is_main:
        writer = StoreWriter(out, header, plan, main=False)
    report = ExtractReport(rank=ranks.rank, world=ranks.world, shards=len(plan), rows=len(lengths),
                           tokens=sum(lengths), out=str(out))
    start = time.time()
    todo = [k for k in range(len(plan)) if not writer.done(k)]
    # Every rank reads the missing shards before any is written: a rank that read the index after rank 0 had
    # finished a shard took another share (shards left out, and one written by two processes at once).
    ranks.barrier()
    report.shards_skipped = len(plan) - len(todo)
    mine = ranks.share(todo)
    mine_tokens = sum(sum(lengths[slice(*plan[k])]) for k in mine)
    def written(info: dict) -> None:
        report.shards_written += 1
        report.tokens_extracted += info["tokens"]
        report.bytes_written += info["bytes"]

    taps = len(layer_ids)
    with tqdm(total=mine_tokens, desc=f"extract (rank {ranks.rank}/{ranks.world})" if ranks.world > 1 else "extract",
              unit="tok", unit_scale=True, disable=not progress) as bar, ShardWriters(writer, writers, written) as pool:
        for n_submitted, k in enumerate(mine):
            if max_shards is not None and n_submitted >= max_shards:
                break
            a, b = plan[k]
            rows, quantized, device = [], [], None
            for i in range(a, b, batch_size):
                batch = provider.get_batch(range(i, min(i + batch_size, b)))
                device = batch.features.device
                for j in range(batch.input_ids.shape[0]):
                    row, q = _to_host(batch, j, dtype, taps)
                    rows.append(row)
                    quantized.append(q)
                bar.update(int(batch.lengths.sum()))
            pool.submit(k, rows, quantized if dtype == "fp8" else None, device)
    report.seconds = round(time.time() - start, 3)
    report.drain_seconds = round(pool.drain_seconds, 3)
    ranks.barrier()  # every process has stopped writing: rank 0 writes the finished index
    if ranks.is_main:
        report.complete = writer.finalise()
    return report


def init_ranks() -> tuple[Ranks, torch.device | None]:
    """Ranks from the launcher's environment (``accelerate launch`` / ``torchrun``), and this rank's device.

    One process: ``Ranks()`` and no device preference. Several: accelerate's ``PartialState`` joins
    the process group (NCCL on GPUs, gloo on CPUs), with a long timeout because ranks reach the
    final barrier as far apart as one shard's extraction.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks(), None

    from accelerate import PartialState  # start-up time (data.extract --help)

    # cpu=True is what makes accelerate join a CPU process group (gloo) instead of staying single-process.
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=12))
    return Ranks(state.process_index, state.num_processes, state.wait_for_everyone), state.device


class ShardWriters:
    """Shards written by background threads (serialise, hash, fsync) while the GPU computes the next.

    At most ``threads`` shards are in flight: a full pool makes ``submit`` wait for the oldest (and
    re-raises its error), so host memory stays bounded. Rows may still be arriving from the GPU
    (pinned non-blocking copies): each shard waits for its copies' event before it is serialised.
    """

    def __init__(self, writer, threads: int, on_written):
        self.writer, self.threads, self.on_written = writer, max(int(threads), 1), on_written
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="shard-writer")
        self.pending = deque()
        self.drain_seconds = 0.0  # time spent at exit waiting for the shards still being written

    def submit(self, k: int, rows: list, quantized: list | None, device: torch.device | None = None) -> None:
        event = None
        if device is not None and device.type == "cuda":  # rows may be in-flight copies from this GPU
            # Recorded on the features' device's stream, where the copies were queued: a bare record()
            # marks the *current* device's stream (cuda:0 for --device cuda:1), which the copies never used.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        while len(self.pending) >= self.threads:
            self.on_written(self.pending.popleft().result())
        self.pending.append(self.pool.submit(self._write, k, rows, quantized, event))

    def _write(self, k: int, rows: list, quantized: list | None, event):
        if event is not None:
            event.synchronize()
        if quantized is not None:
            quantized = (torch.cat([q for q, _ in quantized]), torch.cat([s for _, s in quantized]))
        if quantized is None:
            return self.writer.write_shard(k, rows)
        return self.writer.write_shard(k, rows, quantized=quantized)

    def __enter__(self) -> "ShardWriters":
        return self

    def __exit__(self, exc_type, *_):
        t0 = time.perf_counter()
        try:
            while self.pending:
                info = self.pending.popleft().result()
                if exc_type is None:
                    self.on_written(info)
        finally:
            self.pool.shutdown(wait=True)
            self.drain_seconds = time.perf_counter() - t0


def _to_host(batch, j: int, dtype: str, taps: int):
    """Row ``j`` without padding on the host, and (fp8 stores) its features quantized on their device.

    CUDA features go to pinned host memory with non-blocking copies (``ShardWriters`` waits for
    them), so the next forward is queued without waiting for the copy; fp8 is quantized on the GPU
    (same rounding as on the CPU: one IEEE division and one e4m3 cast per value) and copies half the
    bytes.
    """
    n = int(batch.lengths[j])
    feats = batch.features[j, :n]
    q = quantize_fp8(feats, taps) if dtype == "fp8" else None
    row = _unpad(batch, j, features=False)
    if feats.is_cuda:
        host = lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)  # noqa: E731
        q = None if q is None else (host(q[0]), host(q[1]))
        row.features = None if q is not None else host(feats)
    else:
        row.features = None if q is not None else feats
    return row, q


def _unpad(batch, j: int, features: bool = True):
    n = int(batch.lengths[j])
    sl = lambda t: None if t is None else t[j, :n].cpu()
    return FeatureRow(sl(batch.input_ids), sl(batch.loss_mask), sl(batch.doc_ids), sl(batch.position_ids),
                      sl(batch.features) if features else None, sl(batch.topk_ids), sl(batch.topk_logprobs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m data.extract", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True,
                   help="target folder or Hub id (must be the one the data was prepared for)")
    p.add_argument("--data", required=True, help="prepared data folder (python -m data.prepare --out)")
    p.add_argument("--out", required=True, help="store folder; rerun with the same folder to resume")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="target layer ids to tap, in drafter config order "
                        "(default: 5 taps, models.config.default_layer_ids)")
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                   help="stored feature type: bf16, or fp8 e4m3 + per-token-per-layer scale (half the bytes)")
    p.add_argument("--topk", type=int, default=0,
                   help="also store the target's top-k next-token log-probs (for KL); 0 = off")
    p.add_argument("--batch-size", type=int, default=8, help="rows per target forward (default 8)")
    p.add_argument("--writers", type=int, default=2,
                   help="background threads that serialise, hash and write finished shards while the target "
                        "computes the next (default 2; each holds one shard in host memory)")
    p.add_argument("--shard-mb", type=float, default=2048, help="approximate shard size in MiB (default 2048)")
    p.add_argument("--device", default=None,
                   help="torch device for the target (default: this process's GPU under a launcher, "
                        "else cuda if available)")
    p.add_argument("--device-map", default=None, metavar="auto|balanced|...",
                   help="spread a target too large for one GPU over this node's GPUs (transformers device_map); "
                        "run one process per node")
    p.add_argument("--max-memory", default=None, metavar="0=70GiB,1=70GiB,cpu=200GiB",
                   help="per-device budget for --device-map (default: what transformers finds free)")
    p.add_argument("--target-dtype", default="bfloat16",
                   help="target weights dtype: bfloat16 (bf16), float32 (fp32), float16 (fp16) or auto (the "
                        "checkpoint's; default bfloat16)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    p.add_argument("--force-target", action="store_true",
                   help="extract even though another target (or quantization) regenerated the data's answers")
    a = p.parse_args(argv)
    if a.writers < 1:
        p.error(f"--writers {a.writers}: use 1 or more background shard writers")
    # Before anything is loaded or written: these crashed mid-extraction (--topk -1, --batch-size 0), or
    # silently wrote one-row shards (--shard-mb 0).
    if a.topk < 0:
        p.error(f"--topk {a.topk}: use 0 (off) or the number of top next-token log-probs to store, e.g. 32")
    if a.batch_size < 1:
        p.error(f"--batch-size {a.batch_size}: use 1 or more rows per target forward")
    if not a.shard_mb > 0:  # nan too
        p.error(f"--shard-mb {a.shard_mb}: use a positive shard size in MiB (default 2048)")
    from models.support import check_device, full_disk_named, parse_dtype
    from models.target import parse_max_memory  # start-up time (data.extract --help)

    a.target_dtype = parse_dtype(a.target_dtype, "--target-dtype", auto=True)
    a.device = check_device(a.device)
    max_memory = parse_max_memory(a.max_memory)  # a typo fails here, before any process group or weights
    check_store_folder(a.out)  # a folder that is no store (the prepared data, a drafter) before the target loads
    require_prepared(a.data)  # a mistyped --data was found only after the target had loaded (minutes for a large one)
    if a.layers:  # an id past the target's depth, too: from its config.json, before its weights load
        from models.target_folder import read_target_config  # start-up time (data.extract --help)

        config = read_target_config(a.target, weights=False)[1]
        check_layer_ids(a.layers, (config.get("text_config") or config)["num_hidden_layers"])
    ranks, rank_device = init_ranks()
    with contextlib.ExitStack() as held:
        if ranks.is_main:  # a second extraction into the store (a relaunch while the first runs) would write the
            from models.support import hold  # same shards and index: refused before its target loads

            held.enter_context(hold(a.out, LOCK, "--out", "wait for it to end (rerunning the same command then "
                                    "resumes), or give this extraction its own --out", print))
        held.enter_context(full_disk_named(a.out, "it resumes: finished shards are kept, the missing ones are "
                                                 "computed"))
        report = _load_and_extract(a, ranks, rank_device, max_memory)
    # one write per line: the ranks of a launch share stdout, and print's separate newline write let two
    # ranks' lines run together (a write under PIPE_BUF bytes is atomic)
    sys.stdout.write(report.line() + "\n")
    sys.stdout.flush()
    if ranks.is_main and not report.complete:
        sys.exit("extraction stopped early; re-run the same command to resume")


def _load_and_extract(a: argparse.Namespace, ranks: Ranks, rank_device, max_memory) -> ExtractReport:
    from models.target import TargetModel  # start-up time (data.extract --help)

    # before the target loads: without tokenizer files the data's tokenizer could not be checked against it
    check_target_tokenizer(a.target, "data.extract checks the prepared data against the target's tokenizer: add the "
                           "target's tokenizer files to the folder (they come with the model's repo)")

    if a.device_map:
        target = TargetModel.from_pretrained(a.target, dtype=a.target_dtype, device_map=a.device_map,
                                             max_memory=max_memory)
    else:
        device = a.device or rank_device or ("cuda" if torch.cuda.is_available() else "cpu")
        target = TargetModel.from_pretrained(a.target, dtype=a.target_dtype, device=device)
    report = extract(target, a.data, a.out, layer_ids=a.layers, dtype=a.dtype, topk=a.topk, batch_size=a.batch_size,
                     shard_mb=a.shard_mb, progress=not a.no_progress, ranks=ranks, writers=a.writers,
                     force_target=a.force_target)
    return report


def cli() -> None:
    """The ``draftsmith-extract`` console script: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.support import run_cli

    run_cli(main, interrupted='rerun the same command to resume: finished shards are kept')


if __name__ == "__main__":
    cli()
