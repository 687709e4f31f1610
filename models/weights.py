"""Safetensors folders: sharded save with an index, and loading that names what is wrong."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from models.hub import INDEX, fetch_files, shard_index

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
