"""Writing the offline feature store (:mod:`data.store` describes the format and reads it).

Shards are serialised straight from the rows' memory (no copy of the whole shard), hashed on the
way by a second thread, written to a temp file, fsynced and renamed; the index is rewritten
(temp + rename) after each shard. Several processes write one store: process 0 owns the index,
the others leave a sidecar entry per shard that process 0 adopts (see :class:`StoreWriter`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from data.features import FeatureRow
from data.store import (FORMAT, INDEX, VERSION, StoreMismatch, quantize_fp8, read_index, sha256_file, shard_name,
                        sidecar_name)

LOCK = ".extract.lock"  # in the store folder, held by data.extract's rank 0 while it writes there (models.support)
# What a store folder may hold before its index.json exists: the extraction's lock, and the index's temp file of a
# run killed while writing the index the first time.
_BEFORE_INDEX = {LOCK, INDEX + ".tmp"}

_ST_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.bfloat16: "BF16",
              torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def write_safetensors(f, tensors: dict[str, torch.Tensor | list[torch.Tensor]]) -> tuple[int, str]:
    """Write ``tensors`` to the open file ``f`` in the safetensors format; return (bytes, sha256).

    Shards are hundreds of MB: ``safetensors.torch.save`` copies every tensor into one bytes object
    (~0.7 GB/s), then the file write and the hash each pass over it. Here each tensor's memory is
    written as it lies (a list is written as its parts concatenated along dim 0), while a second
    thread hashes the same buffers (hashlib and file writes release the GIL). Names are sorted so
    equal shards give equal bytes; any safetensors reader opens the file.
    """
    header, views, offset = {}, [], 0
    for name in sorted(tensors):
        parts = tensors[name] if isinstance(tensors[name], list) else [tensors[name]]
        shape = [sum(p.shape[0] for p in parts), *parts[0].shape[1:]] if parts[0].dim() else []
        start = offset
        for p in parts:
            p = p.contiguous()
            if p.numel():
                views.append(p.reshape(-1).view(torch.uint8).numpy())  # the tensor's bytes, no copy
                offset += p.numel() * p.element_size()
        header[name] = {"dtype": _ST_DTYPES[parts[0].dtype], "shape": shape, "data_offsets": [start, offset]}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes with spaces
    chunks = [struct.pack("<Q", len(head)), head, *views]
    h = hashlib.sha256()
    with ThreadPoolExecutor(1) as pool:
        hashed = pool.submit(lambda: [h.update(c) for c in chunks])
        for c in chunks:
            f.write(c)
        hashed.result()
    return 8 + len(head) + offset, h.hexdigest()


def check_store_folder(path: str | Path) -> None:
    """Refuse a non-empty ``--out`` that is not a feature store (no ``index.json``): a writer clears ``*.tmp``
    files there and writes its index and shards among the files, so a mistyped ``--out`` (the prepared data,
    a drafter, a home directory) lost the user's ``*.tmp`` files and got a store mixed into it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"--out {path} is a file: give a new or empty folder for the feature store")
    if not path.is_dir() or (path / INDEX).is_file():
        return
    other = sorted(p.name for p in path.iterdir() if p.name not in _BEFORE_INDEX)
    if other:
        shown = ", ".join(other[:3]) + (f" (+{len(other) - 3} more)" if len(other) > 3 else "")
        raise StoreMismatch(f"--out {path} is not empty and is not a feature store (no {INDEX}; it holds {shown}): "
                            "data.extract does not write into it. Choose a new or empty folder for the store")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StoreWriter:
    """Creates or resumes a store; ``write_shard(k, rows)`` is atomic and recorded in the index.

    Several processes may write one store (``python -m data.extract`` under ``accelerate launch`` or
    ``torchrun``): the *main* writer creates or resumes the index (and drops leftovers of killed
    writes) before the others open it with ``main=False``; every writer records each finished shard
    in its own sidecar (``shard-NNNNN.safetensors.json``), and only the main writer writes
    ``index.json``, adopting the sidecars in :meth:`finalise` (and, after a kill, when it reopens the
    store). So no two processes ever write the same file, and the finished store is byte-identical
    whatever the number of processes.
    """

    def __init__(self, path: str | Path, header: dict, plan: list[tuple[int, int]], verify_existing: bool = True,
                 main: bool = True):
        self.path = Path(path)
        self.main = main
        self._lock = threading.Lock()
        if not main:  # the main writer has created or resumed the index already
            self.index = read_index(self.path)
            self._check_same_store(header, plan)
            return
        check_store_folder(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        for tmp in self.path.glob("*.tmp"):  # leftovers of a killed write
            tmp.unlink()
        if (self.path / INDEX).is_file() and not self._holds_nothing():
            self.index = read_index(self.path)
            self._check_same_store(header, plan)
            self._adopt_sidecars()  # shards finished by any process of a run that did not finalise
            for key, info in list(self.index["shards"].items()):  # keep only shards that are intact
                f = self.path / info["file"]
                ok = (f.is_file() and f.stat().st_size == info["bytes"]
                      and (not verify_existing or sha256_file(f) == info["sha256"]))
                if not ok:
                    del self.index["shards"][key]
        else:
            self.index = {"format": FORMAT, "version": VERSION, **header, "plan": [list(p) for p in plan],
                          "shards": {}, "complete": False}
        self.flush_index()

    def _holds_nothing(self) -> bool:
        """An index with no shard recorded and no shard file (finished, or a sidecar of one) beside it: a run that
        failed before its first shard. Its settings are no reason to refuse the corrected rerun (it was refused,
        "already holds a store with topk=-1 ... delete it"), so it is started over."""
        index = read_index(self.path)  # a foreign or damaged index.json is still refused by the reader
        return not index.get("shards") and not any(self.path.glob("shard-*"))

    def _check_same_store(self, header: dict, plan: list[tuple[int, int]]) -> None:
        for key, value in header.items():
            if key == "data" and self._same_data(self.index.get(key), value, header.get("data_fingerprint")):
                continue  # the same rows named another way (relative path, a moved or copied folder)
            if self.index.get(key) != value:
                raise StoreMismatch(f"{self.path} already holds a store with {key}={self.index.get(key)!r}, "
                                    f"this run asks for {value!r}: use another --out, or delete it to start over")
        if [tuple(p) for p in self.index["plan"]] != [tuple(p) for p in plan]:
            raise StoreMismatch(f"{self.path}: shard plan differs from the existing store's (data or shard size "
                                "changed): use another --out, or delete it to start over")

    def _same_data(self, old, new, fingerprint) -> bool:
        if old == new or (fingerprint is not None and self.index.get("data_fingerprint") == fingerprint):
            return True
        try:
            return Path(old).resolve() == Path(new).resolve()
        except (TypeError, OSError):
            return False

    def _adopt_sidecars(self) -> None:
        """Record every finished shard's sidecar in the index (a shard whose size disagrees is dropped)."""
        for side in sorted(self.path.glob("shard-*.safetensors.json")):
            try:
                info = json.loads(side.read_text())
                f = self.path / info["file"]
                ok = f.is_file() and f.stat().st_size == info["bytes"] and side.name == info["file"] + ".json"
            except (ValueError, UnicodeDecodeError, TypeError, KeyError, OSError):  # cut short by a kill or a full disk
                ok = False
            if not ok:  # its shard is not recorded, so it is computed again (and the sidecar rewritten)
                if side.name.removesuffix(".json") in self.index["shards"]:
                    continue  # recorded already (the index was written after it)
                print(f"note: {side}: damaged or does not match its shard: that shard is computed again",
                      file=sys.stderr)
                continue
            self.index["shards"][info["file"]] = info

    def done(self, k: int) -> bool:
        return shard_name(k) in self.index["shards"]

    def finalise(self) -> bool:
        """Main writer, once every process has stopped writing: adopt all sidecars into ``index.json``.

        Returns whether the store is complete. Sidecars of recorded shards are removed, so a finished
        store holds only ``index.json`` and its shards.
        """
        if not self.main:
            raise RuntimeError("only the main writer finalises a store")
        self._adopt_sidecars()
        self.flush_index()
        for name in self.index["shards"]:
            (self.path / (name + ".json")).unlink(missing_ok=True)
        return bool(self.index["complete"])

    def flush_index(self) -> None:
        # Sorted by shard: the index does not depend on which process finished which shard first.
        self.index["shards"] = dict(sorted(self.index["shards"].items()))
        shards = self.index["shards"]
        self.index["rows_done"] = sum(s["rows"] for s in shards.values())
        self.index["tokens_done"] = sum(s["tokens"] for s in shards.values())
        self.index["complete"] = len(shards) == len(self.index["plan"])
        _atomic_write_text(self.path / INDEX, json.dumps(self.index, indent=1))

    def write_shard(self, k: int, rows: list[FeatureRow],
                    quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
        """Write shard ``k`` atomically; safe to call from several threads for different shards.

        ``quantized``: the rows' features already as fp8 ``(values, scales)`` concatenated in row
        order (quantized on the GPU by the extractor); the rows' own ``features`` are then unused.
        The shard is written straight from the rows' memory and hashed on the way: no re-read.
        """
        dtype = self.index["dtype"]
        taps = len(self.index["layer_ids"])
        lengths = [r.input_ids.shape[0] for r in rows]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        cat = lambda name, dt: torch.cat([getattr(r, name) for r in rows]).to(dt).contiguous()
        tensors = {"row_offsets": offsets, "input_ids": cat("input_ids", torch.int32),
                   "loss_mask": cat("loss_mask", torch.int8), "doc_ids": cat("doc_ids", torch.int32),
                   "position_ids": cat("position_ids", torch.int32)}
        if quantized is not None:
            if dtype != "fp8":
                raise ValueError(f"pre-quantized features given to a {dtype} store")
            tensors["features"], tensors["feature_scales"] = (t.contiguous() for t in quantized)
        elif dtype == "bf16":
            # Row by row: the rows are laid end to end in the file without concatenating them first.
            tensors["features"] = [r.features.to(torch.bfloat16).contiguous() for r in rows]
        else:
            tensors["features"], tensors["feature_scales"] = quantize_fp8(torch.cat([r.features for r in rows]), taps)
        if self.index.get("topk"):
            tensors["topk_ids"] = cat("topk_ids", torch.int32)
            tensors["topk_logprobs"] = cat("topk_logprobs", torch.float16)
        name = shard_name(k)
        tmp = self.path / (name + ".tmp")
        with open(tmp, "wb") as f:
            size, digest = write_safetensors(f, tensors)
            f.flush()
            os.fsync(f.fileno())
        parts = lambda t: t if isinstance(t, list) else [t]  # noqa: E731
        info = {"file": name, "rows": len(rows), "row_start": self.index["plan"][k][0], "tokens": int(offsets[-1]),
                "bytes": size, "sha256": digest,
                "feature_bytes": sum(x.numel() * x.element_size() for key, t in tensors.items()
                                     if key in ("features", "feature_scales") for x in parts(t))}
        os.replace(tmp, self.path / name)
        _atomic_write_text(self.path / sidecar_name(k), json.dumps(info, indent=1))
        with self._lock:  # writer threads finish shards in any order; the index is sorted when flushed
            self.index["shards"][name] = info
            if self.main:
                self.flush_index()
        return info
