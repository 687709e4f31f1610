"""The DFlash drafter in MLX, the twin of ``drafter.py`` name for name (same classes, attributes, keys).

A stack of Qwen3-style decoder layers over a block ``[bonus, MASK x (B-1)]``. Context features go
through ``fc`` and ``hidden_norm`` once; every layer projects them with its own ``k_proj`` /
``v_proj`` (``k_norm`` and RoPE at their own positions) and prepends them to the block's keys and
values (KV injection). Queries come from block tokens only; the block attends to itself
bidirectionally. The embedding and LM head are the target's, borrowed and never saved.

Loads the same HF drafter folders as the torch drafter (flat or nested ``config.json``, fp32 /
bf16 safetensors, stray ``embed_tokens`` / ``lm_head`` dropped with a warning) and MLX export
folders whose ``config.json`` carries ``quantization: {bits, group_size[, mode]}`` (affine
``nn.quantize``: ``*.weight`` packed uint32 + ``*.scales`` + ``*.biases``). Activations run in the
dtype the caller picks, which the loop sets to the target's compute dtype (a quantized draft fed
fp16 activations under a bf16 target loses acceptance).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from models.config import DFlashConfig
from models.hub import resolve_model_dir
from models.rope import yarn_inv_freq
from models.weights import drop_stray_keys, weight_files

QUANT_SUFFIXES = (".scales", ".biases")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        # Accumulates in float32 and returns x's dtype, like the torch twin.
        return mx.fast.rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: mx.array, head_dim: int, theta: float, dtype: mx.Dtype, scaling: dict | None = None):
    """Full-head RoPE tables for integer positions ``[b, s]`` -> ``[b, 1, s, head_dim]``: plain, or YaRN when
    ``scaling`` (the config's ``rope_scaling``) is given, whose attention factor multiplies cos and sin."""
    if scaling:
        inv, factor = yarn_inv_freq(head_dim, theta, scaling)
        inv_freq = mx.array(inv)
    else:
        inv_freq = 1.0 / (theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim))
        factor = 1.0
    freqs = positions.astype(mx.float32)[..., None] * inv_freq
    emb = mx.concatenate([freqs, freqs], axis=-1)[:, None]
    cos, sin = mx.cos(emb), mx.sin(emb)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + mx.concatenate([-x2, x1], axis=-1) * sin


class DraftCache:
    """Keys/values of *committed* context only, per layer (the block's own keys are never stored).

    Backed by mlx_lm's ``KVCache`` (preallocated in steps), so an append costs O(new positions).
    """

    def __init__(self, num_layers: int):
        self.layers = [KVCache() for _ in range(num_layers)]

    def append(self, layer_idx: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        return self.layers[layer_idx].update_and_fetch(k, v)

    def lengths(self) -> list[int]:
        return [c.offset for c in self.layers]

    def __len__(self) -> int:
        return self.lengths()[0]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        h = config.hidden_size
        bias = config.attention_bias  # published gpt-oss drafters: biases on all four
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, s, _ = x.shape
        return x.reshape(b, s, n, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, hidden: mx.array, context: mx.array, rope_ctx, rope_blk, mask,
                 cache: DraftCache | None = None) -> mx.array:
        b, q_len, _ = hidden.shape
        q = apply_rope(self.q_norm(self._heads(self.q_proj(hidden), self.num_heads)), *rope_blk)
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(hidden), self.num_kv_heads)), *rope_blk)
        v_blk = self._heads(self.v_proj(hidden), self.num_kv_heads)
        # KV injection: the context goes through this layer's own k/v projections.
        k_ctx = apply_rope(self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads)), *rope_ctx)
        v_ctx = self._heads(self.v_proj(context), self.num_kv_heads)
        if cache is not None:
            k_ctx, v_ctx = cache.append(self.layer_idx, k_ctx, v_ctx)
        k = mx.concatenate([k_ctx, k_blk], axis=-2)
        v = mx.concatenate([v_ctx, v_blk], axis=-2)
        out = attend(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, q_len, -1))


def attend(q: mx.array, k: mx.array, v: mx.array, mask, scale: float) -> mx.array:
    """Fused SDPA (grouped-query heads natively) with a boolean mask (True = visible) or none."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def __call__(self, hidden, context, rope_ctx, rope_blk, mask, cache=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope_ctx, rope_blk, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def sliding_mask(q_pos: mx.array, k_pos: mx.array, num_ctx: int, window: int, block_mode: str) -> mx.array:
    """Boolean ``[b, 1, q, k]`` mask of a sliding layer at inference (all context before the block).

    The window applies to context keys (visible when ``q_pos - k_pos < window``). Inside the block
    every key is visible (``bidirectional``) or only those at or before the query (``causal``).
    """
    dist = q_pos[:, :, None] - k_pos[:, None, :]
    is_blk = (mx.arange(k_pos.shape[-1]) >= num_ctx)[None, None]
    in_block = mx.array(True) if block_mode == "bidirectional" else dist >= 0
    visible = mx.where(is_blk, in_block, dist < window)
    return visible[:, None]


class _Outside:
    """Holds a value outside mlx's module tree (mlx adopts dict/list attributes as children)."""

    def __init__(self, value):
        self.value = value


