"""DFlash2's selector term of the training loss (docs/design.md, "DFlash2"): what ``train.objective.block_loss``
needs of a DFlash2 drafter (:class:`SelectorTerm`), what embeds its blocks, the selector's teacher-forced K-way
cross-entropy of each scored slot, and the selector walk's drafts that its ``correct`` counts."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from models.drafter2 import edge, unary_logits, walk
from models.provenance import SELECTOR_LOSS_ALPHA
from train.blocks import Blocks


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
