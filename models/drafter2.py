"""The DFlash2 drafter in PyTorch (the MLX twin is ``drafter2_mlx.py``, name for name).

DFlash2 keeps the v1 backbone of ``drafter.py`` unchanged (fc + hidden_norm over the tapped layers, K/V
injection in every layer, one non-causal pass per block) and adds two things:

- Per layer, two grouped dynamic causal convolutions over the slots of a block, inside the residual
  branch: ``attention_conv`` around the attention and ``mlp_conv`` around the MLP::

      a, d = attention_conv.prepare(input_layernorm(x));       x = x + attention_conv.finish(self_attn(a), d)
      m, d = mlp_conv.prepare(post_attention_layernorm(x));    x = x + mlp_conv.finish(mlp(m), d)

  Side 0 (``prepare``) convolves the sublayer's input, side 1 (``finish``) its output. Tap j of slot t
  reads slot t-j of the same block with the weight ``base_kernel[side, j, c] + D_t[side, j, group(c)]``,
  where ``D_t = kernel_projection(a_t)`` comes from the sublayer's normalised input at slot t (for both
  sides) and is shared by the ``conv_group_size`` channels of a group. Taps never cross a block's start:
  a training row of N blocks of B slots is convolved as N blocks, never as one sequence of N*B.
- A model-level ``candidate_selector`` that re-ranks each slot's top-K unary candidates, walking the block
  from the bonus token (:func:`select`)::

      score_s(k) = unary_s(k) + < predecessor_codebook[prev] * hidden_projection(h_s), successor_codebook[cand_s(k)] >

  Greedy takes the best candidate and makes it the next slot's predecessor; sampling draws from
  softmax(score / T) over the K candidates and keeps that q for the verifier's rejection sampling.

Initialisation (our choice, :meth:`DFlash2DraftModel.init_weights`): identity convs (``base_kernel`` tap 0
= 1, other taps 0, ``kernel_projection`` 0; z-lab's code leaves ``base_kernel`` uninitialised), so a new
DFlash2 drafter computes exactly the hidden states of the v1 drafter with the same backbone; and
``hidden_projection`` 0 with codebooks ~ N(0, std), so the selector's edge term is exactly 0 and the first
walk is the unary argmax. Training is not stuck there: hidden_projection's gradient (the codebook rows'
product times h) is not zero, and the codebooks learn once it has moved.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.config import DFlashConfig
from models.config_keys import CODEBOOKS
from models.drafter import DFlashDecoderLayer, DFlashDraftModel, DraftCache
from models.hub import resolve_model_dir

log = logging.getLogger(__name__)


class DynamicConv(nn.Module):
    """A grouped dynamic causal conv over the slots of each block (a layer's ``attention_conv`` or ``mlp_conv``).

    ``base_kernel`` [2, K, H] is the static weight per side, tap and channel; ``kernel_projection`` maps a
    slot's normalised input to the dynamic weights ``[2 sides, K taps, H / G groups]`` (side-major).
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, K = config.hidden_size, config.conv_kernel_size
        self.taps, self.groups, self.block_size = K, config.conv_groups, config.block_size
        self.base_kernel = nn.Parameter(identity_kernel(K, H))
        self.kernel_projection = nn.Linear(H, 2 * K * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def reset_to_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.copy_(identity_kernel(self.taps, self.base_kernel.shape[-1]))
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x convolved by side 0, side 1's dynamic weights ``[b, q, K, H/G]`` for :meth:`finish`)."""
        b, q, _ = x.shape
        dynamic = self.kernel_projection(x).view(b, q, 2, self.taps, self.groups)
        return self.convolve(x, 0, dynamic[:, :, 0]), dynamic[:, :, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The sublayer's output ``y`` convolved by side 1, with the weights :meth:`prepare` made."""
        return self.convolve(y, 1, dynamic)

    def convolve(self, u: torch.Tensor, side: int, dynamic: torch.Tensor) -> torch.Tensor:
        """``out_t = sum_j (base_kernel[side, j] + D_t[j]) * u_{t-j}``, with u_{t-j} = 0 before the block's start."""
        b, q, H = u.shape
        # one pass of fewer slots than a block is one shorter block (inference with a smaller block size)
        B = min(self.block_size, q)
        if q % B:
            raise ValueError(f"DFlash2 convs run over whole blocks: {q} block slots is not a multiple of "
                             f"block_size {B}")
        blocks = u.view(b, q // B, B, H)
        base = self.base_kernel[side].to(u.dtype)
        out = None
        for j in range(min(self.taps, B)):  # a tap at or past the block's start reads zeros
            past = blocks if j == 0 else F.pad(blocks[:, :, :B - j], (0, 0, j, 0))  # slot t reads t-j of its block
            past = past.reshape(b, q, H)
            term = past * base[j] + (past.view(b, q, self.groups, -1) * dynamic[:, :, j, :, None]).view(b, q, H)
            out = term if out is None else out + term
        return out


def identity_kernel(taps: int, hidden: int) -> torch.Tensor:
    """``[2, taps, hidden]``: tap 0 = 1, the others 0 (with a zero projection the conv is the identity)."""
    kernel = torch.zeros(2, taps, hidden)
    kernel[:, 0] = 1.0
    return kernel


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """The v1 layer with a dynamic conv around each sublayer, inside its residual branch."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = DynamicConv(config)
        self.mlp_conv = DynamicConv(config)

    def forward(self, hidden, context, rope_ctx, rope_blk, mask, cache=None):
        a, dynamic = self.attention_conv.prepare(self.input_layernorm(hidden))
        hidden = hidden + self.attention_conv.finish(self.self_attn(a, context, rope_ctx, rope_blk, mask, cache),
                                                     dynamic)
        m, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_conv.finish(self.mlp(m), dynamic)


class CandidateSelector(nn.Module):
    """The low-rank pair scorer: ``hidden_projection`` [r, H] and two [V, r] codebooks (stored without ``.weight``)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))


class Proposal(NamedTuple):
    """A block's proposal for slots 1..B-1. ``tokens`` [b, n]; ``candidates`` [b, n, K] (the unary top-K, best
    first); ``scores`` [b, n, K] float32 (unary + edge, with the walk's own predecessors); ``q`` [b, n, K]
    float32 softmax(scores / T) aligned with ``candidates`` when sampling, None when greedy."""

    tokens: torch.Tensor
    candidates: torch.Tensor
    scores: torch.Tensor
    q: torch.Tensor | None


def unary_logits(logits: torch.Tensor, output_multiplier: float = 1.0,
                 softcap: float | None = None) -> torch.Tensor:
    """The target head's logits times ``output_multiplier``, then ``c tanh(l / c)`` when a soft-cap c is set."""
    if output_multiplier != 1.0:
        logits = logits * output_multiplier
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def edge(projected: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor,
         predecessor_codebook: torch.Tensor, successor_codebook: torch.Tensor) -> torch.Tensor:
    """The selector's pair term in float32, ``<predecessor_codebook[prev] * projected, successor_codebook[cand]>``:
    projected [..., r], predecessor [...], candidates [..., K] -> [..., K]. The walk calls it slot by slot; with
    the true previous tokens as predecessors (teacher forcing) it scores every slot at once."""
    weighted = predecessor_codebook[predecessor].float() * projected.float()
    return (successor_codebook[candidates].float() @ weighted[..., None]).squeeze(-1)


def select(logits: torch.Tensor, projected: torch.Tensor, predecessor_codebook: torch.Tensor,
           successor_codebook: torch.Tensor, bonus: torch.Tensor, top_k: int, temperature: float = 0.0,
           uniform: torch.Tensor | None = None) -> Proposal:
    """The selector walk over one block: pure, fixed-shape tensor ops with no host read (CUDA-graph safe).

    logits: [b, n, V] unary logits of slots 1..n (:func:`unary_logits` applied); projected: [b, n, r]
    ``hidden_projection`` of the same slots' hidden states; bonus: [b] the block's slot-0 token, slot 1's
    predecessor. ``temperature`` <= 0 is greedy; otherwise ``uniform`` [b, n] (draws in [0, 1), from
    ``torch.rand`` when None) picks each slot's candidate by inverse CDF of q. Scores and q are computed in
    float32 whatever the model dtype. The candidates are each slot's top-K, best first; :func:`walk` walks them.
    """
    unary, candidates = logits.float().topk(top_k, dim=-1)
    return walk(unary, candidates, projected, predecessor_codebook, successor_codebook, bonus, temperature, uniform)


def walk(unary: torch.Tensor, candidates: torch.Tensor, projected: torch.Tensor, predecessor_codebook: torch.Tensor,
         successor_codebook: torch.Tensor, bonus: torch.Tensor, temperature: float = 0.0,
         uniform: torch.Tensor | None = None) -> Proposal:
    """The walk of :func:`select` from each slot's candidates already chosen: unary [b, n, K] float32 and
    candidates [b, n, K] (the top-K, best first), projected [b, n, r], bonus [b]. The walk is sequential (slot s's
    predecessor is slot s-1's choice): a loop over the n slots of tensor ops. Training's simulated acceptance
    calls it with the top-K its LM-head chunks kept (``train.objective.block_loss``), inference through
    :func:`select`."""
    top_k = candidates.shape[-1]
    sampling = temperature > 0
    if sampling and uniform is None:
        uniform = torch.rand(unary.shape[:2], device=unary.device)
    previous, tokens, scores, qs = bonus, [], [], []
    for s in range(unary.shape[1]):
        score = unary[:, s] + edge(projected[:, s], previous, candidates[:, s], predecessor_codebook,
                                   successor_codebook)  # [b, K]
        if sampling:
            q = torch.softmax(score / temperature, dim=-1)
            pick = (q.cumsum(-1) <= uniform[:, s, None]).sum(-1).clamp(max=top_k - 1)
            qs.append(q)
        else:
            pick = score.argmax(-1)
        previous = candidates[:, s].gather(-1, pick[:, None]).squeeze(-1)
        tokens.append(previous)
        scores.append(score)
    return Proposal(torch.stack(tokens, 1), candidates, torch.stack(scores, 1),
                    torch.stack(qs, 1) if sampling else None)


class DFlash2DraftModel(DFlashDraftModel):
    """Weights: v1's names, plus ``layers.{i}.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}`` and
    ``candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}``."""

    variant = "dflash2"
    decoder_layer = DFlash2DecoderLayer
    _no_split_modules = ["DFlash2DecoderLayer"]  # FSDP's units (recipes/accelerate/fsdp.yaml)

    def __init__(self, config: DFlashConfig):
        if config.variant != "dflash2":
            raise ValueError(f"DFlash2DraftModel needs a variant dflash2 config, got {config.variant!r}")
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    def init_weights(self, std: float = 0.02) -> "DFlash2DraftModel":
        """The backbone as v1 (linears ~ N(0, std), norms 1); identity convs; codebooks ~ N(0, std) and a zero
        ``hidden_projection``, so training starts from the v1 computation and the unary ranking."""
        super().init_weights(std)
        for layer in self.layers:
            layer.attention_conv.reset_to_identity()
            layer.mlp_conv.reset_to_identity()
        selector = self.candidate_selector
        nn.init.zeros_(selector.hidden_projection.weight)
        nn.init.normal_(selector.predecessor_codebook, std=std)
        nn.init.normal_(selector.successor_codebook, std=std)
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        scale = self.config.input_embedding_scale
        return super().embed(ids) * scale if scale != 1.0 else super().embed(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unary logits: the target's head, ``output_multiplier`` and the soft-cap (what top-K ranks)."""
        return unary_logits(super().logits(hidden), self.config.output_multiplier, self.config.final_logit_softcapping)

    def propose(self, hidden: torch.Tensor, bonus: torch.Tensor, temperature: float = 0.0,
                uniform: torch.Tensor | None = None) -> Proposal:
        """The proposal from a block's final hidden states of slots 1..B-1 ``[b, B-1, H]`` and its bonus token
        ``[b]``: unary logits, top-K and the selector walk (:func:`select`)."""
        selector = self.candidate_selector
        return select(self.logits(hidden), selector.hidden_projection(hidden), selector.predecessor_codebook,
                      selector.successor_codebook, bonus, self.config.selector_top_k, temperature, uniform)

    @torch.no_grad()
    def propose_block(self, block_ids: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                      cache: DraftCache | None = None, temperature: float = 0.0,
                      uniform: torch.Tensor | None = None) -> Proposal:
        """One draft pass over ``[bonus, MASK x (B-1)]`` and its proposal (``draft`` gives the unary logits)."""
        hidden = self(self.embed(block_ids), target_hidden, position_ids, cache=cache)
        return self.propose(hidden[:, 1:], block_ids[:, 0], temperature, uniform)

    @staticmethod
    def state_from_disk(state: dict) -> dict:
        """z-lab's torch class saves the codebooks as embedding tables (``...codebook.weight``); the published
        layout, and ours, has no ``.weight``: both are read."""
        for name in CODEBOOKS:
            if f"{name}.weight" in state and name not in state:
                log.info("reading %s.weight as %s (the published name)", name, name)
                state[name] = state.pop(f"{name}.weight")
        return state


# ------------------------------------------------------------------ either generation
def drafter_class(config: DFlashConfig) -> type[DFlashDraftModel]:
    """The torch class that builds ``config``'s variant."""
    return DFlash2DraftModel if config.variant == "dflash2" else DFlashDraftModel


def load_drafter(path_or_id: str | Path, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 revision: str | None = None) -> DFlashDraftModel:
    """A drafter folder of either generation (v1 ``DFlashDraftModel`` or ``DFlash2DraftModel``), as its class."""
    directory = resolve_model_dir(path_or_id, revision=revision, what="drafter")
    return drafter_class(DFlashConfig.load(directory)).from_pretrained(directory, dtype=dtype, device=device)


def new_drafter(config: DFlashConfig, init_from: str | Path | None = None) -> DFlashDraftModel:
    """A drafter to train: fresh (:meth:`init_weights`, from the current torch seed) or warm-started from
    ``init_from``'s folder. A v1 folder starts a DFlash2 drafter with its backbone, identity convs and a
    fresh selector; a folder of the same generation is loaded whole. A DFlash2 folder cannot start a v1 one."""
    model = drafter_class(config)(config)
    if init_from is None:
        return model.init_weights()
    source = load_drafter(init_from)
    state = source.state_dict()
    if source.config.variant == config.variant:
        model.load_state_dict(state)
        return model
    if config.variant != "dflash2":
        raise ValueError(f"drafter.init_from={init_from} is a {source.config.architecture} drafter and this run trains "
                         f"a {config.architecture}: set drafter.variant={source.config.variant}")
    model.init_weights()
    missing, unexpected = model.load_state_dict(state, strict=False)
    new = [k for k in missing if not (k.startswith("candidate_selector.") or "_conv." in k)]
    if new or unexpected:
        raise ValueError(f"drafter.init_from={init_from}: its weights do not fit this drafter's backbone "
                         f"(missing {new}, unexpected {unexpected})")
    return model
