"""An uncached Qwen3.5 / 3.6 GatedDeltaNet decoder layer as two compiled halves around its chunked kernel.

For the tapped forward of online training (``TargetModel.compile_layers``). transformers' mixer takes
the projection's ``[batch, time, channels]`` output through a transpose, a depthwise conv (its torch
fallback unless ``causal-conv1d`` is installed: a Qwen3.5-9B step on an H200 spent ~6 ms there), a
SiLU, a transpose back, a split and reshapes, the decay gate in a few more kernels, and the chunked
kernel then copies q, k and v to make them contiguous. Here everything of the layer before the kernel
(input RMSNorm, the four input projections as one matmul, the conv as ``kernel`` shifted multiply-adds
in the projection's own layout so no transpose, SiLU, split, gates) is one compiled function writing
contiguous q, k, v, and everything after it (gated RMS norm, output projection, residual add, the
second RMSNorm, the MLP and its residual add) another: two graphs a layer, where compiling the layer's
parts one by one left its residual adds and the calls between the parts eager. The chunked kernel
runs as it is: flash-linear-attention's Triton kernels on CUDA (not traceable, and fla marks them so),
transformers' torch reference elsewhere.

The math is the layer's own, with its roundings in the same places: conv accumulated in fp32 and
rounded to the weight dtype before the SiLU, the decay gate in fp32, the kernel's own q/k L2 norm,
the layer's own norm and MLP modules. ``tests/test_fast_paths.py`` holds it to the layer. Passes with
a cache, packed sequences (``cu_seq_lens_q``) or any other argument run the layer's own forward.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys

import torch
import torch.nn.functional as F
from torch import nn

from models.cache_keywords import CACHE_KWARGS, passes_cache

# What the mixer must have for the fused path (transformers' Qwen3_5GatedDeltaNet and its MoE twin).
_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj",
          "key_dim", "value_dim", "head_k_dim", "head_v_dim", "num_k_heads", "num_v_heads")
# The layer's keyword arguments besides its cache: its input, its mask, and those it ignores when no cache
# is given. Any other one (packed sequences' ``cu_seq_lens_q``, ...) sends the pass to the layer's own forward.
_KNOWN = ("hidden_states", "attention_mask", "cache_position", "position_ids", "position_embeddings", "use_cache",
          "output_attentions")


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU of the causal depthwise conv over time of ``x`` ``[batch, time, channels]`` with ``nn.Conv1d``'s
    ``weight`` ``[channels, 1, kernel]``: output ``t`` sees inputs ``t - kernel + 1 .. t`` (zeros before the
    start). Accumulated in fp32, rounded to the weight's dtype (as the conv's output is), SiLU, ``x``'s dtype."""
    k, t = weight.shape[-1], x.shape[1]
    w = weight[:, 0].float()
    padded = F.pad(x.to(weight.dtype).float(), (0, 0, k - 1, 0))
    out = padded[:, :t] * w[:, 0]
    for j in range(1, k):
        out = out + padded[:, j:j + t] * w[:, j]
    if bias is not None:
        out = out + bias.float()
    return F.silu(out.to(weight.dtype)).to(x.dtype)


def join_input_projections(m: nn.Module) -> bool:
    """Give mixer ``m``'s four input projections (qkv, z, b, a) one weight, so its compiled inputs run one
    matmul where they ran four (two of them only ``num_v_heads`` wide, which leave a GPU mostly idle). The
    joined weight is a buffer; the four linears' weights become views of it, so nothing is copied twice
    and the layer's own forward (a pass with a cache) computes the same. Plain bias-free ``nn.Linear`` of
    one dtype only (quantized layers keep theirs): False when left as they were."""
    parts = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
    if any(type(p) is not nn.Linear or p.bias is not None for p in parts):
        return False
    if len({(p.weight.dtype, p.weight.device) for p in parts}) != 1:
        return False
    if getattr(m, "in_proj_joined", None) is None:
        joined = torch.cat([p.weight.detach() for p in parts])
        m.register_buffer("in_proj_joined", joined, persistent=False)  # not a checkpoint entry
        start = 0
        for p in parts:
            p.weight = nn.Parameter(joined[start:start + p.out_features], requires_grad=False)
            start += p.out_features
    return True


def _projections(m: nn.Module, x: torch.Tensor):
    """The mixer's four input projections of ``x``: one matmul when they are joined, else four."""
    joined = getattr(m, "in_proj_joined", None)
    if joined is None:
        return m.in_proj_qkv(x), m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x)
    sizes = [m.in_proj_qkv.out_features, m.in_proj_z.out_features, m.in_proj_b.out_features,
             m.in_proj_a.out_features]
    return torch.split(F.linear(x, joined), sizes, dim=-1)


