"""The DFlash block-diffusion objective (docs/design.md, "Training objective"), as tensor ops only.

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

Slot ``k`` (1..B-1) predicts the token at ``a_n + k``. A slot is scored only while the run of
labels ``a_n+1 .. a_n+k`` stays inside the loss mask and the document ("slots past the loss mask
get no loss": once the assistant turn ends, later slots are not scored even if another assistant
turn starts within the block). The loss is ``sum w_k * l_k / sum w_k`` over scored slots of the
batch, ``w_k = exp(-(k-1)/gamma)`` (``decay``, the paper's) or the D-PACE weights of each block's
per-slot CE (``dpace``, :func:`dpace_weights`; divided by their sum, the scored slots or the rows),
where ``l_k`` is cross-entropy to the label (``ce``), KL from the target's next-token distribution
(``kl``), or their sum (``ce+kl``, KL scaled by ``kl_weight``). LM head + loss run in chunks, so
``N*(B-1) x vocab`` logits never exist at once, not even for the backward pass: with the target's
frozen head each chunk's ``d loss / d hidden`` is computed while its logits exist (``_LinearLoss``);
a trained head falls back to checkpointing.

Two mask builders give the same mask: ``dense_mask`` (boolean ``[b, 1, N*B, s+N*B]``, used with
SDPA on CPU, where flex attention has no backward) and ``flex_block_mask`` (a flex-attention
``BlockMask`` from the same rule, used on CUDA). Sliding-window drafter layers get their own
mask (window on context keys, ``sliding_block_attention`` inside the block), passed per layer type.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch
from torch.nn.attention.flex_attention import create_block_mask
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.drafter2 import edge, unary_logits, walk
from models.provenance import SELECTOR_LOSS_ALPHA
from models.support import to_device
from train import block_mask  # direct_block_mask looked up at each call (train.bench swaps it to time the other)


# ----------------------------------------------------------------------------- weights
def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """``w_k = exp(-(k-1)/gamma)`` for slots k = 1..B-1 (unnormalised; the loss divides by the sum)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def loss_weight(blocks: "Blocks", gamma: float) -> torch.Tensor:
    """Sum of ``w_k`` over the scored slots of ``blocks``: the denominator of their loss (before any forward)."""
    w = slot_weights(blocks.block_size, gamma, blocks.label_mask.device)
    return (w * blocks.label_mask).sum()


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights of the slots of each block: ``[..., B-1]`` per-slot CE and slot mask -> ``[..., B-1]``.

    ``q_j = exp(-CE_j)`` is the drafter's probability of the label, smoothed to ``q~_j = (1 - alpha) q_j + alpha``
    (a masked slot counts as ``q~ = 1``); ``C_k = prod_{i<=k} q~_i`` is the chance that the first ``k`` slots are
    all accepted, and ``w_j = sum_{k>=j} C_k m_k`` (0 on masked slots) is how much of the block's expected
    acceptance hangs on slot ``j``. Computed from detached CE: the weights steer the loss, no gradient flows
    through them. ``alpha = 1`` makes them independent of the drafter: ``w_j`` = scored slots from ``j`` on.
    """
    ce = ce.detach().float()
    q = (1 - alpha) * torch.exp(-ce) + alpha
    q = torch.where(mask, q, torch.ones_like(q))  # also replaces whatever a masked slot's CE holds (inf, NaN)
    reach = torch.cumprod(q, dim=-1) * mask
    return reach.flip(-1).cumsum(-1).flip(-1) * mask


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


# ----------------------------------------------------------------------------- forward + loss
@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: weighted_sum / normaliser (decay, D-PACE "weights": / weight, a weighted mean)
    correct: torch.Tensor  # [b, n, B-1] bool: argmax == label (False where not scored)
    label_mask: torch.Tensor  # [b, n, B-1]
    valid: torch.Tensor  # [b, n]
    ce: torch.Tensor  # scalar: unweighted mean CE over scored slots (for logs)
    # Sums, for normalising over several micro-batches / processes (the trainer divides by the
    # normaliser of the whole optimizer step): sum of w_k * loss_k, sum of w_k, and the unweighted
    # per-slot CE and KL sums over the `scored` slots (logs).
    weighted_sum: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    ce_sum: torch.Tensor | None = None
    kl_sum: torch.Tensor | None = None
    scored: int = 0
    slot_weight: torch.Tensor | None = None  # [B-1]: sum of w at each slot over the scored blocks (where the loss goes)
    # DFlash2 (a ``selector``): the selector CE's unweighted sum over the scored slots, and each scored slot's
    # unary argmax == label (``correct`` is then the selector walk's, what the loops propose).
    selector_ce_sum: torch.Tensor | None = None
    unary_correct: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.valid.sum())


def _slot_losses(logits: torch.Tensor, labels: torch.Tensor, t_ids: torch.Tensor | None, t_logp: torch.Tensor | None,
                 mode: str, kl_weight: float):
    """The loss math, once, in fp32: per-slot loss, CE, KL, argmax (and lse / teacher probs for the gradient).

    CE is ``lse - logit[label]``. KL(target || drafter) runs over the target's top-k tokens (the mass
    outside top-k is dropped). Differentiable by autograd; ``_loss_and_dlogits`` adds the closed-form
    gradient for the frozen-head path.
    """
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    ce = (lse - x.gather(-1, labels[:, None]))[:, 0]
    per_slot = ce * (1.0 if mode in ("ce", "ce+kl") else 0.0)
    kl, p = torch.zeros_like(ce), None
    if mode in ("kl", "ce+kl"):
        p = t_logp.exp()
        diff = torch.where(p > 0, t_logp - (x.gather(-1, t_ids.long()) - lse), torch.zeros_like(p))
        kl = (p * diff).sum(-1)
        per_slot = per_slot + kl_weight * kl
    return per_slot, ce, kl, x.argmax(-1), x, lse, p


def _chunk_loss(h: torch.Tensor, head_w: torch.Tensor, labels: torch.Tensor, t_ids: torch.Tensor | None,
                t_logp: torch.Tensor | None, mode: str, kl_weight: float, unary=None, top_k: int = 0):
    """LM head + loss of one chunk through autograd (a trained head, or no gradient at all). ``unary`` (DFlash2's
    multiplier / soft-cap, or None) turns the head's logits into the drafter's; ``top_k`` > 0 also returns the
    chunk's :func:`_candidates`."""
    logits = h @ head_w.t()
    if unary is not None:
        logits = unary(logits)
    per_slot, ce, kl, pred, *_ = _slot_losses(logits, labels, t_ids, t_logp, mode, kl_weight)
    out = (per_slot, ce.detach(), kl.detach(), pred)
    return out + _candidates(logits, labels, top_k) if top_k else out


