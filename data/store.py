"""The offline feature store: sharded safetensors + ``index.json``, checked on every read.

Layout of a store folder::

    index.json                  what the store is (see below) and the shards written so far
    shard-00000.safetensors     rows [plan[0][0], plan[0][1]) of the prepared data, concatenated
    shard-00001.safetensors     ...

Each shard holds, for its rows laid end to end (``T`` tokens, ``R`` rows):

- ``row_offsets`` int64 ``[R + 1]``; ``input_ids`` int32, ``loss_mask`` int8, ``doc_ids`` int32,
  ``position_ids`` int32, all ``[T]``: the store is self-sufficient for training
- ``features``: ``[T, taps * hidden]`` bf16, or float8 e4m3 with ``feature_scales`` bf16
  ``[T, taps]`` (one scale per token per tapped layer: ``x ~= q * scale``, ``scale = amax / 448``)
- optional ``topk_ids`` int32 / ``topk_logprobs`` float16 ``[T, k]``: the target's top-k
  next-token log-probs for KL distillation (k = 32: 192 bytes per token)

``index.json`` records the format version, target name, revision and fingerprint, layer ids,
hidden size, dtype, top-k, tokenizer fingerprint, the prepared data it came from, row and token
counts, the shard plan (row ranges, fixed when the store is created, so resume is exact) and per
shard its rows, tokens, bytes and sha256. Shards are written to a temp file, hashed, then renamed;
the index is rewritten (temp + rename) after each shard. On read, a shard's size and sha256 are
checked the first time it is opened: a truncated or tampered shard is an error naming the file.

fp8 halves the bytes of bf16 (``(H + 2) / 2H`` of them: 0.5002x at H = 4096); the e4m3 rounding
error is at most 2^-4 of a value (3 mantissa bits), or 2^-10 of the scale for the smallest values.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from data.chat import tokenizer_fingerprint
from data.features import FeatureBatch, FeatureRow, collate
from models.hub import SMALL_FILES, is_hub_id, resolve_model_dir, snapshot_commit, weight_file_spans
from models.support import to_device

FORMAT = "draftsmith-features"
VERSION = 1
INDEX = "index.json"
DTYPES = ("bf16", "fp8")
E4M3_MAX = 448.0


class StoreError(ValueError):
    pass


class StoreCorrupt(StoreError):
    """A shard is missing, truncated or its checksum does not match the index."""


class StoreMismatch(StoreError):
    """The store was extracted for another target, other layers or another tokenizer."""


# ----------------------------------------------------------------------------- fp8 codec
def quantize_fp8(x: torch.Tensor, taps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, taps * H]`` -> (e4m3 values ``[T, taps * H]``, bf16 scales ``[T, taps]``)."""
    T = x.shape[0]
    v = x.reshape(T, taps, -1).float()
    amax = v.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(torch.bfloat16)
    # divide by the *stored* (rounded) scale; bf16 rounding can push |v/scale| a hair over 448
    q = (v / scale.float().unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(T, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    T, taps = scale.shape
    return (q.reshape(T, taps, -1).float() * scale.float().unsqueeze(-1)).reshape(T, -1).to(dtype)


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on ``|x - dequantize(quantize(x))|`` in float32 (half an e4m3 ulp)."""
    T, taps = scale.shape
    s = scale.float().unsqueeze(-1).expand(T, taps, x.shape[-1] // taps).reshape(T, -1)
    return torch.maximum(x.float().abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 2.0 ** -7)


# ----------------------------------------------------------------------------- identity
def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def target_identity(target) -> dict:
    """Name, revision (Hub commit if known) and fingerprint of a target (a folder, a Hub id, or a loaded
    ``TargetModel``, by its name).

    The fingerprint hashes config.json, the weight files' names and sizes, and the first and last
    MiB of each weight file: cheap (a few MiB read), equal for a Hub snapshot and a local copy of
    it, different for another model, a fine-tune with the same shapes, or another quantization.
    A Hub id needs neither its weights downloaded nor loaded: the spans of absent shards are read
    from the Hub (``models.hub.weight_file_spans``). A target that is neither a folder nor a Hub id
    (built in memory) is fingerprinted by its config alone.
    """
    if getattr(target, "identity", None):  # a loaded target is fingerprinted once (Hub ranged reads included)
        return dict(target.identity)
    name = target if isinstance(target, (str, Path)) else getattr(target, "name", "")
    config = getattr(getattr(target, "model", None), "config", None)
    # a config read from a folder carries no ``_commit_hash`` (transformers 5): the loaders keep the commit
    revision = getattr(target, "revision", None) or getattr(config, "_commit_hash", None)
    h = hashlib.sha256()
    folder, repo_id = Path(str(name)).expanduser(), None
    if not str(name) and not isinstance(target, (str, Path)):
        folder = None  # built in memory, unnamed: Path("") is the working directory, and a model there is another
    elif not folder.is_dir() and (isinstance(target, (str, Path)) or is_hub_id(name)):
        repo_id = str(name) if is_hub_id(name) else None  # a path that is neither is refused here, by name
        folder = resolve_model_dir(name, revision=revision, what="target", allow_patterns=SMALL_FILES)
    if folder is not None and folder.is_dir() and (folder / "config.json").is_file():
        h.update((folder / "config.json").read_bytes())
        for file_name, size, head, tail in weight_file_spans(folder, repo_id):
            h.update(f"{file_name}:{size}".encode())
            h.update(head)  # head and tail bytes: a fine-tune with the same shapes differs here
            h.update(tail)
        revision = revision or snapshot_commit(folder)
    elif config is not None:
        h.update(config.to_json_string(use_diff=False).encode())
    else:  # a folder that holds no model: never the fingerprint of nothing
        raise FileNotFoundError(f"target {str(name)!r}: {folder} has no config.json, so it is not a model folder: "
                                "give the target model's folder or its Hub id")
    ident = {"target": str(name), "target_revision": revision, "target_fingerprint": h.hexdigest()[:16]}
    if not isinstance(target, (str, Path)):
        target.identity = dict(ident)
    return ident


def is_same_target(recorded: str, target, fingerprint: str) -> bool:
    """Whether a fingerprint recorded by a store or prepared data is this target's (``fingerprint``, from
    ``target_identity``), earlier versions' config-only fingerprint of a Hub-named target included."""
    # Not ``recorded in (fingerprint, legacy)``: the legacy one is None for every other target, so a store
    # recording no fingerprint (null) would pass for any of them.
    legacy = legacy_hub_fingerprint(target)
    return recorded == fingerprint or (legacy is not None and recorded == legacy)


def legacy_hub_fingerprint(target) -> str | None:
    """The fingerprint versions before file-based Hub fingerprints recorded for a loaded target named by a
    Hub id (its config alone), so stores and prepared data made then stay usable; None otherwise."""
    config = getattr(getattr(target, "model", None), "config", None)
    if config is None or not is_hub_id(getattr(target, "name", "")):
        return None
    return hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


def read_index(path: str | Path) -> dict:
    path = Path(path)
    if not (path / INDEX).is_file():
        raise FileNotFoundError(f"{path} is not a feature store (no {INDEX}); create one with python -m data.extract")
    try:
        index = json.loads((path / INDEX).read_text())
    except (ValueError, UnicodeDecodeError) as e:  # cut short (a full disk, a copy stopped) or overwritten
        raise StoreCorrupt(f"{path / INDEX}: damaged, not readable as JSON ({e}): it records the store's settings, "
                           "shard plan and checksums, without which no shard can be trusted or resumed: delete the "
                           f"folder {path} and re-run the same data.extract command (extraction starts over)") from None
    if not isinstance(index, dict):
        raise StoreCorrupt(f"{path / INDEX}: not a feature store index (a JSON {type(index).__name__}): delete the "
                           f"folder {path} and re-run the same data.extract command (extraction starts over)")
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise StoreError(f"{path}/{INDEX}: format {index.get('format')} v{index.get('version')}, "
                         f"this reader reads {FORMAT} v{VERSION}")
    return index


def prepared_fingerprint(ds) -> str | None:
    """The fingerprint ``data.extract`` records (``data_fingerprint``) of the prepared folder that ``ds`` (the
    loaded folder, or a ``select`` of it such as the training split) was read from; None when not from a folder.

    ``datasets`` gives a selection a fingerprint of its own, so the folder is loaded again (memory-mapped:
    no rows are read) for the fingerprint of the whole, which does not depend on where the folder lies."""
    files = getattr(ds, "cache_files", None) or []
    if not files:
        return None
    folder = Path(files[0]["filename"]).parent
    if not (folder / "state.json").is_file():
        return None
    from datasets import load_from_disk  # start-up time (data.extract --help)

    try:
        return load_from_disk(str(folder))._fingerprint
    except Exception:  # noqa: BLE001  (not a whole saved data set: no fingerprint to compare)
        return None


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def sidecar_name(k: int) -> str:
    """A finished shard's index entry, written next to it by whichever process computed it."""
    return shard_name(k) + ".json"


# ----------------------------------------------------------------------------- reader
class FeatureStore:
    """Reads an offline store; the trainer's offline feature provider.

    ``row(i)`` / ``get_batch(indices)`` give the same :class:`~data.features.FeatureRow` /
    :class:`~data.features.FeatureBatch` as :class:`~data.features.OnlineFeatures`, with features
    in ``dtype`` (fp8 dequantized). Call :meth:`check_compatible` with what the training run uses
    before training.
    """

    def __init__(self, path: str | Path, *, dtype: torch.dtype = torch.bfloat16, verify: bool = True,
                 pad_id: int | None = None, max_open: int = 4, device: str | torch.device = "cpu"):
        self.path = Path(path)
        self.index = read_index(self.path)
        if not self.index.get("complete"):
            raise StoreError(f"{self.path}: extraction not finished ({len(self.index['shards'])}/"
                             f"{len(self.index['plan'])} shards); re-run the same data.extract command to resume")
        self.dtype, self.verify, self.max_open = dtype, verify, max_open
        self.pad_id = pad_id if pad_id is not None else self.index.get("pad_id", 0)
        self.device = torch.device(device)  # features are moved (fp8: before dequantizing) to this device
        self.starts = [p[0] for p in self.index["plan"]]
        self._open: OrderedDict[int, tuple] = OrderedDict()
        self._checked: set[int] = set()
        self._hashes: dict[int, Future] = {}
        if verify:
            self._start_verification()

    def _start_verification(self, threads: int = 4) -> None:
        """Hash every shard in background threads (in plan order; hashlib releases the GIL), once.

        ``_shard(k)`` waits only for shard ``k``'s own hash, so reading starts as soon as the first
        shard is checked and the rest are verified while training consumes it.
        """
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="store-verify")
        for k in range(len(self.index["plan"])):
            f = self.path / shard_name(k)
            self._hashes[k] = pool.submit(lambda f=f: sha256_file(f) if f.is_file() else None)
        pool.shutdown(wait=False)  # threads exit once the queued hashes are done

    @property
    def layer_ids(self) -> list[int]:
        return list(self.index["layer_ids"])

    def __len__(self) -> int:
        return int(self.index["rows"])

    def check_compatible(self, *, target=None, layer_ids: Sequence[int] | None = None, tokenizer=None) -> None:
        """Raise :class:`StoreMismatch` unless the store matches this target, these layers and tokenizer."""
        problems = []
        if layer_ids is not None and list(layer_ids) != self.layer_ids:
            problems.append(f"layer ids: store {self.layer_ids}, training asks {list(layer_ids)}")
        if target is not None:
            ident = target_identity(target)
            if not is_same_target(self.index["target_fingerprint"], target, ident["target_fingerprint"]):
                problems.append(f"target: store was extracted from {self.index['target']!r} "
                                f"(fingerprint {self.index['target_fingerprint']}), training uses {ident['target']!r} "
                                f"(fingerprint {ident['target_fingerprint']})")
        if tokenizer is not None:
            h = tokenizer if isinstance(tokenizer, str) else tokenizer_fingerprint(tokenizer)
            if h != self.index["tokenizer_hash"]:
                problems.append(f"tokenizer: store {self.index['tokenizer_hash']}, training {h}")
        if problems:
            raise StoreMismatch(f"feature store {self.path} does not match this training run: " + "; ".join(problems)
                                + ". Re-extract with python -m data.extract, or fix the recipe")

    def _shard(self, k: int):
        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]

        name = shard_name(k)
        info = self.index["shards"].get(name)
        f = self.path / name
        if info is None or not f.is_file():
            raise StoreCorrupt(f"{f}: shard missing; re-run data.extract on this store to rebuild it")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise StoreCorrupt(f"{f}: {size} bytes, index says {info['bytes']}: the shard is truncated or "
                               "was replaced; re-run data.extract on this store to rebuild it")
        if self.verify and k not in self._checked:
            digest = self._hashes[k].result() if k in self._hashes else sha256_file(f)
            if digest != info["sha256"]:
                raise StoreCorrupt(f"{f}: sha256 {digest[:16]}... does not match the index "
                                   f"({info['sha256'][:16]}...): the shard was modified or corrupted; "
                                   "delete it and re-run data.extract to rebuild it")
            self._checked.add(k)
        handle = safe_open(str(f), framework="pt")
        offsets = handle.get_tensor("row_offsets")
        self._open[k] = (handle, offsets)
        if len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return self._open[k]

    def row(self, i: int) -> FeatureRow:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} outside the store's {len(self)} rows")
        k = bisect.bisect_right(self.starts, i) - 1
        handle, offsets = self._shard(k)
        j = i - self.starts[k]
        a, b = int(offsets[j]), int(offsets[j + 1])
        get = lambda name: handle.get_slice(name)[a:b]
        feats = to_device(get("features"), self.device)
        if self.index["dtype"] == "fp8":
            feats = dequantize_fp8(feats, to_device(get("feature_scales"), self.device), self.dtype)
        else:
            feats = feats.to(self.dtype)
        row = FeatureRow(get("input_ids").long(), get("loss_mask"), get("doc_ids"), get("position_ids"), feats)
        if self.index.get("topk"):
            row.topk_ids, row.topk_logprobs = get("topk_ids"), get("topk_logprobs").float()
        return row

    def get_batch(self, indices: Sequence[int]) -> FeatureBatch:
        return collate([self.row(int(i)) for i in indices], self.pad_id)

    def verify_all(self) -> None:
        """Check every shard's size and checksum now (the reader otherwise checks lazily)."""
        for k in range(len(self.index["plan"])):
            self._shard(k)