class DFlashDraftModel(nn.Module):
    """Weights are exactly the z-lab names: ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``."""

    variant = "dflash"  # the config variant this class builds (DFlash2: models/drafter2_mlx.py)
    decoder_layer = DFlashDecoderLayer

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = [self.decoder_layer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The target's embedding and LM head: borrowed, never trained, cast, quantized or saved.
        self._target = _Outside({})
        self._quantization = _Outside(None)

    # ----------------------------------------------------------- target parts
    def bind_target(self, embed_tokens, lm_head) -> "DFlashDraftModel":
        """Borrow the target's embedding and LM head (callables; quantized ones are fine)."""
        rows = _embedding_rows(embed_tokens)
        if rows is not None and rows != self.config.vocab_size:
            raise ValueError(f"target embedding has {rows} rows but the drafter's vocab_size is "
                             f"{self.config.vocab_size}: this drafter was trained for another target")
        self._target = _Outside({"embed": embed_tokens, "head": lm_head})
        return self

    def embed(self, ids: mx.array) -> mx.array:
        return self._require("embed")(ids)

    def logits(self, hidden: mx.array) -> mx.array:
        """The target's LM head; soft-capped when a v1 drafter's config says so (twin of the torch drafter)."""
        logits = self._require("head")(hidden)
        cap = self.config.final_logit_softcapping if self.variant == "dflash" else None
        return mx.tanh(logits / cap) * cap if cap else logits

    def _require(self, part: str):
        if part not in self._target.value:
            raise RuntimeError("the drafter has no embedding or LM head of its own: call bind_target(embed, lm_head) "
                               "with the target's modules first")
        return self._target.value[part]

    # ---------------------------------------------------------------- forward
    def __call__(self, noise_embedding: mx.array, target_hidden: mx.array, position_ids: mx.array,
                 attention_mask=None, cache: DraftCache | None = None) -> mx.array:
        """Hidden states (after the final norm) at the block positions.

        noise_embedding: ``[b, q, H]`` embedded block tokens. target_hidden: ``[b, c, taps*H]`` new
        context features. position_ids: ``[b, c + q]``, context positions then block positions
        (absolute). attention_mask: None (all context + whole block), a boolean ``[b, 1, q, keys]``
        mask, or a dict of those keyed by layer type. With a cache, keys are the cached context,
        then the new context, then the block.
        """
        c = target_hidden.shape[1]
        if target_hidden.shape[-1] != self.config.fc_in_features:
            raise ValueError(f"target_hidden has width {target_hidden.shape[-1]}, expected taps x hidden = "
                             f"{self.config.num_taps} x {self.config.hidden_size}: features must be the target "
                             f"layers {self.config.target_layer_ids} concatenated")
        context = self.hidden_norm(self.fc(target_hidden))
        dtype = noise_embedding.dtype
        rope = (self.config.head_dim, self.config.rope_theta, dtype, self.config.rope_scaling)
        rope_ctx = rope_cos_sin(position_ids[:, :c], *rope)
        rope_blk = rope_cos_sin(position_ids[:, c:], *rope)
        masks = self._masks(attention_mask, position_ids, c, cache)
        hidden = noise_embedding
        for layer in self.layers:
            hidden = layer(hidden, context, rope_ctx, rope_blk, masks[layer.attention_type], cache)
        return self.norm(hidden)

    def _masks(self, attention_mask, position_ids, c, cache):
        if isinstance(attention_mask, dict):
            return attention_mask
        masks = {"full_attention": attention_mask, "sliding_attention": attention_mask}
        if attention_mask is None and self.config.use_sliding_window:
            cached = len(cache) if cache is not None else 0
            # Inference keys: cached context 0..cached-1 (contiguous), then the new positions.
            past = mx.broadcast_to(mx.arange(cached)[None], (position_ids.shape[0], cached))
            k_pos = mx.concatenate([past, position_ids], axis=1)
            masks["sliding_attention"] = sliding_mask(position_ids[:, c:], k_pos, cached + c,
                                                      self.config.sliding_window, self.config.sliding_block_attention)
        return masks

    def draft(self, block_ids: mx.array, target_hidden: mx.array, position_ids: mx.array,
              cache: DraftCache | None = None) -> mx.array:
        """Logits for block slots 1..B-1 (``[b, B-1, vocab]``) for a block of token ids."""
        hidden = self(self.embed(block_ids), target_hidden, position_ids, cache=cache)
        return self.logits(hidden[:, 1:])

    # -------------------------------------------------------------- dtype
    @property
    def quantization(self) -> dict | None:
        """``{bits, group_size, mode}`` when the linears are affine-quantized, else None."""
        return self._quantization.value

    @property
    def dtype(self) -> mx.Dtype:
        """The compute dtype: the norm weights' (quantized linears keep packed uint32 weights)."""
        return self.norm.weight.dtype

    def to_dtype(self, dtype: mx.Dtype) -> "DFlashDraftModel":
        """Cast every floating parameter (norms, unquantized weights, quantization scales/biases)."""
        if self.dtype != dtype:
            self.set_dtype(dtype)  # only floating arrays: packed uint32 weights stay as they are
        return self

    # -------------------------------------------------------------- save/load
    def save_pretrained(self, directory: str | Path) -> Path:
        """Weights under the torch names + the canonical config (+ ``quantization`` when quantized)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        weights = dict(tree_flatten(self.parameters()))
        dtype_name = str(self.dtype).removeprefix("mlx.core.")
        config = self.config.replace(torch_dtype=dtype_name, quantization=self.quantization).to_dict()
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
        return directory

    def quantize(self, bits: int = 4, group_size: int = 64, mode: str = "affine") -> "DFlashDraftModel":
        """Affine-quantize every linear whose input width the group size divides (``nn.quantize``)."""
        nn.quantize(self, group_size=group_size, bits=bits, mode=mode,
                    class_predicate=lambda _p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0)
        self._quantization = _Outside({"bits": bits, "group_size": group_size, "mode": mode})
        return self

    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, dtype: mx.Dtype | None = None,
                        revision: str | None = None) -> "DFlashDraftModel":
        """An HF drafter folder (flat / nested config, fp32 / bf16) or an MLX (quantized) export."""
        directory = resolve_model_dir(path_or_id, revision=revision, what="drafter")
        config = DFlashConfig.load(directory)
        if config.variant != cls.variant:
            raise ValueError(f"{path_or_id} is a {config.architecture} drafter, which {cls.__name__} does not build: "
                             "load it with models.drafter2_mlx.load_drafter (either generation)")
        quant = config.quantization
        state = cls.state_from_disk(drop_stray_keys(load_safetensors(directory), directory))
        model = cls(config)
        if quant:
            quantized = {k.rsplit(".", 1)[0] for k in state if k.endswith(".scales")}
            nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], mode=quant["mode"],
                        class_predicate=lambda p, _m: p in quantized)
            model._quantization = _Outside(dict(quant))
        _check_state(model, state, config, directory)
        model.load_weights(list(state.items()), strict=True)
        target_dtype = dtype or _dtype_from_name(config.torch_dtype) or next(
            v.dtype for k, v in state.items() if k.endswith("norm.weight"))
        model.to_dtype(target_dtype)
        mx.eval(model.parameters())
        model.eval()
        return model

    @staticmethod
    def state_from_disk(state: dict) -> dict:
        """The state dict under this class's names, from a folder's tensors (DFlash2 renames old spellings)."""
        return state

    @property
    def num_parameters(self) -> int:
        return sum(v.size for _, v in tree_flatten(self.parameters()))


# ------------------------------------------------------------------ helpers
def _embedding_rows(embed) -> int | None:
    w = getattr(embed, "weight", None)
    return None if w is None else int(w.shape[0])


def _dtype_from_name(name: str | None) -> mx.Dtype | None:
    return {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}.get(name or "")


def _check_state(model: DFlashDraftModel, state: dict, config: DFlashConfig, directory: Path) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        hint = ""
        if any(k.endswith(QUANT_SUFFIXES) for k in unexpected):
            hint = " (quantized weights but no `quantization: {bits, group_size}` in config.json)"
        raise ValueError(f"drafter weights in {directory} do not match its config.json: missing {missing}, "
                         f"unexpected {unexpected}{hint}. Re-export the drafter, or fix config.json "
                         "(num_hidden_layers, target_layer_ids) to match the weights")
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            hint = (f" (fc input width = taps x hidden = {config.num_taps} x {config.hidden_size}; "
                    "target_layer_ids in config.json disagree with the weights)") if k.startswith("fc.") else ""
            raise ValueError(f"{directory}: weight {k} has shape {tuple(v.shape)}, config.json implies "
                             f"{tuple(expected[k].shape)}{hint}")


def load_safetensors(directory: Path) -> dict[str, mx.array]:
    """Every tensor of a (sharded) safetensors folder as MLX arrays (bf16 kept as bf16)."""
    state: dict[str, mx.array] = {}
    for path in weight_files(directory):
        try:
            state.update(mx.load(str(path)))
        except (RuntimeError, ValueError, OSError) as e:
            raise ValueError(f"{path} is corrupt or truncated ({e}); re-download or re-export it") from None
    return state
