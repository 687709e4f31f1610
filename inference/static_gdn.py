"""GatedDeltaNet (Qwen3.5 / 3.6) layers on static state for the static loop: rollback is choosing a state.

A GatedDeltaNet layer carries a recurrent state and a short convolution window instead of K/V, so
the static loop's rollback (a length reset) does not apply to it as such. Here every fixed-shape
pass keeps the state after *each* of its positions (``T`` states of ``heads x d_k x d_v``, fp32)
and its convolution inputs; the next pass starts from the state after the positions that were
committed (``keep``, a device tensor), picked by an index. No replay, no host decision, the same
shapes every cycle: the pass can be captured as a CUDA graph like the attention layers. The cost is
memory: Qwen3.5-9B keeps 16 x 32 x 128 x 128 fp32 (34 MB) per GatedDeltaNet layer, ~0.8 GB in all.

The math is transformers' ``Qwen3_5GatedDeltaNet.forward`` with its token-by-token gated delta
rule (``torch_recurrent_gated_delta_rule``): projections, causal depthwise conv + SiLU, L2-normed
q/k (grouped: each q/k head serves ``v_heads / k_heads`` value heads), the recurrence, gated RMS
norm, output projection. The prefill (any length, eager) runs the layer itself with a transformers
cache (its chunked kernel, flash-linear-attention on CUDA when installed) and keeps the final state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.target import cache_kwarg


class StaticGatedDeltaNet:
    """One GatedDeltaNet layer's state over passes of at most ``max_pass`` tokens (a verify block)."""

    def __init__(self, module, layer_idx: int, max_pass: int):
        m = self.m = module
        self.layer_idx, self.max_pass = layer_idx, max_pass
        self._cache_kw = cache_kwarg(module, "cache_params")
        dev, dt = m.out_proj.weight.device, m.out_proj.weight.dtype
        self.K = m.conv_kernel_size
        # Convolution inputs: the committed window (K-1 entries) followed by the last pass's inputs.
        self.window = torch.zeros(1, m.conv_dim, self.K - 1 + max_pass, device=dev, dtype=dt)
        # The recurrent state after each position of the last pass (fp32, as transformers keeps it).
        self.states = torch.zeros(max_pass, 1, m.num_v_heads, m.head_k_dim, m.head_v_dim, device=dev,
                                  dtype=torch.float32)
        self._taps = torch.arange(self.K - 1, device=dev)

    def committed(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, recurrent state) after the first ``keep`` positions of the last pass."""
        window = self.window.index_select(2, keep + self._taps)  # the K-1 inputs ending at position keep
        return window, self.states.index_select(0, keep - 1)[0]

    def prefill(self, x: torch.Tensor, cache) -> torch.Tensor:
        """The layer itself over a prompt of any length; its final state becomes the committed one (keep = 1)."""
        out = self.m(hidden_states=x, attention_mask=None, **{self._cache_kw: cache})
        layer = cache.layers[self.layer_idx]
        self.window[:, :, 1:self.K].copy_(layer.conv_states[0][:, :, -(self.K - 1):])
        self.states[0].copy_(layer.recurrent_states[0])
        return out

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``x`` [1, T, hidden] (T <= max_pass) after the committed ``keep`` positions of the last pass."""
        m, T = self.m, x.shape[1]
        window, state = self.committed(keep)
        qkv = m.in_proj_qkv(x).transpose(1, 2)  # [1, conv_dim, T]
        self.window[:, :, :self.K - 1].copy_(window)
        self.window[:, :, self.K - 1:self.K - 1 + T].copy_(qkv)
        conv = F.conv1d(torch.cat([window, qkv], dim=-1).to(m.conv1d.weight.dtype), m.conv1d.weight, m.conv1d.bias,
                        groups=m.conv_dim)
        qkv = F.silu(conv).to(x.dtype).transpose(1, 2)  # [1, T, conv_dim]
        q, k, v = torch.split(qkv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        group = m.num_v_heads // m.num_k_heads
        q = q.reshape(1, T, m.num_k_heads, m.head_k_dim).repeat_interleave(group, dim=2)
        k = k.reshape(1, T, m.num_k_heads, m.head_k_dim).repeat_interleave(group, dim=2)
        v = v.reshape(1, T, m.num_v_heads, m.head_v_dim)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [1, heads, T, d]
        q = _l2norm(q) / (m.head_k_dim ** 0.5)
        k = _l2norm(k)
        beta = m.in_proj_b(x).sigmoid().float().transpose(1, 2)  # [1, heads, T]
        decay = (-m.A_log.float().exp() * F.softplus(m.in_proj_a(x).float() + m.dt_bias)).transpose(1, 2)
        out = []
        for t in range(T):
            state = state * decay[:, :, t].exp()[..., None, None]
            delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
            state = state + k[:, :, t, :, None] * delta[:, :, None, :]
            self.states[t].copy_(state)
            out.append((state * q[:, :, t, :, None]).sum(-2))
        core = torch.stack(out, dim=2).transpose(1, 2).to(x.dtype)  # [1, T, heads, d_v]
        z = m.in_proj_z(x).reshape(1, T, m.num_v_heads, m.head_v_dim)
        core = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(1, T, -1)
        return m.out_proj(core)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
