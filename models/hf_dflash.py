"""Standalone DFlash and DFlash2 drafters for ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.

draftsmith copies this file into every drafter folder as ``modeling_dflash.py`` (the target of
``auto_map`` in config.json: ``DFlashDraftModel`` or ``DFlash2DraftModel``). It depends on torch and
transformers only, and computes exactly what draftsmith's ``models/drafter.py`` and ``models/drafter2.py``
compute (parity tests hold them together).

forward(noise_embedding [b, q, H], target_hidden [b, c, taps*H], position_ids [b, c+q],
attention_mask=None) -> hidden states at the block positions (apply the target's LM head, then
``cap * tanh(logits / cap)`` when config.json sets ``final_logit_softcapping``). RoPE is plain full-head
RoPE, or YaRN when ``rope_parameters`` is a YaRN block (as published gpt-oss drafters carry).
With ``attention_mask=None`` the block sees all its context and itself; sliding-window layers
(``layer_types``) see context keys within ``sliding_window`` positions, and inside the block all
of it (``dflash_config.sliding_block_attention: bidirectional``) or only earlier slots (``causal``).

DFlash2 adds a dynamic conv around each sublayer (over the slots of each block of ``block_size``) and a
candidate selector: ``propose(hidden[:, 1:], lm_head_weight, bonus)`` gives the greedy draft tokens.
Embed the block as ``embedding[ids] * dflash_config.input_embedding_scale`` (default 1).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm


def _rope(x, positions, theta, yarn=None):
    d = x.shape[-1]
    if yarn is None:
        inv, factor = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)), 1.0
    else:  # (inverse frequencies, attention factor) of the config's YaRN block, as transformers computes them
        inv, factor = yarn(x.device)
    f = positions.float()[..., None] * inv
    emb = torch.cat([f, f], -1)[:, None]
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    x1, x2 = x.chunk(2, -1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.nh, self.nkv, self.hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        h = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.hd, config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, config.rms_norm_eps)
        self.theta = config.rope_theta if hasattr(config, "rope_theta") else config.rope_parameters["rope_theta"]
        rope = getattr(config, "rope_parameters", None) or {}
        # computed at call time, in float32 on the input's device (the model is built on the meta device)
        self.yarn = (lambda device: ROPE_INIT_FUNCTIONS["yarn"](config, device)) if rope.get("rope_type") == "yarn" \
            else None

    def forward(self, x, ctx, pos, mask):
        b, q, _ = x.shape
        c = ctx.shape[1]
        split = lambda t, n: t.view(b, t.shape[1], n, self.hd).transpose(1, 2)  # noqa: E731
        both = torch.cat([ctx, x], 1)  # injected context keys/values first, then the block
        qs = _rope(self.q_norm(split(self.q_proj(x), self.nh)), pos[:, c:], self.theta, self.yarn)
        ks = _rope(self.k_norm(split(self.k_proj(both), self.nkv)), pos, self.theta, self.yarn)
        vs = split(self.v_proj(both), self.nkv)
        rep = self.nh // self.nkv
        out = F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1),
                                             attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


def _sliding_mask(position_ids, c, window, block_mode):
    """Boolean [b, 1, q, c+q]: context keys within the window; in the block, all or earlier slots."""
    q_pos = position_ids[:, c:]
    dist = q_pos[:, :, None] - position_ids[:, None, :]
    visible = dist < window
    visible[..., c:] = True if block_mode == "bidirectional" else dist[..., c:] >= 0
    return visible[:, None]


def _block_mode(config):
    """Our explicit field, else z-lab's convention (sliding layers causal unless is_causal is false)."""
    nested = getattr(config, "dflash_config", None) or {}
    if "sliding_block_attention" in nested:
        return nested["sliding_block_attention"]
    return "bidirectional" if getattr(config, "is_causal", None) is False else "causal"


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.attention_type = (getattr(config, "layer_types", None) or ["full_attention"] * (layer_idx + 1))[layer_idx]
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, ctx, pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer", "DFlash2DecoderLayer"]
    layer_class = DFlashDecoderLayer

    def __init__(self, config):
        super().__init__(config)
        taps = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, noise_embedding, target_hidden, position_ids, attention_mask=None):
        ctx = self.hidden_norm(self.fc(target_hidden))
        masks = {"full_attention": attention_mask, "sliding_attention": attention_mask}
        if attention_mask is None and any(layer.attention_type == "sliding_attention" for layer in self.layers):
            masks["sliding_attention"] = _sliding_mask(position_ids, ctx.shape[1], self.config.sliding_window,
                                                       _block_mode(self.config))
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, position_ids, masks[layer.attention_type])
        return self.norm(x)