def mixer_inputs(m: nn.Module, x: torch.Tensor, mask: torch.Tensor | None):
    """Everything of mixer ``m`` before the chunked kernel: q, k, v ``[b, t, heads, d]`` (contiguous), the
    log decay ``g`` (fp32) and ``beta`` ``[b, t, v_heads]``, and the output gate ``z``."""
    if mask is not None:  # padding positions contribute nothing to the state (the layer's own masking)
        x = (x * mask[:, :, None]).to(x.dtype)
    b, t, _ = x.shape
    qkv, z, beta, a = _projections(m, x)
    qkv = causal_conv_silu(qkv, m.conv1d.weight, m.conv1d.bias)
    q, k, v = torch.split(qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(b, t, -1, m.head_k_dim).contiguous()
    k = k.reshape(b, t, -1, m.head_k_dim).contiguous()
    v = v.reshape(b, t, -1, m.head_v_dim).contiguous()
    # fp32: in fp16 exp(A_log) could overflow to inf (the layer's own reason)
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    return q, k, v, g, beta.sigmoid(), z


def mixer_output(m: nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Everything of mixer ``m`` after the chunked kernel: gated RMS norm per value head, output projection."""
    b, t = core.shape[:2]
    core = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(core.reshape(b, t, -1))


def layer_inputs(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None):
    """Everything of a decoder layer before its mixer's chunked kernel: the input RMSNorm, then
    ``mixer_inputs``."""
    return mixer_inputs(layer.linear_attn, layer.input_layernorm(x), mask)


def layer_output(layer: nn.Module, x: torch.Tensor, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Everything of a decoder layer after the chunked kernel, ``x`` being the layer's input: the mixer's
    output and the residual add, then the second RMSNorm, the MLP and its residual add."""
    h = x + mixer_output(layer.linear_attn, core, z)
    out = layer.mlp(layer.post_attention_layernorm(h))
    if isinstance(out, tuple):  # a sparse MoE block that also returns its router logits
        out = out[0]
    return h + out


def chunk_kernel(m: nn.Module):
    """The chunked gated delta rule the layer itself would run: flash-linear-attention's on CUDA when
    installed, else the torch reference of the layer's transformers module (None when it has none).
    The reference repeats q/k heads for grouped value heads itself, as fla does from 0.6 on; before
    that, the q/k heads are repeated here (the same math)."""
    fla = fla_kernel() if m.out_proj.weight.device.type == "cuda" else None
    return fla or getattr(sys.modules.get(type(m).__module__), "torch_chunk_gated_delta_rule", None)


def fla_kernel():
    """flash-linear-attention's chunked gated delta rule (None when it is not installed)."""
    try:
        fla = importlib.import_module("fla")
        kernel = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except (ImportError, AttributeError):
        return None
    return _grouped(kernel, _version(getattr(fla, "__version__", "0")) >= (0, 6))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def _grouped(kernel, takes_groups: bool):
    """``kernel`` for q/k with fewer heads than v: as it is when it takes them so, else after repeating them."""
    if takes_groups:
        return kernel

    def repeated(q, k, v, **kwargs):
        n = v.shape[2] // q.shape[2]
        return kernel(q.repeat_interleave(n, dim=2), k.repeat_interleave(n, dim=2), v, **kwargs)
    return repeated


def fusable(layer: nn.Module) -> bool:
    """Whether ``layer`` is a GatedDeltaNet decoder layer this file can run: its norms, MLP and mixer present,
    the mixer's parts present, a SiLU conv, weights resident (not offloaded to meta by a device map), and a
    chunked kernel to call."""
    m = getattr(layer, "linear_attn", None)
    if m is None or not all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp")):
        return False
    if not all(hasattr(m, name) for name in _PARTS) or getattr(m, "activation", "silu") != "silu":
        return False
    if any(p.device.type == "meta" for p in layer.parameters()):
        return False
    return chunk_kernel(m) is not None


def uncached_forward(layer: nn.Module, inputs, output, kernel=None):
    """A replacement for ``layer.forward``: ``inputs`` / ``output`` (``layer_inputs`` / ``layer_output``,
    compiled or not) around the mixer's chunked kernel for a plain uncached pass, the layer's own forward
    otherwise."""
    eager = layer.forward
    kernel = kernel or chunk_kernel(layer.linear_attn)
    known = _KNOWN + CACHE_KWARGS

    def forward(*args, **kwargs):
        if passes_cache(kwargs):  # decoding and the held-out generation: the layer's own cached forward
            return eager(*args, **kwargs)
        other = [name for name, value in kwargs.items() if value is not None and name not in known]
        if len(args) > 1 or other:
            _say_slow_path(other or [f"{len(args)} positional arguments"])
            return eager(*args, **kwargs)
        # A target spread over GPUs (device_map) has accelerate's hook on each layer, which ``eager`` runs:
        # it moves the layer's inputs to the layer's GPU. This forward replaces ``eager``, so it runs the hook.
        hook = getattr(layer, "_hf_hook", None)
        if hook is not None:
            args, kwargs = hook.pre_forward(layer, *args, **kwargs)
        x = args[0] if args else kwargs["hidden_states"]
        q, k, v, g, beta, z = inputs(layer, x, kwargs.get("attention_mask"))
        core, _ = kernel(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=True)
        out = output(layer, x, core, z)
        return out if hook is None else hook.post_forward(layer, out)
    return forward


_SAID: set[tuple[str, ...]] = set()


def _say_slow_path(what: list[str]) -> None:
    """One log line per kind of call that the compiled halves cannot take (another transformers version's
    arguments, packed sequences): such passes run the layer's own, slower, forward, and a speed figure
    taken then would not be the fused path's."""
    key = tuple(sorted(what))
    if key not in _SAID:
        _SAID.add(key)
        logging.getLogger(__name__).warning(
            "GatedDeltaNet layer called with %s: running transformers' own layer forward, not the compiled "
            "halves (models/gated_deltanet.py lists the arguments it takes)", ", ".join(key))
