"""Standalone DFlash drafter for ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.

draftsmith copies this file into every drafter folder as ``modeling_dflash.py`` (the target of
``auto_map`` in config.json). It depends on torch and transformers only, and computes exactly what
draftsmith's ``models/drafter.py`` computes (a parity test holds them together).

forward(noise_embedding [b, q, H], target_hidden [b, c, taps*H], position_ids [b, c+q],
attention_mask=None) -> hidden states at the block positions (apply the target's LM head).
With ``attention_mask=None`` the block sees all its context and itself; sliding-window layers
(``layer_types``) see context keys within ``sliding_window`` positions, and inside the block all
of it (``dflash_config.sliding_block_attention: bidirectional``) or only earlier slots (``causal``).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    f = positions.float()[..., None] * inv
    emb = torch.cat([f, f], -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos().to(x.dtype) + torch.cat([-x2, x1], -1) * emb.sin().to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.nh, self.nkv, self.hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = Qwen3RMSNorm(self.hd, config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, config.rms_norm_eps)
        self.theta = config.rope_theta if hasattr(config, "rope_theta") else config.rope_parameters["rope_theta"]

    def forward(self, x, ctx, pos, mask):
        b, q, _ = x.shape
        c = ctx.shape[1]
        split = lambda t, n: t.view(b, t.shape[1], n, self.hd).transpose(1, 2)  # noqa: E731
        both = torch.cat([ctx, x], 1)  # injected context keys/values first, then the block
        qs = _rope(self.q_norm(split(self.q_proj(x), self.nh)), pos[:, c:], self.theta)
        ks = _rope(self.k_norm(split(self.k_proj(both), self.nkv)), pos, self.theta)
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
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        taps = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
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
