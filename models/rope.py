"""YaRN rotary frequencies, one formula for every place that needs them.

A drafter's RoPE is plain full-head 1-D RoPE unless its config carries a YaRN block: z-lab's published
gpt-oss (and Kimi) drafters copy their target's YaRN parameters into the drafter config, and engines apply
them. The torch drafter, the MLX drafter and the MLX gpt-oss target (whose mlx_lm rope rounds the
correction range even when the config says ``truncate: false``) all take their frequencies from
``yarn_inv_freq``, computed as transformers computes them (float32), so the three agree with the engines.
"""

from __future__ import annotations

import math

import numpy as np

# The keys of a YaRN block the drafter config keeps (besides rope_type and rope_theta).
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate")


def yarn_inv_freq(dim: int, theta: float, params: dict) -> tuple[np.ndarray, float]:
    """(inverse frequencies ``[dim / 2]`` float32, attention factor) of a YaRN block, as transformers computes them.

    The attention factor multiplies cos and sin (so the scores by its square): ``attention_factor`` when given,
    else from ``mscale`` / ``mscale_all_dim``, else ``0.1 ln(factor) + 1``.
    """
    factor = float(params["factor"])
    original = params["original_max_position_embeddings"]

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    import torch  # start-up time: models.config (every CLI's --help) reads rope_scaling_of alone

    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv.numpy(), float(attention)


def rope_scaling_of(block: dict | None) -> dict | None:
    """The YaRN parameters of a config's rope block (``rope_parameters`` / ``rope_scaling``), None for plain RoPE.

    Raises ``ValueError`` naming the type for any other scaling (a drafter runs plain or YaRN RoPE only)."""
    block = block or {}
    kind = block.get("rope_type", block.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r}: a drafter runs plain RoPE or YaRN")
    missing = [k for k in ("factor", "original_max_position_embeddings") if block.get(k) is None]
    if missing:
        raise ValueError(f"a YaRN rope block needs {' and '.join(missing)}")
    return {k: block[k] for k in YARN_KEYS if block.get(k) is not None}
