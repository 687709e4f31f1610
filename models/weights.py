"""Safetensors folders: sharded save with an index, and loading that names what is wrong."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

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
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index when larger than a shard."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for old in list(directory.glob("model*.safetensors")) + list(directory.glob(INDEX)):
        old.unlink()  # a stale shard from an earlier save must not be read back
    written = []
    for filename, names in split.filename_to_tensors.items():
        shard = {n: state[n].contiguous() for n in names}
        tmp = directory / (filename + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        tmp.replace(directory / filename)  # atomic: a crash never leaves a half-written shard
        written.append(directory / filename)
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (directory / INDEX).write_text(json.dumps(index, indent=2))
    return written


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a folder: the index's shards, or every ``*.safetensors``."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
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
