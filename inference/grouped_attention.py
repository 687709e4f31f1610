"""Attention of the static loop's fixed-shape passes over a whole K/V buffer, without repeated K/V.

HF's SDPA repeats K/V ``heads / kv_heads`` times whenever a mask is given, and the static passes
(``inference.static_loop``) always have one (stale slots past the committed length): at batch 1 that
copy of every layer's cache is written and read again each pass, a cost that grows with the context.
``attend_grouped`` packs the query heads that share a K/V head into one longer query instead; the
target's passes reach it through an HF attention function registered under ``GROUPED_SDPA``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface


def attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None = None) -> torch.Tensor:
    """SDPA of ``[1, Hq, T, d]`` queries over ``[1, Hkv, L, d]`` keys, without repeating K/V.

    The query heads that share a K/V head go in as rows of one longer query (``[1, Hkv, rep*T, d]``,
    row ``j*T + t`` = head ``g*rep + j`` at position ``t``), with the head-shared mask ``[1, 1, T, L]``
    tiled to match: the same scores, without writing and reading ``rep`` copies of the whole cache
    (HF repeats K/V whenever there is a mask, which the static passes always have).
    """
    b, hq, t, dim = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    if rep > 1:
        q = q.reshape(b, hkv, rep * t, dim)
        mask = None if mask is None else mask.expand(b, 1, t, -1).repeat(1, 1, rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).reshape(b, hq, t, dim)


def _grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The target's attention in the fixed-shape static passes (an HF attention function): ``attend_grouped``
    over the whole K/V buffer, returned as HF's SDPA returns it (``[b, T, heads, d]``)."""
    return attend_grouped(query, key, value, attention_mask, scale=scaling).transpose(1, 2).contiguous(), None


GROUPED_SDPA = "draftsmith_grouped_sdpa"
AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