# ----------------------------------------------------------------------------------------------- DFlash2
class DynamicConv(nn.Module):
    """Grouped dynamic causal conv over each block's slots: tap j of slot t reads slot t-j of its block with
    weight base_kernel[side, j, c] + kernel_projection(a_t)[side, j, c // group]; side 0 the sublayer input."""

    def __init__(self, config):
        super().__init__()
        dc = config.dflash_config
        self.taps, self.block = dc["conv_kernel_size"], dc["block_size"]
        self.groups = config.hidden_size // dc["conv_group_size"]
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, config.hidden_size))
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.taps * self.groups, bias=False)

    def convolve(self, u, side, dyn):
        b, q, h = u.shape
        blocks = u.view(b, q // self.block, self.block, h)
        out = 0
        for j in range(self.taps):
            past = F.pad(blocks[:, :, :self.block - j], (0, 0, j, 0)).reshape(b, q, h)
            out = out + past * self.base_kernel[side, j].to(u.dtype) + (
                past.view(b, q, self.groups, -1) * dyn[:, :, side, j, :, None]).view(b, q, h)
        return out


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config, layer_idx=0):
        super().__init__(config, layer_idx)
        self.attention_conv = DynamicConv(config)
        self.mlp_conv = DynamicConv(config)

    def forward(self, x, ctx, pos, mask):
        attn = lambda a: self.self_attn(a, ctx, pos, mask)  # noqa: E731
        for conv, norm, sublayer in ((self.attention_conv, self.input_layernorm, attn),
                                     (self.mlp_conv, self.post_attention_layernorm, self.mlp)):
            a = norm(x)
            dyn = conv.kernel_projection(a).view(*a.shape[:2], 2, conv.taps, conv.groups)
            x = x + conv.convolve(sublayer(conv.convolve(a, 0, dyn)), 1, dyn)
        return x


class CandidateSelector(nn.Module):
    def __init__(self, config):
        super().__init__()
        rank = config.dflash_config["selector_rank"]
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))


class DFlash2DraftModel(DFlashDraftModel):
    layer_class = DFlash2DecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    @torch.no_grad()
    def propose(self, hidden, lm_head_weight, bonus):
        """Greedy draft tokens [b, B-1]: hidden [b, B-1, H] (slots 1..B-1), the target's LM head [V, H], bonus [b].
        Unary logits (x output_multiplier, soft-capped), their top-K, re-scored walking from the bonus token."""
        dc = self.config.dflash_config
        logits = (hidden @ lm_head_weight.T) * dc.get("output_multiplier", 1.0)
        if dc.get("final_logit_softcapping"):
            logits = dc["final_logit_softcapping"] * torch.tanh(logits / dc["final_logit_softcapping"])
        unary, cand = logits.float().topk(dc["selector_top_k"], dim=-1)
        sel = self.candidate_selector
        z = sel.hidden_projection(hidden).float()
        prev, out = bonus, []
        for s in range(cand.shape[1]):
            edge = sel.predecessor_codebook[prev].float() * z[:, s]
            score = unary[:, s] + torch.einsum("bkr,br->bk", sel.successor_codebook[cand[:, s]].float(), edge)
            prev = cand[:, s].gather(-1, score.argmax(-1, keepdim=True)).squeeze(-1)
            out.append(prev)
        return torch.stack(out, 1)
