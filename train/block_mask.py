"""The training ``BlockMask`` built straight from the block tensors (no dense mask evaluation).

``create_block_mask`` evaluates the mask rule at every (query, key) pair (``n*B x (s + n*B)``, about
92M for 512 blocks of 16 over 3072 tokens) only to learn which 128 x 128 tiles are empty, partial or
full: ~12 ms per batch on an H100, on the critical path of every step. Under the training rule
(``train.blocks``) each query sees two key intervals: the context ``[start of its document,
anchor)`` and its own block ``[s + n*B, s + (n+1)*B)``. With interval ends per query, a tile's
state is two overlaps per (query, key tile), reduced over the tile's queries: ``n*B x tiles``
work instead of ``n*B x keys``. The same ``mask_mod`` still applies inside partial tiles, so the
attention is unchanged; tests compare the dense masks of both builders.

The context interval needs each document to be one contiguous run of its row (true of packed
rows); for other document layouts, sliding windows or causal blocks, the caller falls back to
``create_block_mask``.
"""

from __future__ import annotations

import torch

TILE = 128  # flex attention's default sparse block size, for queries and keys


def documents_contiguous(doc_ids: torch.Tensor) -> bool:
    """Every document id of each row forms one run (number of runs == number of distinct ids)."""
    runs = 1 + (doc_ids[:, 1:] != doc_ids[:, :-1]).sum(1)
    srt = doc_ids.sort(1).values
    distinct = 1 + (srt[:, 1:] != srt[:, :-1]).sum(1)
    return bool((runs == distinct).all())


def run_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]``: the first position of the run of equal document ids that holds each position."""
    b, s = doc_ids.shape
    t = torch.arange(s, device=doc_ids.device).expand(b, s)
    change = torch.ones_like(doc_ids, dtype=torch.bool)
    change[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(change, t, torch.zeros_like(t)).cummax(1).values


def tile_states(anchors: torch.Tensor, valid: torch.Tensor, doc_ids: torch.Tensor, block_size: int,
                tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` ``[b, 1, q_tiles, kv_tiles]`` bool, as ``create_block_mask`` would find them.

    ``partial``: some but not all of the tile's (query, key) pairs are visible; ``full``: all are.
    Requires contiguous documents (see :func:`documents_contiguous`).
    """
    b, n = anchors.shape
    s = doc_ids.shape[1]
    B = block_size
    q_len, kv_len = n * B, s + n * B
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    dev = anchors.device
    # Per block: context interval [lo, hi) (empty for padding blocks) and its own block's keys.
    lo = torch.where(valid, run_starts(doc_ids).gather(1, anchors), torch.zeros_like(anchors))
    hi = torch.where(valid, anchors, torch.zeros_like(anchors))
    blk_lo = s + torch.arange(n, device=dev) * B
    # Per query (pad the last query tile with queries that see nothing).
    pad = q_tiles * tile - q_len
    per_q = lambda x: torch.nn.functional.pad(x.repeat_interleave(B, dim=-1), (0, pad))  # noqa: E731
    lo_q, hi_q = per_q(lo), per_q(hi)
    blo_q, bhi_q = per_q(blk_lo.expand(b, n)), per_q((blk_lo + B).expand(b, n))
    real = torch.arange(q_tiles * tile, device=dev) < q_len  # [Q]
    ts = torch.arange(kv_tiles, device=dev) * tile
    te = (ts + tile).clamp(max=kv_len)

    def overlap(a, z):  # [b, Q] interval vs every key tile -> [b, Q, kv_tiles]
        return (torch.minimum(z[..., None], te) - torch.maximum(a[..., None], ts)).clamp(min=0)

    seen = overlap(lo_q, hi_q) + overlap(blo_q, bhi_q)  # the two intervals are disjoint (< s and >= s)
    some = (seen > 0) & real[None, :, None]
    # create_block_mask pads the mask with False past the last query and key, so a ragged tile is
    # never full, even when all its real pairs are visible.
    every = (seen == tile) & real[None, :, None]
    some = some.view(b, q_tiles, tile, kv_tiles).any(2)
    every = every.view(b, q_tiles, tile, kv_tiles).all(2)
    return (some & ~every)[:, None], every[:, None]


def direct_block_mask(anchors: torch.Tensor, valid: torch.Tensor, doc_ids: torch.Tensor, block_size: int, mask_mod,
                      contiguous: bool | None = None):
    """A ``BlockMask`` equal to ``create_block_mask(mask_mod, ...)`` for the training rule, or None.

    None when documents are not contiguous runs (the interval form would miss keys): the caller
    then builds the mask the generic way. ``contiguous``: that check already made on the host copy
    of ``doc_ids`` (the trainer's token batch). Made here on a GPU tensor, it reads the answer back,
    which waits for every kernel queued before it (the online target's whole forward).
    """
    try:  # private helper of create_block_mask (torch >= 2.5); without it, the generic builder
        from torch.nn.attention.flex_attention import _create_sparse_block_from_block_mask
    except ImportError:
        return None
    if not (documents_contiguous(doc_ids) if contiguous is None else contiguous):
        return None
    n, s = anchors.shape[1], doc_ids.shape[1]
    partial, full = tile_states(anchors, valid, doc_ids, block_size)
    return _create_sparse_block_from_block_mask((partial.to(torch.int8), full.to(torch.int8)), mask_mod,
                                                (n * block_size, s + n * block_size), TILE, TILE)
