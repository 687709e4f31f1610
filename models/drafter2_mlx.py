"""The DFlash2 drafter in MLX, the twin of ``drafter2.py`` name for name (same classes, attributes, keys).

The v1 backbone of ``drafter_mlx.py`` with a grouped dynamic causal conv around each sublayer
(``attention_conv``, ``mlp_conv``: block-local, tap 0 = the slot itself) and the model-level
``candidate_selector`` that re-ranks each slot's top-K unary candidates walking from the bonus token
(:func:`select`). See ``drafter2.py`` for the computation and the initialisation.

Quantized MLX exports quantize the linears (``kernel_projection`` and ``hidden_projection`` included) and
leave ``base_kernel`` and the two codebooks in float: they are plain arrays, not linears.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from models.config import DFlashConfig
from models.config_keys import CODEBOOKS
from models.drafter_mlx import DFlashDecoderLayer, DFlashDraftModel, DraftCache
from models.hub import resolve_model_dir


class DynamicConv(nn.Module):
    """A grouped dynamic causal conv over the slots of each block (a layer's ``attention_conv`` or ``mlp_conv``)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, K = config.hidden_size, config.conv_kernel_size
        self.taps, self.groups, self.block_size = K, config.conv_groups, config.block_size
        self.base_kernel = identity_kernel(K, H)
        self.kernel_projection = nn.Linear(H, 2 * K * self.groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(x convolved by side 0, side 1's dynamic weights ``[b, q, K, H/G]`` for :meth:`finish`)."""
        b, q, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(b, q, 2, self.taps, self.groups)
        return self.convolve(x, 0, dynamic[:, :, 0]), dynamic[:, :, 1]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return self.convolve(y, 1, dynamic)

    def convolve(self, u: mx.array, side: int, dynamic: mx.array) -> mx.array:
        """``out_t = sum_j (base_kernel[side, j] + D_t[j]) * u_{t-j}``, with u_{t-j} = 0 before the block's start."""
        b, q, H = u.shape
        # one pass of fewer slots than a block is one shorter block (inference with a smaller block size)
        B = min(self.block_size, q)
        if q % B:
            raise ValueError(f"DFlash2 convs run over whole blocks: {q} block slots is not a multiple of "
                             f"block_size {B}")
        blocks = u.reshape(b, q // B, B, H)
        base = self.base_kernel[side].astype(u.dtype)
        out = None
        for j in range(min(self.taps, B)):  # a tap at or past the block's start reads zeros
            past = blocks if j == 0 else mx.pad(blocks[:, :, :B - j], [(0, 0), (0, 0), (j, 0), (0, 0)])
            past = past.reshape(b, q, H)
            term = past * base[j] + (past.reshape(b, q, self.groups, -1) * dynamic[:, :, j, :, None]).reshape(b, q, H)
            out = term if out is None else out + term
        return out


def identity_kernel(taps: int, hidden: int) -> mx.array:
    """``[2, taps, hidden]``: tap 0 = 1, the others 0."""
    return mx.concatenate([mx.ones((2, 1, hidden)), mx.zeros((2, taps - 1, hidden))], axis=1)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = DynamicConv(config)
        self.mlp_conv = DynamicConv(config)

    def __call__(self, hidden, context, rope_ctx, rope_blk, mask, cache=None):
        a, dynamic = self.attention_conv.prepare(self.input_layernorm(hidden))
        hidden = hidden + self.attention_conv.finish(self.self_attn(a, context, rope_ctx, rope_blk, mask, cache),
                                                     dynamic)
        m, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_conv.finish(self.mlp(m), dynamic)


class CandidateSelector(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = mx.zeros((config.vocab_size, config.selector_rank))
        self.successor_codebook = mx.zeros((config.vocab_size, config.selector_rank))


class Proposal(NamedTuple):
    """As ``drafter2.Proposal``: tokens [b, n], candidates [b, n, K] (best first), scores and q (None: greedy)."""

    tokens: mx.array
    candidates: mx.array
    scores: mx.array
    q: mx.array | None


def unary_logits(logits: mx.array, output_multiplier: float = 1.0, softcap: float | None = None) -> mx.array:
    if output_multiplier != 1.0:
        logits = logits * output_multiplier
    if softcap:
        logits = softcap * mx.tanh(logits / softcap)
    return logits


def top_k(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(values, ids) of the k largest entries of the last axis, best first (mlx has no sorted top-k)."""
    ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    values = mx.take_along_axis(logits, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)


def edge(projected: mx.array, predecessor: mx.array, candidates: mx.array, predecessor_codebook: mx.array,
         successor_codebook: mx.array) -> mx.array:
    """As ``drafter2.edge``: projected [..., r], predecessor [...], candidates [..., K] -> [..., K] (float32)."""
    weighted = predecessor_codebook[predecessor].astype(mx.float32) * projected.astype(mx.float32)
    return (successor_codebook[candidates].astype(mx.float32) @ weighted[..., None]).squeeze(-1)


def select(logits: mx.array, projected: mx.array, predecessor_codebook: mx.array, successor_codebook: mx.array,
           bonus: mx.array, top_k_: int, temperature: float = 0.0, uniform: mx.array | None = None) -> Proposal:
    """The selector walk, as ``drafter2.select`` (float32 scores and q; ``uniform`` [b, n] picks by inverse CDF)."""
    unary, candidates = top_k(logits.astype(mx.float32), top_k_)
    sampling = temperature > 0
    if sampling and uniform is None:
        uniform = mx.random.uniform(shape=unary.shape[:2])
    previous, tokens, scores, qs = bonus, [], [], []
    for s in range(unary.shape[1]):
        score = unary[:, s] + edge(projected[:, s], previous, candidates[:, s], predecessor_codebook,
                                   successor_codebook)
        if sampling:
            q = mx.softmax(score / temperature, axis=-1)
            pick = mx.minimum((mx.cumsum(q, axis=-1) <= uniform[:, s, None]).sum(-1), top_k_ - 1)
            qs.append(q)
        else:
            pick = mx.argmax(score, axis=-1)
        previous = mx.take_along_axis(candidates[:, s], pick[:, None], axis=-1).squeeze(-1)
        tokens.append(previous)
        scores.append(score)
    return Proposal(mx.stack(tokens, 1), candidates, mx.stack(scores, 1), mx.stack(qs, 1) if sampling else None)


class DFlash2DraftModel(DFlashDraftModel):
    """Weights: v1's names, plus the per-layer convs and ``candidate_selector`` (codebooks without ``.weight``)."""

    variant = "dflash2"
    decoder_layer = DFlash2DecoderLayer

    def __init__(self, config: DFlashConfig):
        if config.variant != "dflash2":
            raise ValueError(f"DFlash2DraftModel needs a variant dflash2 config, got {config.variant!r}")
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    def embed(self, ids: mx.array) -> mx.array:
        scale = self.config.input_embedding_scale
        return super().embed(ids) * scale if scale != 1.0 else super().embed(ids)

    def logits(self, hidden: mx.array) -> mx.array:
        return unary_logits(super().logits(hidden), self.config.output_multiplier, self.config.final_logit_softcapping)

    def propose(self, hidden: mx.array, bonus: mx.array, temperature: float = 0.0,
                uniform: mx.array | None = None) -> Proposal:
        """The proposal from a block's final hidden states of slots 1..B-1 and its bonus token (:func:`select`)."""
        selector = self.candidate_selector
        return select(self.logits(hidden), selector.hidden_projection(hidden), selector.predecessor_codebook,
                      selector.successor_codebook, bonus, self.config.selector_top_k, temperature, uniform)

    def propose_block(self, block_ids: mx.array, target_hidden: mx.array, position_ids: mx.array,
                      cache: DraftCache | None = None, temperature: float = 0.0,
                      uniform: mx.array | None = None) -> Proposal:
        hidden = self(self.embed(block_ids), target_hidden, position_ids, cache=cache)
        return self.propose(hidden[:, 1:], block_ids[:, 0], temperature, uniform)

    @staticmethod
    def state_from_disk(state: dict) -> dict:
        """Reads z-lab's ``...codebook.weight`` spelling as the published one (no ``.weight``)."""
        for name in CODEBOOKS:
            if f"{name}.weight" in state and name not in state:
                state[name] = state.pop(f"{name}.weight")
        return state


def drafter_class(config: DFlashConfig) -> type[DFlashDraftModel]:
    return DFlash2DraftModel if config.variant == "dflash2" else DFlashDraftModel


def load_drafter(path_or_id: str | Path, dtype: mx.Dtype | None = None, revision: str | None = None):
    """A drafter folder of either generation (HF or MLX export, quantized or not), as its MLX class."""
    directory = resolve_model_dir(path_or_id, revision=revision, what="drafter")
    return drafter_class(DFlashConfig.load(directory)).from_pretrained(directory, dtype=dtype)
