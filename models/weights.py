"""Safetensors folders: sharded save with an index, and loading that names what is wrong."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from models.hub import INDEX, fetch_files, shard_index
from models.support import UserError

STRAY_KEY = re.compile(r"(^|\.)(embed_tokens|lm_head)\.")

log = logging.getLogger(__name__)


def drop_stray_keys(state: dict, directory) -> dict:
    """Drop ``embed_tokens`` / ``lm_head`` tensors (some exports include the target's) with a warning.

    The drafter borrows the target's embedding and LM head, so such keys are never its own.
    """
    stray = sorted(k for k in state if STRAY_KEY.search(k))
    if stray:
        log.warning("dropping %s from %s: the drafter borrows the target's embedding and LM head", stray, directory)
        for k in stray:
            del state[k]
    return state


def save_state_dict(state: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str = "5GB") -> list[Path]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index when larger than a shard.

    ``huggingface_hub.save_torch_state_dict`` splits, writes and indexes exactly as transformers does
    (and removes stale shards of an earlier save first, so none is read back).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict({k: _owning(v) for k, v in state.items()}, directory, max_shard_size=max_shard_size,
                          metadata={"format": "pt"})
    return weight_files(directory)


def _owning(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and alone in its storage: a slice of a larger one (the static loop stacks a drafter's
    q/k/v and gate/up weights into one matrix each, its Linear weights views of it) is copied, which
    safetensors asks for (it refuses to save part of a storage)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a folder: the index's shards, or every ``*.safetensors``."""
    directory = Path(directory)
    index = shard_index(directory)
    if index is not None:
        names = sorted(set(index.values()))
    else:
        names = sorted(p.name for p in directory.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    for name in names:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is listed in {INDEX} but missing: the download or export "
                                    "is incomplete")
    return [directory / n for n in names]


def check_complete(path: Path) -> None:
    """Refuse a safetensors file whose header does not parse or whose size is not the one its header
    describes (a truncated download or copy): reads the header only, so it is cheap for a whole target,
    and the error names the file instead of a loader's traceback."""
    path = Path(path)
    fix = "re-download or re-export it"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                raise ValueError(f"header length {n} in a file of {size} bytes")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"{path} is corrupt or truncated (unreadable safetensors header: {e}); {fix}") from None
    if 8 + n + end != size:
        raise ValueError(f"{path} is corrupt or truncated: {size} bytes, its header describes {8 + n + end}; {fix}")


def check_folder_weights(directory: Path) -> None:
    """:func:`check_complete` on every safetensors file a load of ``directory`` reads (none: nothing to check,
    as for a ``pytorch_model.bin`` checkpoint, which its loader checks)."""
    directory = Path(directory)
    if shard_index(directory) is None and not any(directory.glob("*.safetensors")):
        return
    for path in weight_files(directory):
        check_complete(path)


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is corrupt or truncated ({e}); re-download or re-export it") from None
    return state


def norm_signature(directory: Path, n: int = 8) -> dict[str, list[float]]:
    """The first ``n`` values of every RMSNorm weight of a drafter folder, by name.

    What tells one trained drafter from another across its exports: the fp32 checkpoint, the bf16 HF
    folder and the MLX folders (bf16 or quantized: quantization leaves norms alone) agree to bf16
    precision, while training moves every norm away from its initial ones. ``inference.validate``
    records it and ``export.push`` compares it (:func:`same_signature`), so a report measured with
    another drafter never lands on this one's model card.
    """
    out = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith("norm.weight"):
                    out[key] = [round(float(v), 5) for v in f.get_slice(key)[:n].float()]
    return dict(sorted(out.items()))


def same_signature(a: dict[str, list[float]], b: dict[str, list[float]], tol: float = 1e-2) -> bool:
    """Equal names and values within ``tol`` (bf16 keeps ~3 significant digits: 4e-3 relative)."""
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a[k], b[k])) for k in a)


HASH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HASH_ROWS = 64  # rows of fc hashed: every row moves in training, and the hash stays cheap at any drafter size


def _hashed_tensors(names: Iterable[str]) -> list[str]:
    """The tensors a drafter is identified by: ``fc`` (its quantized parts too) and every RMSNorm weight."""
    return sorted(k for k in names if k in ("fc.weight", "fc.scales", "fc.biases") or k.endswith("norm.weight"))


def _sha(t: torch.Tensor) -> str:
    import hashlib

    raw = t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def weight_hashes(directory: Path) -> dict[str, dict]:
    """Exact content hashes of a few tensors of a drafter folder (``fc``'s first ``HASH_ROWS`` rows and every norm):
    ``{name: {"dtype": stored dtype, "sha256": {dtype: hash of the values cast to it}}}`` (packed integer weights:
    ``{"native": hash}``). ``inference.validate`` records them and ``export.push`` compares them exactly
    (:func:`same_weights`): two checkpoints of one run differ by less than :func:`same_signature`'s tolerance, and
    a report of one went on the card of another."""
    out: dict[str, dict] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for key in _hashed_tensors(f.keys()):
                t = f.get_slice(key)[:HASH_ROWS] if key.startswith("fc.") else f.get_tensor(key)
                stored = str(t.dtype).removeprefix("torch.")
                hashes = ({name: _sha(t.to(dtype)) for name, dtype in HASH_DTYPES.items()} if t.is_floating_point()
                          else {"native": _sha(t)})
                out[key] = {"dtype": stored, "sha256": hashes}
    return dict(sorted(out.items()))


