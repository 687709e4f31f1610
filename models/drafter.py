"""The DFlash drafter in PyTorch (the MLX twin is ``drafter_mlx.py``, name for name).

A stack of Qwen3-style decoder layers over a block ``[bonus, MASK x (B-1)]``. Context features
(the target's tapped layer outputs, concatenated) go through ``fc`` and ``hidden_norm`` once; then
*every* layer projects them with its own ``k_proj``/``v_proj`` (``k_norm`` and RoPE at their own
positions) and prepends them to the block's keys/values (KV injection). Queries come from block
tokens only, and the block attends to itself bidirectionally. The embedding and LM head are the
target's, borrowed frozen and never saved.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from models.config import DFlashConfig
from models.config_keys import MODELING_FILE
from models.flex_options import kernel_options, parse_flex_backward, resolve_tiles
from models.hub import resolve_model_dir
from models.rope import yarn_inv_freq
from models.weights import drop_stray_keys, load_state_dict, save_state_dict


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None):
    """Full-head RoPE tables for integer positions ``[b, s]`` -> ``[b, 1, s, head_dim]``: plain, or YaRN when
    ``scaling`` (the config's ``rope_scaling``) is given, whose attention factor multiplies cos and sin."""
    if scaling:
        inv, factor = yarn_inv_freq(head_dim, theta, scaling)
        inv_freq = torch.from_numpy(inv).to(positions.device)
    else:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
                                    / head_dim))
        factor = 1.0
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftCache:
    """Keys/values of *committed* context only, per layer.

    Each draft call appends the new context positions and attends to them plus the block; the
    block's own keys/values are never stored, so the cache needs no rollback. Storage grows in
    steps of ``step`` positions (as mlx_lm's ``KVCache`` under the MLX twin), so an append costs
    O(new positions), not a re-concatenation of the whole context every cycle.
    """

    step = 256

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.offsets = [0] * num_layers

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, start = k.shape[-2], self.offsets[layer_idx]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or start + n > keys.shape[-2]:
            size = -(-(start + n) // self.step) * self.step
            grown_k = k.new_zeros(*k.shape[:-2], size, k.shape[-1])
            grown_v = v.new_zeros(*v.shape[:-2], size, v.shape[-1])
            if keys is not None:
                grown_k[..., :start, :] = keys[..., :start, :]
                grown_v[..., :start, :] = values[..., :start, :]
            self.keys[layer_idx], self.values[layer_idx] = keys, values = grown_k, grown_v
        keys[..., start:start + n, :] = k
        values[..., start:start + n, :] = v
        self.offsets[layer_idx] = start + n
        return keys[..., :start + n, :], values[..., :start + n, :]

    def lengths(self) -> list[int]:
        return list(self.offsets)

    def __len__(self) -> int:
        return self.lengths()[0]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        bias = config.attention_bias  # published gpt-oss drafters: biases on all four
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # flex attention's backward tiles (models/flex_options.py), set by DFlashDraftModel.forward
        self.flex_kernel_options: dict | None = None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope_ctx, rope_blk, mask,
                cache: DraftCache | None = None) -> torch.Tensor:
        b, q_len, _ = hidden.shape
        q = apply_rope(self.q_norm(self._heads(self.q_proj(hidden), self.num_heads)), *rope_blk)
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(hidden), self.num_kv_heads)), *rope_blk)
        v_blk = self._heads(self.v_proj(hidden), self.num_kv_heads)
        # KV injection: the context goes through this layer's own k/v projections.
        k_ctx = apply_rope(self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads)), *rope_ctx)
        v_ctx = self._heads(self.v_proj(context), self.num_kv_heads)
        if cache is not None:
            k_ctx, v_ctx = cache.append(self.layer_idx, k_ctx, v_ctx)
        k = torch.cat([k_ctx, k_blk], dim=-2)
        v = torch.cat([v_ctx, v_blk], dim=-2)
        out = attend(q, k, v, mask, self.flex_kernel_options)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, kernel_options: dict | None = None) -> torch.Tensor:
    """SDPA with a dense boolean mask (or none), flex attention with a ``BlockMask`` (CUDA training).

    kernel_options: the compiled flex kernel's tiles (``models.flex_options.kernel_options``).
    """
    if isinstance(mask, BlockMask):
        # The compiled kernel needs head_dim >= 16 (real drafters use 128); tiny test shapes run eager.
        fused = q.is_cuda and q.shape[-1] >= 16
        extra = {"kernel_options": kernel_options} if fused and kernel_options else {}
        return _flex_attention(fused)(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], **extra)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


_COMPILED_FLEX = None