def _candidates(logits: torch.Tensor, labels: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's top-K unary candidates (best first), then its label: ``(values [c, K+1] float32, ids [c, K+1])``.
    The selector term and the selector walk need only these K+1 entries of the chunk's ``c x vocab`` logits."""
    values, ids = logits.topk(top_k, dim=-1)
    ids = torch.cat([ids, labels[:, None]], dim=1)
    return torch.cat([values, logits.gather(-1, labels[:, None])], dim=1).float(), ids


def _unary_and_slope(logits: torch.Tensor, unary) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafter's unary logits from the head's, and their elementwise slope ``d unary / d logits`` (None when
    ``unary`` is None: the identity). Through the drafter's own function and autograd, so training differentiates
    exactly what the loops rank."""
    if unary is None:
        return logits, None
    with torch.enable_grad():
        x = logits.detach().requires_grad_()
        u = unary(x)
        (slope,) = torch.autograd.grad(u, x, torch.ones_like(u))
    return u.detach(), slope


def _loss_and_dlogits(logits: torch.Tensor, labels: torch.Tensor, t_ids: torch.Tensor | None,
                      t_logp: torch.Tensor | None, mode: str, kl_weight: float):
    """``_slot_losses`` plus ``d per_slot_r / d logits_r`` (row r only depends on row r), written so
    that one compiled kernel reads the logits a few times and writes the gradient once in their dtype."""
    per_slot, ce, kl, pred, x, lse, p = _slot_losses(logits, labels, t_ids, t_logp, mode, kl_weight)
    soft = torch.exp(x - lse)
    c_ce = 1.0 if mode in ("ce", "ce+kl") else 0.0
    vocab = torch.arange(x.shape[-1], device=x.device)
    dlogits = soft * c_ce - (vocab == labels[:, None]).to(x.dtype) * c_ce
    if p is not None:
        pp = torch.where(p > 0, p, torch.zeros_like(p))
        # d/dx of -sum_i p_i logp[t_i] = softmax * sum_i p_i - scatter(p_i at t_i)
        dlogits = (dlogits + kl_weight * soft * pp.sum(-1, keepdim=True)).scatter_add(
            -1, t_ids.long(), -kl_weight * pp)
    return per_slot, ce, kl, pred, dlogits.to(logits.dtype)


_COMPILED_LOSS = None


def _loss_kernel(device: torch.device):
    """Compiled on CUDA: eager spends ~6 fp32 passes over chunk x vocab logits forward and again backward."""
    global _COMPILED_LOSS
    if device.type != "cuda":
        return _loss_and_dlogits
    if _COMPILED_LOSS is None:
        _COMPILED_LOSS = torch.compile(_loss_and_dlogits, dynamic=None)
    return _COMPILED_LOSS


class _LinearLoss(torch.autograd.Function):
    """LM head + loss of one chunk whose gradient is computed in the forward pass (frozen head).

    Each scored slot's loss depends only on its own hidden row, so ``d loss_r / d h_r`` (a row of
    ``H``) is all the backward needs: ``grad_h = grad_out[:, None] * G``. Computing ``G`` while the
    logits exist costs one ``chunk x vocab x H`` product instead of checkpointing's recompute of the
    logits plus that product, and keeps ``[chunk, H]`` rather than any ``chunk x vocab`` tensor.

    DFlash2: ``unary`` (its multiplier / soft-cap, or None) makes the drafter's logits of the head's, and
    ``top_k`` > 0 also returns each row's :func:`_candidates`, whose values carry a gradient to ``h``:
    ``sum_j g_j slope_j W[id_j]`` over the row's K+1 entries, one ``embedding_bag`` of the head's rows in the
    backward (only the ``[chunk, K+1]`` ids and slopes are kept).
    """

    @staticmethod
    def forward(ctx, h, head_w, labels, t_ids, t_logp, mode, kl_weight, unary=None, top_k=0):
        logits = h @ head_w.t()  # the ambient autocast applies, as in _chunk_loss
        logits, slope = _unary_and_slope(logits, unary)
        per_slot, ce, kl, pred, dlogits = _loss_kernel(h.device)(logits, labels, t_ids, t_logp, mode, kl_weight)
        if slope is not None:  # d loss / d head logits = d loss / d unary * slope
            dlogits = dlogits * slope.to(dlogits.dtype)
        g = (dlogits @ head_w.to(dlogits.dtype)).to(h.dtype)
        ctx.top_k = top_k
        if not top_k:
            ctx.save_for_backward(g)
            ctx.mark_non_differentiable(ce, kl, pred)
            return per_slot, ce, kl, pred
        values, ids = _candidates(logits, labels, top_k)
        ctx.save_for_backward(g, head_w, ids, None if slope is None else slope.gather(-1, ids).float())
        ctx.mark_non_differentiable(ce, kl, pred, ids)
        return per_slot, ce, kl, pred, values, ids

    @staticmethod
    def backward(ctx, grad_per_slot, *grads):
        g, *candidates = ctx.saved_tensors
        grad_h = grad_per_slot[:, None] * g
        if ctx.top_k:  # the candidates' values: grads = (ce, kl, pred, values, ids)
            head_w, ids, slopes = candidates
            grad_values = grads[3] if slopes is None else grads[3] * slopes
            grad_h = grad_h + F.embedding_bag(ids, head_w, per_sample_weights=grad_values.to(head_w.dtype),
                                              mode="sum").to(g.dtype)
        return (grad_h.to(g.dtype),) + (None,) * 8


NORMALISERS = ("weights", "tokens", "rows")


@dataclass
class SelectorTerm:
    """What ``block_loss`` needs of a DFlash2 drafter for its selector term (:func:`selector_term` builds it)."""

    selector: torch.nn.Module  # the drafter's candidate_selector: hidden_projection and the two codebooks
    top_k: int  # selector_top_k: the unary candidates the selector ranks
    alpha: float  # train.selector_loss_alpha: the selector CE's weight beside the unary loss
    unary: Callable[[torch.Tensor], torch.Tensor] | None  # the drafter's multiplier / soft-cap (None: both off)


def selector_term(drafter, alpha: float | None = None) -> SelectorTerm | None:
    """The selector term of an (unwrapped) drafter: None for DFlash v1. The unary transform is the drafter's own
    ``models.drafter2.unary_logits`` with its config, so training ranks and scores what the loops propose."""
    if getattr(drafter, "variant", "dflash") != "dflash2":
        return None
    c = drafter.config
    unary = None
    if c.output_multiplier != 1.0 or c.final_logit_softcapping:
        unary = functools.partial(unary_logits, output_multiplier=c.output_multiplier,
                                  softcap=c.final_logit_softcapping)
    return SelectorTerm(drafter.candidate_selector, c.selector_top_k,
                        SELECTOR_LOSS_ALPHA if alpha is None else float(alpha), unary)


def block_embedder(drafter, embed_tokens):
    """What embeds the blocks' tokens: a DFlash2 drafter's own ``embed`` (the target's embedding times its
    ``input_embedding_scale``, as its loops do), else the target's embedding."""
    return drafter.embed if getattr(drafter, "variant", "dflash") == "dflash2" else embed_tokens


