"""The DFlash block-diffusion objective (docs/design.md, "Training objective"), as tensor ops only.

The blocks of a batch come from ``train/blocks.py``: up to ``N`` anchors per row, each giving one block
``[token[a], MASK x (B-1)]`` at positions ``a .. a+B-1``, all of a row's blocks through the drafter in one
forward under the attention rule written there.

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

DFlash2 adds its candidate selector's cross-entropy to each slot's loss, under the same weight:
``train/selector_loss.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from train.blocks import Blocks
from train.selector_loss import SelectorTerm, _selector_ce, _walk_correct


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