def _flex_attention(fused: bool):
    """Compiled on CUDA (the fused kernel; eager flex materialises every score), eager elsewhere.

    Training shapes vary from batch to batch (row length, anchor count). ``dynamic=False`` would
    recompile for every new shape and, past dynamo's recompile limit, silently fall back to the
    eager kernel; the default lets dynamo mark the changing sizes dynamic after the first change.
    """
    global _COMPILED_FLEX
    if not fused:
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden, context, rope_ctx, rope_blk, mask, cache=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope_ctx, rope_blk, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def sliding_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, num_ctx: int, window: int, block_mode: str) -> torch.Tensor:
    """Boolean ``[b, 1, q, k]`` mask of a sliding layer at inference (all context before the block).

    The window applies to context keys (visible when ``q_pos - k_pos < window``). Inside the block
    every key is visible (``bidirectional``) or only those at or before the query (``causal``).
    """
    dist = q_pos[:, :, None] - k_pos[:, None, :]
    visible = dist < window
    visible[..., num_ctx:] = True if block_mode == "bidirectional" else dist[..., num_ctx:] >= 0
    return visible[:, None]


class DFlashDraftModel(nn.Module):
    """Weights are exactly the z-lab names: ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``."""

    variant = "dflash"  # the config variant this class builds (DFlash2: models/drafter2.py)
    decoder_layer = DFlashDecoderLayer
    # accelerate's FSDP wraps each module of these classes as one unit when its config names no layer class
    # (recipes/accelerate/fsdp.yaml names none, so either generation's layers are wrapped)
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._target: dict[str, nn.Module] = {}  # borrowed, so not a submodule: never trained or saved
        # Training only: recompute each layer's activations in the backward pass (train.grad_checkpointing).
        self.gradient_checkpointing = False
        self.flex_backward: str | tuple[int, ...] = "auto"  # train.flex_backward, parsed
        self._flex_for: tuple | None = None  # (setting, device) the layers' tiles were resolved for

    def set_flex_backward(self, setting: str) -> "DFlashDraftModel":
        """Flex attention's backward tiles for training: auto, torch or M1,N1,M2,N2,STAGES,WARPS
        (``models/flex_options.py``). Speed only: the attention computed is the same."""
        self.flex_backward = parse_flex_backward(setting)
        return self

    def init_weights(self, std: float = 0.02) -> "DFlashDraftModel":
        """Qwen3 initialisation for training from scratch: linears ~ N(0, std), norms stay at 1."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
        return self

    def compile_layers(self) -> "DFlashDraftModel":
        """``torch.compile`` each decoder layer (CUDA training, ``train.compile=true``).

        Eager, every norm, rotary product and SiLU gate is its own kernel reading and writing the
        whole activation; compiled, they fuse into the matmuls' neighbours. Layers, not the whole
        model, so that gradient checkpointing (which wraps each layer) still works and the one
        compiled graph serves every layer (same code and shapes; the weights are its inputs).
        """
        for layer in self.layers:
            layer.compile()
        return self

    # ----------------------------------------------------------- target parts
    def bind_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "DFlashDraftModel":
        """Borrow the target's embedding and LM head (frozen, not registered as parameters)."""
        if embed_tokens.weight.shape[0] != self.config.vocab_size:
            raise ValueError(f"target embedding has {embed_tokens.weight.shape[0]} rows but the drafter's "
                             f"vocab_size is {self.config.vocab_size}: this drafter was trained for another target")
        self._target = {"embed": embed_tokens, "head": lm_head}
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._require("embed")(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head; a v1 drafter whose config sets ``final_logit_softcapping`` (z-lab's Gemma 4
        drafter) soft-caps them (DFlash2 applies its own multiplier and cap, ``models.drafter2.unary_logits``)."""
        logits = self._require("head")(hidden)
        cap = self.config.final_logit_softcapping if self.variant == "dflash" else None
        return torch.tanh(logits / cap) * cap if cap else logits

    def _require(self, part: str) -> nn.Module:
        if part not in self._target:
            raise RuntimeError("the drafter has no embedding or LM head of its own: call bind_target(embed, lm_head) "
                               "with the target's modules first")
        return self._target[part]

    # ---------------------------------------------------------------- forward
    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask=None, cache: DraftCache | None = None) -> torch.Tensor:
        """Hidden states (after the final norm) at the block positions.

        noise_embedding: ``[b, q, H]`` embedded block tokens. target_hidden: ``[b, c, taps*H]`` new
        context features. position_ids: ``[b, c + q]``, context positions then block positions
        (absolute). attention_mask: None (inference: all context + whole block), a boolean
        ``[b, 1, q, keys]`` mask or a flex ``BlockMask``, or a dict of those keyed by layer type.
        With a cache, keys are the cached context, then the new context, then the block.
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
        if target_hidden.is_cuda and any(isinstance(m, BlockMask) for m in masks.values()):
            self._set_flex_tiles(target_hidden.device)
        hidden = noise_embedding
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                hidden = checkpoint(layer, hidden, context, rope_ctx, rope_blk, masks[layer.attention_type], cache,
                                    use_reentrant=False)
            else:
                hidden = layer(hidden, context, rope_ctx, rope_blk, masks[layer.attention_type], cache)
        return self.norm(hidden)

    def _set_flex_tiles(self, device: torch.device) -> None:
        # On the layers' attention, outside the compiled layers: a plain attribute the compiled code reads.
        # Resolved once per setting and device, not on every training step.
        if self._flex_for == (self.flex_backward, device):
            return
        options = kernel_options(resolve_tiles(self.flex_backward, device, self.config.head_dim))
        for layer in self.layers:
            layer.self_attn.flex_kernel_options = options
        self._flex_for = (self.flex_backward, device)

    def _masks(self, attention_mask, position_ids, c, cache):
        if isinstance(attention_mask, dict):
            return attention_mask
        masks = {"full_attention": attention_mask, "sliding_attention": attention_mask}
        if attention_mask is None and self.config.use_sliding_window:
            cached = len(cache) if cache is not None else 0
            # Inference keys: cached context 0..cached-1 (contiguous), then the new positions.
            k_pos = torch.cat([torch.arange(cached, device=position_ids.device).expand(position_ids.shape[0], -1),
                               position_ids], dim=1)
            masks["sliding_attention"] = sliding_mask(position_ids[:, c:], k_pos, cached + c,
                                                      self.config.sliding_window, self.config.sliding_block_attention)
        return masks

    @torch.no_grad()
    def draft(self, block_ids: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
              cache: DraftCache | None = None) -> torch.Tensor:
        """Logits for block slots 1..B-1 (``[b, B-1, vocab]``) for a block of token ids."""
        hidden = self(self.embed(block_ids), target_hidden, position_ids, cache=cache)
        return self.logits(hidden[:, 1:])

    # -------------------------------------------------------------- save/load
    def save_pretrained(self, directory: str | Path, max_shard_size: int | str = "5GB",
                        dtype: torch.dtype | None = None) -> Path:
        directory = Path(directory)
        state = {k: v.detach().to(dtype) if dtype else v.detach() for k, v in self.state_dict().items()}
        config = self.config.replace(torch_dtype=str(next(iter(state.values())).dtype).removeprefix("torch."))
        directory.mkdir(parents=True, exist_ok=True)
        config.save(directory)
        save_state_dict(state, directory, max_shard_size=max_shard_size)
        shipped = Path(__file__).with_name("hf_dflash.py")
        (directory / f"{MODELING_FILE}.py").write_text(shipped.read_text())
        return directory

    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, revision: str | None = None) -> "DFlashDraftModel":
        directory = resolve_model_dir(path_or_id, revision=revision, what="drafter")
        config = DFlashConfig.load(directory)
        if config.quantization:  # packed uint32 weights + scales: only MLX reads them
            q = config.quantization
            raise ValueError(f"{path_or_id} is a quantized MLX export ({q.get('bits')}-bit, group "
                             f"{q.get('group_size')}): only the MLX backend runs it (--backend mlx); with PyTorch "
                             "use the full-precision drafter (its HF export or the run's final/drafter)")
        if config.variant != cls.variant:
            raise ValueError(f"{path_or_id} is a {config.architecture} drafter, which {cls.__name__} does not build: "
                             "load it with models.drafter2.load_drafter (either generation)")
        state = cls.state_from_disk(drop_stray_keys(load_state_dict(directory), directory))
        model = cls(config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"drafter weights in {directory} do not match its config.json: missing {missing}, "
                             f"unexpected {unexpected}. Re-export the drafter, or fix config.json "
                             "(num_hidden_layers, target_layer_ids) to match the weights")
        for k, v in state.items():
            if v.shape != expected[k].shape:
                hint = (f" (fc input width = taps x hidden = {config.num_taps} x {config.hidden_size}; "
                        "target_layer_ids in config.json disagree with the weights)") if k == "fc.weight" else ""
                raise ValueError(f"{directory}: weight {k} has shape {tuple(v.shape)}, config.json implies "
                                 f"{tuple(expected[k].shape)}{hint}")
        model.load_state_dict(state, strict=True)
        target_dtype = dtype or getattr(torch, config.torch_dtype, None) or next(iter(state.values())).dtype
        return model.to(device=device, dtype=target_dtype).eval()

    @staticmethod
    def state_from_disk(state: dict) -> dict:
        """The state dict under this class's names, from a folder's tensors (DFlash2 renames old spellings)."""
        return state

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