def _selector_ce(projected: torch.Tensor, predecessor: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                 labels: torch.Tensor, predecessor_codebook: torch.Tensor,
                 successor_codebook: torch.Tensor) -> torch.Tensor:
    """The selector's K-way cross-entropy of each slot of a chunk ``[c]``, teacher-forced.

    values / ids ``[c, K+1]``: the unary top-K, best first, then the label (:func:`_candidates`). A label outside
    the top-K replaces the K-th candidate, with its own unary value, so every slot has a target: the label's index.
    Scores: ``unary + edge`` (``models.drafter2.edge``, the loops' own) with the true previous token as the
    predecessor (``predecessor`` [c]: the bonus token for slot 1, the label of slot k-1 for slot k).
    """
    top_k = ids.shape[1] - 1
    hit = ids[:, :top_k] == labels[:, None]
    found = hit.any(-1)
    last = torch.where(found, ids[:, top_k - 1], labels)
    candidates = torch.cat([ids[:, :top_k - 1], last[:, None]], dim=1)
    unary = torch.cat([values[:, :top_k - 1], torch.where(found, values[:, top_k - 1], values[:, top_k])[:, None]],
                      dim=1)
    target = torch.where(found, hit.long().argmax(-1), torch.full_like(labels, top_k - 1))
    scores = unary + edge(projected, predecessor, candidates, predecessor_codebook, successor_codebook)
    return F.cross_entropy(scores, target, reduction="none")


