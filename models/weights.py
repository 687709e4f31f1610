"""Safetensors folders: sharded save with an index, and loading that names what is wrong."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

INDEX = "model.safetensors.index.json"
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
    from huggingface_hub import save_torch_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict({k: v.contiguous() for k, v in state.items()}, directory, max_shard_size=max_shard_size,
                          metadata={"format": "pt"})
    return weight_files(directory)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a folder: the index's shards, or every ``*.safetensors``."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e}); re-download or "
                             "re-export the folder") from None
    else:
        names = sorted(p.name for p in directory.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    for name in names:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} is listed in {INDEX} but missing: the download or export "
                                    "is incomplete")
    return [directory / n for n in names]


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is corrupt or truncated ({e}); re-download or re-export it") from None
    return state