def _common_dtype(a: str, b: str) -> str:
    """The dtype two stored copies of one drafter are compared in: the narrower (an fp32 checkpoint and its bf16
    export agree in bf16, exactly, since the export rounds the same way); bf16 against fp16: bf16."""
    if a == b:
        return a
    if "float32" in (a, b):
        return b if a == "float32" else a
    return "bfloat16"


def weight_hash_differences(a: dict[str, dict], b: dict[str, dict]) -> list[str] | None:
    """Tensors whose exact hashes differ between two :func:`weight_hashes` (compared in their common dtype); None
    when they share no tensor (nothing to compare)."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    differ = []
    for name in common:
        x, y = a[name], b[name]
        if "native" in x["sha256"] or "native" in y["sha256"]:
            same = x["dtype"] == y["dtype"] and x["sha256"].get("native") == y["sha256"].get("native")
        else:
            dtype = _common_dtype(x["dtype"], y["dtype"])
            same = x["sha256"].get(dtype) is not None and x["sha256"].get(dtype) == y["sha256"].get(dtype)
        if not same:
            differ.append(name)
    return differ


def read_safetensors_tensors(directory: Path, keys: list[str], device: str | torch.device = "cpu",
                             optional: list[str] = (), repo_id: str | None = None) -> dict:
    """Named tensors from a model folder's safetensors shards, reading only those (``optional`` ones may
    be absent). A sharded checkpoint's index names the shard of each; ``repo_id`` (a Hub snapshot)
    downloads just those shards.

    A multimodal checkpoint stores the text tower under ``model.language_model.`` (Qwen3.5) or
    ``language_model.`` (Kimi K2.5: ``language_model.model.X``, ``language_model.lm_head``): a key the text
    model calls ``model.X`` or ``lm_head.X`` is looked up there too.
    """
    def aliases(key: str) -> list[str]:
        out = [key] + ([key.replace("model.", "model.language_model.", 1)] if key.startswith("model.") else [])
        return out + (["language_model." + key] if key.startswith(("model.", "lm_head.")) else [])

    def absent(key: str) -> ValueError:
        return ValueError(f"{directory}: no tensor named {' or '.join(aliases(key))} in its safetensors shards "
                          "(an incomplete download, or not this architecture's checkpoint)")

    index = shard_index(directory)
    if index is not None:  # name -> shard: open only the shards that hold the keys
        where = {}
        for key in keys:
            hit = next((a for a in aliases(key) if a in index), None)
            if hit is not None:
                where[key] = (hit, directory / index[hit])
            elif key not in optional:
                raise absent(key)
        if repo_id is not None:
            fetch_files(repo_id, directory, sorted({shard.name for _, shard in where.values()}), what="target")
        out = {}
        for key, (hit, shard) in where.items():
            if not shard.is_file():
                raise FileNotFoundError(f"{shard} (named in {directory / INDEX} for {hit}) "
                                        "is missing: an incomplete download; fetch the model again")
            check_complete(shard)
            with safe_open(str(shard), framework="pt", device="cpu") as f:  # safetensors refuses "cpu:0"
                out[key] = f.get_tensor(hit).to(device)
        return out
    if repo_id is not None:  # one unindexed file holds everything: fetch it
        fetch_files(repo_id, directory, ["model.safetensors"], what="target")
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights: loading only the embedding and LM head "
                                "needs safetensors shards (load the whole target instead)")
    for shard in shards:
        check_complete(shard)
    out = {}
    for key in keys:
        for shard in shards:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                hit = next((a for a in aliases(key) if a in f.keys()), None)
                if hit is not None:
                    out[key] = f.get_tensor(hit).to(device)
                    break
        else:
            if key in optional:
                continue
            raise absent(key)
    return out


class NonFiniteWeights(UserError, ValueError):
    """A drafter whose weights hold NaN or Inf: it drafts nothing useful, and no engine says why."""


def folder_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every drafter tensor in a folder's safetensors files, one at a time (a stray copy of the
    target's embedding or LM head, which loaders drop, is not read)."""
    for path in weight_files(directory):
        check_complete(path)  # a truncated file is named, not a reader's error
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if not STRAY_KEY.search(key):
                    yield key, f.get_tensor(key)


def nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """``"fc.weight (3 NaN, 1 Inf of 3072 values)"`` for each floating tensor holding a value that is not finite
    (packed integer weights of a quantized folder hold none)."""
    found = []
    for name, t in named:
        if not t.is_floating_point():
            continue
        finite = torch.isfinite(t)
        if bool(finite.all()):
            continue
        nan = int(torch.isnan(t).sum())
        found.append(f"{name} ({nan} NaN, {t.numel() - int(finite.sum()) - nan} Inf of {t.numel()} values)")
    return found


def check_finite(named: Iterable[tuple[str, torch.Tensor]], what: str, fix: str) -> None:
    """Refuse weights holding NaN / Inf, naming the tensor: a NaN drafter ran at tau 1.00 without a word, and an
    export blamed the disk for it ("fc.weight changed on the way to disk": NaN is not equal to itself)."""
    bad = nonfinite(named)
    if bad:
        more = f" (and {len(bad) - 1} more: {', '.join(b.split(' (')[0] for b in bad[1:4])}" + \
            (", ..." if len(bad) > 4 else "") + ")" if len(bad) > 1 else ""
        raise NonFiniteWeights(f"{what}: weight {bad[0]} is not finite{more}: the drafter diverged in training or "
                               f"its file is damaged. {fix}")