@torch.no_grad()
def _walk_correct(blocks: Blocks, idx: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                  projected: torch.Tensor, selector: torch.nn.Module) -> torch.Tensor:
    """``[b, n, B-1]``: the selector walk's draft == label at each scored slot (what the loops propose: the walk
    from the bonus token over each slot's unary top-K, without the label injected). The scored slots are a prefix
    of each block, so the walk over them is the loops' walk; the slots after it are never counted."""
    b, n = blocks.anchors.shape
    B, K = blocks.block_size, ids.shape[1] - 1
    rows = b * n * (B - 1)
    unary = values.new_zeros(rows, K).index_copy(0, idx, values[:, :K].detach())
    candidates = ids.new_zeros(rows, K).index_copy(0, idx, ids[:, :K])
    proj = projected.new_zeros(rows, projected.shape[-1]).index_copy(0, idx, projected.detach())
    drafts = walk(unary.view(b * n, B - 1, K), candidates.view(b * n, B - 1, K), proj.view(b * n, B - 1, -1),
                  selector.predecessor_codebook, selector.successor_codebook, blocks.block_ids[..., 0].flatten()).tokens
    return (drafts.view_as(blocks.labels) == blocks.labels) & blocks.label_mask


def block_loss(hidden: torch.Tensor, blocks: Blocks, head_weight: torch.Tensor, gamma: float | None, *,
               chunk: int = 4096, mode: str = "ce", kl_weight: float = 1.0, topk_ids: torch.Tensor | None = None,
               topk_logprobs: torch.Tensor | None = None, weighting: str = "decay", dpace_alpha: float = 0.5,
               normaliser: str = "weights", selector: SelectorTerm | None = None) -> LossOutput:
    """Weighted, normalised loss over the scored slots of every block; LM head + loss in chunks.

    hidden: drafter output ``[b, n*B, H]``. topk_ids / topk_logprobs (KL only, ``[b, s, k]``): the
    target's top-k next-token log-probs at every position; slot k's teacher is the target's
    distribution at position ``anchor + k - 1`` (the one that predicts ``anchor + k``).
    weighting: ``decay`` (``slot_weights`` of ``gamma``) or ``dpace`` (``dpace_weights`` of ``dpace_alpha`` and
    the per-slot hard-label CE, whatever ``mode`` is). normaliser: the loss is ``weighted_sum`` over the
    weight sum (``weights``), the scored slots (``tokens``) or the rows of the batch (``rows``).

    selector (DFlash2, :func:`selector_term`): each slot's loss is ``unary_k + alpha * selector_k``, the unary
    loss on the drafter's logits (multiplier / soft-cap applied) and the selector's teacher-forced K-way CE
    (:func:`_selector_ce`), both under the same slot weight ``w_k`` (D-PACE's from the unary CE) and normaliser;
    ``correct`` is then the selector walk's (:func:`_walk_correct`). The top-K is taken inside each LM-head chunk
    and the selector's ``[chunk, K]`` scores are recomputed in the backward, so no more than today's chunk of
    logits exists at once.
    """
    if weighting not in ("decay", "dpace") or normaliser not in NORMALISERS:
        raise ValueError(f"weighting={weighting!r}, normaliser={normaliser!r}: use decay or dpace, and one of "
                         f"{NORMALISERS}")
    b, n = blocks.anchors.shape
    B = blocks.block_size
    H = hidden.shape[-1]
    sel, idx = blocks.label_mask, blocks.scored_index  # idx: the scored slots of the [b, n, B-1] grid, flat
    # Slot 0 of each block is the given anchor token (nothing to predict): grid slot (blk, k) is hidden row
    # blk * B + k + 1. Only scored slots reach the LM head; gathered by index, nothing is read back.
    k_slot = idx % (B - 1)  # each scored slot's place in its block, less the anchor
    h = hidden.reshape(b * n * B, H).index_select(0, idx // (B - 1) * B + k_slot + 1)  # [M, H]
    y = blocks.labels.flatten().index_select(0, idx)
    t_ids = t_logp = None
    if mode != "ce":
        if topk_ids is None or topk_logprobs is None:
            raise ValueError(f"train.loss={mode} needs the target's top-k log-probs (online: train.kl_topk > 0; "
                             "offline: a store extracted with top-k)")
        # Slots past the row's end are never scored, but their index must still be inside the row.
        src = (blocks.anchors[:, :, None] + torch.arange(B - 1, device=hidden.device)).clamp(max=topk_ids.shape[1] - 1)
        src = src.flatten(1)
        k = topk_ids.shape[-1]
        t_ids = topk_ids.gather(1, src[..., None].expand(-1, -1, k)).view(-1, k).index_select(0, idx)
        t_logp = topk_logprobs.float().gather(1, src[..., None].expand(-1, -1, k)).view(-1, k).index_select(0, idx)
    extra = ()
    if selector is not None:  # teacher forcing: slot 1's predecessor is the bonus token, slot k's the label of k-1
        extra = (selector.unary, selector.top_k)
        predecessor = torch.cat([blocks.block_ids[..., :1], blocks.labels[..., :-1]], -1).flatten().index_select(0, idx)
        module = selector.selector
        projected = module.hidden_projection(h)  # [M, r]
        codebooks = (module.predecessor_codebook, module.successor_codebook)
    per_slot, ce, kl, pred, sel_ce, values, ids = [], [], [], [], [], [], []
    for i in range(0, h.shape[0], chunk):
        args = (h[i:i + chunk], head_weight, y[i:i + chunk], None if t_ids is None else t_ids[i:i + chunk],
                None if t_logp is None else t_logp[i:i + chunk], mode, kl_weight, *extra)
        if torch.is_grad_enabled() and h.requires_grad and not head_weight.requires_grad:
            ls, c, k_, p, *cand = _LinearLoss.apply(*args)
        elif torch.is_grad_enabled() and h.requires_grad:  # a trained head needs its own gradient too
            ls, c, k_, p, *cand = checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            ls, c, k_, p, *cand = _chunk_loss(*args)
        if selector is not None:
            sel_args = (projected[i:i + chunk], predecessor[i:i + chunk], *cand, y[i:i + chunk], *codebooks)
            # recomputed in the backward: its [chunk, K, r] successor rows are never kept for every chunk at once
            s = (checkpoint(_selector_ce, *sel_args, use_reentrant=False) if torch.is_grad_enabled()
                 else _selector_ce(*sel_args))
            sel_ce.append(s)
            values.append(cand[0])
            ids.append(cand[1])
        per_slot.append(ls)
        ce.append(c)
        kl.append(k_)
        pred.append(p)
    slot_weight = torch.zeros(B - 1, device=hidden.device)
    selector_ce_sum = walk_correct = None
    if per_slot:
        per_slot_t, ce_t, kl_t, pred_t = torch.cat(per_slot), torch.cat(ce), torch.cat(kl), torch.cat(pred)
        if selector is not None:
            sel_t = torch.cat(sel_ce)
            per_slot_t = per_slot_t + selector.alpha * sel_t  # alpha 0 still keeps the selector in the graph (DDP)
            selector_ce_sum = sel_t.detach().sum()
            walk_correct = _walk_correct(blocks, idx, torch.cat(values), torch.cat(ids), projected, module)
        if weighting == "dpace":
            # Every chunk's CE is in hand (detached) before a weight is needed, so a block that straddles chunks
            # gets the weights of the whole block: they multiply the chunks' per-slot losses afterwards, and the
            # backward only scales each chunk's kept d loss / d hidden rows (no logits again).
            grid = torch.zeros(b * n * (B - 1), device=hidden.device).index_copy(0, idx, ce_t.float())
            w = dpace_weights(grid.view(b * n, B - 1), sel.view(b * n, B - 1), dpace_alpha)
            w = w.view(-1).index_select(0, idx)
        else:
            w = slot_weights(B, gamma, hidden.device)[k_slot]
        weighted_sum, weight = (w * per_slot_t).sum(), w.sum()
        loss = weighted_sum / {"weights": weight, "tokens": float(y.shape[0]), "rows": float(b)}[normaliser]
        ce_mean, ce_sum, kl_sum = ce_t.mean(), ce_t.sum(), kl_t.sum()
        slot_weight = slot_weight.index_add(0, k_slot, w)
    else:  # no scored slot in this batch: a zero loss that still touches the graph (the selector's too: DDP)
        loss = weighted_sum = hidden.sum() * 0.0 + sum(
            p.sum() for p in (selector.selector.parameters() if selector is not None else ())) * 0.0
        weight = ce_mean = ce_sum = kl_sum = loss.detach()
        pred_t = y
        if selector is not None:
            selector_ce_sum, walk_correct = loss.detach(), torch.zeros_like(sel)
    correct = torch.zeros_like(sel).view(-1).scatter(0, idx, pred_t == y).view_as(sel)
    return LossOutput(loss=loss, correct=correct if walk_correct is None else walk_correct, label_mask=sel,
                      valid=blocks.valid, ce=ce_mean, weighted_sum=weighted_sum, weight=weight, ce_sum=ce_sum,
                      kl_sum=kl_sum, scored=int(y.shape[0]), slot_weight=slot_weight, selector_ce_sum=selector_ce_sum,
                      unary_correct=None if selector is None else correct)


def drafter_forward(drafter, embed, blocks: Blocks, features: torch.Tensor, position_ids: torch.Tensor,
                    mask) -> torch.Tensor:
    """All blocks of a batch in one drafter pass: ``[b, n*B, H]`` hidden states.

    ``embed`` embeds the block tokens: the target's (frozen) embedding, or for DFlash2 the drafter's own
    ``embed`` (:func:`block_embedder`: it scales by ``input_embedding_scale``); ``drafter`` may be a DDP/FSDP wrapper.
    """
    noise = embed(blocks.block_ids.flatten(1))
    pos = torch.cat([position_ids, blocks.positions.flatten(1)], dim=1)
    return drafter(noise, features, pos, attention_mask=mask)


# ----------------------------------------------------------------------------- acceptance
def simulated_acceptance(correct: torch.Tensor, label_mask: torch.Tensor,
                         valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Greedy acceptance each block would get: ``1 + leading slots with argmax == label``.

    Returns sums (to aggregate across batches and processes): ``tau_sum`` and ``blocks`` over valid
    blocks, per-slot ``pos_correct`` / ``pos_count`` (accuracy where the slot is scored) and
    ``pos_accept`` (blocks whose first k slots are all accepted).
    """
    acc = (correct & label_mask).long().cumprod(-1)  # [b, n, B-1]
    tau = 1 + acc.sum(-1)
    v = valid.long()  # valid blocks selected by a product: a boolean selection reads the mask back (a GPU wait)
    return {
        "tau_sum": (tau * v).sum().float(),
        "blocks": v.sum().float(),
        "pos_correct": (correct & label_mask).flatten(0, 1).sum(0).float(),
        "pos_count": label_mask.flatten(0, 1).sum(0).float(),
        "pos_accept": (acc * v[..., None]).flatten(0, 1).sum(0).float(),
    }
