"""The blocks of a training batch and the attention rule over them (docs/design.md, "Training objective"), as
tensor ops only.

One training row is a clean prompt+response of length ``s`` with the target's features at every
position. From it we draw up to ``N`` anchors (default 512, re-drawn every epoch) among the
positions where the token *and the next one* are inside the loss mask and in the same document
(packed rows carry per-token document ids). Each anchor ``a`` gives one block
``[token[a], MASK x (B-1)]`` at positions ``a .. a+B-1``; all ``N`` blocks of a row go through the
drafter in *one* forward as ``N*B`` query tokens, with the row's ``s`` context features as the
injected keys/values. The attention rule, per query of block ``n`` (anchor ``a_n``, document ``d_n``):

* context key ``t`` is visible iff ``t < a_n`` and ``doc[t] == d_n`` (strictly before the anchor:
  at inference the bonus token at ``a_n`` has no feature yet);
* block key ``(m, i)`` is visible iff ``m == n`` (own block, bidirectional; never other blocks).

Slot ``k`` (1..B-1) predicts the token at ``a_n + k``, scored only while the labels ``a_n+1 .. a_n+k`` stay
inside the loss mask and the document (``Blocks.label_mask``); the loss over the scored slots is
``train/objective.py``'s.

Two mask builders give the same mask: ``dense_mask`` (boolean ``[b, 1, N*B, s+N*B]``, used with
SDPA on CPU, where flex attention has no backward) and ``flex_block_mask`` (a flex-attention
``BlockMask`` from the same rule, used on CUDA). Sliding-window drafter layers get their own
mask (window on context keys, ``sliding_block_attention`` inside the block), passed per layer type.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Sequence

import torch
from torch.nn.attention.flex_attention import create_block_mask

from models.support import to_device
from train import block_mask  # direct_block_mask looked up at each call (train.bench swaps it to time the other)


# ----------------------------------------------------------------------------- anchors and blocks
@dataclass
class Blocks:
    """The blocks of a batch: ``b`` rows x ``n`` blocks x ``B`` slots."""

    anchors: torch.Tensor  # [b, n] position of slot 0 (0 for padding blocks)
    valid: torch.Tensor  # [b, n] bool: a real anchor (rows with fewer candidates get padding blocks)
    doc: torch.Tensor  # [b, n] document id of the anchor (-2 for padding blocks: matches no key)
    block_ids: torch.Tensor  # [b, n, B] [anchor token, MASK, ...]
    positions: torch.Tensor  # [b, n, B] position ids of the block slots
    labels: torch.Tensor  # [b, n, B-1] token at anchor + k
    label_mask: torch.Tensor  # [b, n, B-1] bool: slot k is scored
    # [M] int64: the scored slots as indices into ``label_mask.flatten()``. Found where the blocks are
    # drawn (the host, in training), so the loss gathers them without reading a mask back from the GPU:
    # a boolean selection there waits for every queued kernel, and the host then idles the GPU while it
    # queues the next ones.
    scored_index: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    def to(self, device) -> "Blocks":
        """The same blocks on ``device`` (drawn on the host, they go to the GPU without waiting for its queue)."""
        return Blocks(*(to_device(getattr(self, f.name), device) for f in fields(self)))

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[2]


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: token and next token in the loss mask and in the same document."""
    lm = loss_mask.bool()
    cand = torch.zeros_like(lm)
    cand[:, :-1] = lm[:, :-1] & lm[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return cand


def sample_anchors(candidates: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` distinct candidates per row, uniformly at random, sorted by position.

    Returns ``(anchors [b, n], valid [b, n])`` with ``n = min(num_anchors, most candidates in a row)``;
    rows with fewer candidates are padded with invalid anchors at position 0. Random keys come from
    ``generator`` (CPU), so the draw depends only on its seed, not on the device. A list of
    generators, one per row, draws each row's keys from its own stream over the row's own candidate
    span: a row's anchors then do not depend on the other rows of its batch or on the padding
    width, so batch_size x grad_accum can be traded without changing the blocks (the trainer seeds
    one stream per (seed, epoch, data row)).
    """
    b, s = candidates.shape
    n = int(min(num_anchors, max(int(candidates.sum(1).max()), 1)))
    if isinstance(generator, torch.Generator):
        keys = torch.rand(b, s, generator=generator).to(candidates.device)
    else:
        if len(generator) != b:
            raise ValueError(f"{len(generator)} generators for {b} rows: pass one per row, "
                             "or a single torch.Generator for the whole batch")
        keys = torch.zeros(b, s)
        for r, (row, g) in enumerate(zip(candidates.cpu(), generator)):
            span = int(row.nonzero().max()) + 1 if bool(row.any()) else 0  # up to the row's last candidate
            keys[r, :span] = torch.rand(span, generator=g)
        keys = keys.to(candidates.device)
    keys = keys.masked_fill(~candidates, -1.0)
    top, idx = keys.topk(n, dim=1)
    valid = top >= 0
    # Sort chosen anchors by position (invalid ones last) for readable, cache-friendly blocks.
    order_key = torch.where(valid, idx, s + idx)
    order = order_key.argsort(dim=1)
    idx, valid = idx.gather(1, order), valid.gather(1, order)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor, position_ids: torch.Tensor,
                 anchors: torch.Tensor, valid: torch.Tensor, block_size: int, mask_token_id: int) -> Blocks:
    """Blocks, labels and label masks for given anchors (all gathers, no loops)."""
    b, s = input_ids.shape
    B = block_size
    lm = loss_mask.bool()
    doc_a = torch.where(valid, doc_ids.gather(1, anchors), torch.full_like(anchors, -2))
    block_ids = torch.full((b, anchors.shape[1], B), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    offsets = torch.arange(B, device=input_ids.device)
    positions = position_ids.gather(1, anchors)[:, :, None] + offsets
    lab_pos = anchors[:, :, None] + offsets[1:]  # [b, n, B-1]
    in_bounds = lab_pos < s
    flat = lab_pos.clamp(max=s - 1).flatten(1)
    labels = input_ids.gather(1, flat).view_as(lab_pos)
    same_doc = doc_ids.gather(1, flat).view_as(lab_pos) == doc_a[:, :, None]
    ok = in_bounds & lm.gather(1, flat).view_as(lab_pos) & same_doc
    label_mask = ok.long().cumprod(-1).bool() & valid[:, :, None]
    return Blocks(anchors=anchors, valid=valid, doc=doc_a, block_ids=block_ids, positions=positions,
                  labels=labels, label_mask=label_mask, scored_index=label_mask.flatten().nonzero().squeeze(1))


def draw_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor | None,
                position_ids: torch.Tensor | None, num_anchors: int, block_size: int, mask_token_id: int,
                generator: torch.Generator | Sequence[torch.Generator]) -> Blocks:
    """Sample anchors and build blocks. ``doc_ids`` None = one document per row (padding: loss_mask 0).

    ``generator``: one for the batch, or one per row (see :func:`sample_anchors`).
    """
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    anchors, valid = sample_anchors(anchor_candidates(loss_mask, doc_ids), num_anchors, generator)
    return build_blocks(input_ids, loss_mask, doc_ids, position_ids, anchors, valid, block_size, mask_token_id)


# ----------------------------------------------------------------------------- masks
def dense_mask(blocks: Blocks, doc_ids: torch.Tensor, window: int | None = None, block_causal: bool = False,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[b, 1, n*B, s + n*B]`` mask (True = attend). Keys: ``s`` context, then the blocks.

    ``window`` (sliding layers): context keys also need ``q_pos - k_pos < window``; ``block_causal``:
    inside the block, slot j sees slots <= j only.
    """
    b, n = blocks.anchors.shape
    B = blocks.block_size
    s = doc_ids.shape[1]
    t = torch.arange(s, device=doc_ids.device)
    ctx = (t[None, None, :] < blocks.anchors[:, :, None]) & (doc_ids[:, None, :] == blocks.doc[:, :, None])  # [b,n,s]
    ctx = ctx[:, :, None, :].expand(b, n, B, s)
    if window is not None:
        if position_ids is None:
            position_ids = t.expand(b, s)
        q_pos = blocks.positions  # [b, n, B]
        ctx = ctx & ((q_pos[..., None] - position_ids[:, None, None, :]) < window)
    ctx = ctx.reshape(b, n * B, s)
    blk_of = torch.arange(n * B, device=doc_ids.device) // B
    blk = blk_of[:, None] == blk_of[None, :]
    if block_causal:
        slot = torch.arange(n * B, device=doc_ids.device) % B
        blk = blk & (slot[None, :] <= slot[:, None])
    blk = blk[None].expand(b, n * B, n * B)
    return torch.cat([ctx, blk], dim=-1)[:, None]


def flex_block_mask(blocks: Blocks, doc_ids: torch.Tensor, window: int | None = None, block_causal: bool = False,
                    position_ids: torch.Tensor | None = None, contiguous: bool | None = None):
    """The same rule as ``dense_mask`` as a flex-attention ``BlockMask`` (built once per batch).

    contiguous: ``train.block_mask.documents_contiguous`` of ``doc_ids``, when the caller has it from the
    host copy (None: checked here)."""
    b, n = blocks.anchors.shape
    B = blocks.block_size
    s = doc_ids.shape[1]
    q_anchor = blocks.anchors.repeat_interleave(B, dim=1)  # [b, n*B]
    q_doc = blocks.doc.repeat_interleave(B, dim=1)
    q_pos = blocks.positions.flatten(1)
    if position_ids is None:
        position_ids = torch.arange(s, device=doc_ids.device).expand(b, s)

    def mask_mod(bi, h, q, kv):
        is_ctx = kv < s
        kc = torch.clamp(kv, max=s - 1)
        ctx = is_ctx & (kc < q_anchor[bi, q]) & (doc_ids[bi, kc] == q_doc[bi, q])
        if window is not None:
            ctx = ctx & ((q_pos[bi, q] - position_ids[bi, kc]) < window)
        kb = torch.clamp(kv - s, min=0)
        blk = (~is_ctx) & (kb // B == q // B)
        if block_causal:
            blk = blk & (kb % B <= q % B)
        return ctx | blk

    if window is None and not block_causal:  # tiles straight from the block tensors (train/block_mask.py)
        direct = block_mask.direct_block_mask(blocks.anchors, blocks.valid, doc_ids, B, mask_mod, contiguous)
        if direct is not None:
            return direct
    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=n * B, KV_LEN=s + n * B, device=doc_ids.device)


def attention_masks(drafter_config, blocks: Blocks, doc_ids: torch.Tensor, position_ids: torch.Tensor | None,
                    use_flex: bool, contiguous: bool | None = None):
    """The mask argument for ``DFlashDraftModel.forward``: one mask, or a dict by layer type.

    contiguous: whether each row's documents are contiguous runs, known on the host (flex only; None:
    checked on ``doc_ids``, a read back from the GPU there)."""
    build = functools.partial(flex_block_mask, contiguous=contiguous) if use_flex else dense_mask
    full = build(blocks, doc_ids)
    if not drafter_config.use_sliding_window:
        return full
    sliding = build(blocks, doc_ids, window=drafter_config.sliding_window,
                    block_causal=drafter_config.sliding_block_attention == "causal", position_ids=position_ids)
    return {"full_attention": full, "sliding_attention": sliding}
