"""The facts about a target that shape its drafter: ``TargetShape`` (from its ``config.json``, or a recipe's
facts), and the drafter heads of a multi-head latent attention target (``mla_drafter_heads``). The drafter config
(``models.config.DFlashConfig.for_target``) and the dry-run plan read them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class TargetShape:
    """The facts about a target that shape its drafter (from its ``config.json``, or a recipe's facts)."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    max_position_embeddings: int = 40960
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None  # the target's own base frequency (the drafter's default)
    model_type: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> "TargetShape":
        """From an HF config (object or ``config.json`` dict); multimodal checkpoints: their text tower."""
        d = config if isinstance(config, dict) else config.to_dict()
        model_type = d.get("model_type")
        text = d.get("text_config") or d
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope and "rope_theta" not in rope and all(isinstance(v, dict) for v in rope.values()):
            rope = rope.get("full_attention") or next(iter(rope.values()))  # per-layer-type rope blocks
        theta = text.get("rope_theta") or rope.get("rope_theta")
        heads = text.get("num_attention_heads")
        kv_heads, head_dim = text.get("num_key_value_heads"), text.get("head_dim")
        if text.get("kv_lora_rank") and heads:
            kv_heads, head_dim = mla_drafter_heads(text)
        return cls(hidden_size=text["hidden_size"], vocab_size=text["vocab_size"], num_layers=text["num_hidden_layers"],
                   max_position_embeddings=text.get("max_position_embeddings") or 40960,
                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                   head_dim=head_dim or (text["hidden_size"] // heads if heads else None),
                   intermediate_size=text.get("intermediate_size"), rms_norm_eps=text.get("rms_norm_eps") or 1e-6,
                   rope_theta=float(theta) if theta else None, model_type=model_type)


MLA_DRAFTER_KV_HEADS = 8  # z-lab's Kimi-K2.5 drafter: 64 heads x 128, 8 KV heads


def mla_drafter_heads(text: dict) -> tuple[int, int]:
    """(KV heads, head dim) of the drafter of a multi-head latent attention target (DeepSeek-V3, Kimi K2 / K2.5).

    MLA has no per-head K/V width of its own: transformers sets ``head_dim`` to the rope part of a query head
    (``qk_rope_head_dim``, 64), and ``num_key_value_heads`` repeats the query heads (64 / 128). The drafter's heads
    take the width of the target's value heads (``v_head_dim``, 128) and 8 KV heads (grouped-query), as z-lab's
    Kimi-K2.5 drafter does (64 x 128, 8 KV heads); fewer query heads than 8 share them all.
    """
    heads = int(text["num_attention_heads"])
    head_dim = text.get("v_head_dim") or text.get("qk_nope_head_dim") or text["hidden_size"] // heads
    return math.gcd(heads, MLA_DRAFTER_KV_HEADS), int(head_dim)
