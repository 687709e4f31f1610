"""Triton tiles for the backward of the drafter's flex attention (CUDA training).

``train.flex_backward`` (and ``train.bench --flex-backward``) takes one of:

- ``auto``: the tiles measured best for this GPU and head dim (``TUNED`` below), else torch's choice;
- ``torch``: torch's own choice (its per-architecture default);
- ``M1,N1,M2,N2,STAGES,WARPS``: explicit tiles, as the lab's sweep (``python -m lab.flex_sweep``) prints them.

Why tiles of our own: the training mask is block-sparse in a pattern torch's defaults were not tuned
for, and at head_dim 256 (Qwen3.5 targets) torch's Hopper default left the backward at several
times the forward's time against a ~2.5x FLOP ratio. Only the backward is tuned; the forward keeps
torch's choice. The settings change speed only: every tile computes the same attention (the sweep
checks the gradients against torch's tiles).
"""

from __future__ import annotations

import functools

import torch

FORMAT = "M1,N1,M2,N2,STAGES,WARPS"
NAMES = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps")

# (compute capability, head_dim) -> backward tiles, from `python -m lab.flex_sweep` on that
# GPU at the recipe's shape. Filled only from measurements; anything else keeps torch's choice.
TUNED: dict[tuple[tuple[int, int], int], tuple[int, ...]] = {
    # H200 (sm 9.0), qwen35-9b's drafter (16 heads, 4 KV heads, 3072 + 512 x 16 keys): torch's tiles
    # (64,64,64,64,2,4) 7.47 ms backward per layer, these 5.33 (fwd + bwd 1.34x faster), same gradients.
    # 4 warps cannot hold two 64 x 256 fp32 accumulators without spilling; 8 can. The H100 is sm 9.0 too.
    ((9, 0), 256): (64, 64, 64, 64, 2, 8),
}


def parse_flex_backward(setting: str) -> str | tuple[int, ...]:
    """``"auto"``, ``"torch"`` or six tile numbers; anything else raises with the accepted forms."""
    text = str(setting).strip()
    if text in ("auto", "torch"):
        return text
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != len(NAMES) or not all(p.isdigit() for p in parts):
        raise ValueError(f"flex backward setting {setting!r}: use auto, torch, or six whole numbers {FORMAT} "
                         "(e.g. 64,64,64,64,2,4), as python -m lab.flex_sweep prints them")
    m1, n1, m2, n2, stages, warps = tiles = tuple(int(p) for p in parts)
    # The sparse mask is built from 128 x 128 tiles: each kernel tile must divide it; the kernel also
    # asserts that its inner loop steps divide the outer ones (N1 by M1, M2 by N2).
    if any(b not in (16, 32, 64, 128) for b in (m1, n1, m2, n2)):
        raise ValueError(f"flex backward {setting!r}: the block sizes M1,N1,M2,N2 must each be 16, 32, 64 or 128")
    if n1 % m1 or m2 % n2:
        raise ValueError(f"flex backward {setting!r}: N1 must be a multiple of M1 and M2 a multiple of N2 "
                         "(the kernel's inner loops step by M1 and N2)")
    if not 1 <= stages <= 6 or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"flex backward {setting!r}: STAGES must be 1..6 and WARPS one of 1, 2, 4, 8, 16")
    return tiles


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def resolve_tiles(setting: str | tuple[int, ...], device: torch.device, head_dim: int) -> tuple[int, ...] | None:
    """The tiles a setting means on this device (None: torch's choice)."""
    if setting == "torch" or device.type != "cuda":
        return None
    if setting == "auto":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return TUNED.get((_capability(index), head_dim))
    return tuple(setting)


def kernel_options(tiles: tuple[int, ...] | None) -> dict | None:
    """flex_attention's ``kernel_options`` for backward tiles: ``bwd_`` keys, so the forward keeps its own."""
    if tiles is None:
        return None
    return {f"bwd_{name}": value for name, value in zip(NAMES, tiles)}


def format_tiles(tiles: tuple[int, ...] | None) -> str:
    return "torch" if tiles is None else ",".join(str(t) for t in tiles)
