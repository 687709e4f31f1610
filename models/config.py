"""The one canonical DFlash drafter config: ``DFlashConfig``, its checks, its shape and size.

Every key of a drafter ``config.json`` is spelled here and in the two modules beside it, nowhere else: the
names and the error (``models/config_keys.py``) and the published layouts, read and written
(``models/config_layout.py``). The file is written as JSON from this dataclass, never through a transformers
config object (transformers 5 drops top-level keys that the MLX loaders need). The target facts a drafter's
shape comes from: ``models/target_shape.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from models.config_keys import (ARCHITECTURE, ARCHITECTURES, DFLASH2_KEYS, DFLASH2_OPTIONAL, DFLASH2_WINDOW,
                                LAYER_TYPES, SLIDING_BLOCK_MODES, ConfigError, whole_number)
from models.config_layout import drafter_inside_hint, flat_layout, read_layout
from models.rope import rope_scaling_of
from models.target_shape import TargetShape


def default_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """Taps spread evenly from layer 1 to layer L-3: ``round(1 + i (L-4) / (n-1))``.

    36 layers, 5 taps -> [1, 9, 17, 25, 33]; 32 layers -> [1, 8, 15, 22, 29]. The last layer is
    never tapped (several engines cannot capture it).
    """
    L, n = num_target_layers, num_taps
    if n < 1:
        raise ConfigError("num_taps", n, "at least one target layer must be tapped", "use num_taps >= 1 (default 5)")
    if n == 1:
        return [L // 2]
    if L < n + 3:
        raise ConfigError(
            "num_target_layers", L, f"too few target layers for {n} distinct taps in [1, L-3]",
            f"use fewer taps (at most {max(L - 3, 1)}) or pass target_layer_ids explicitly",
        )
    # Python's round() (halves to even) on this exact float expression, as the reference trainer and the
    # serving engines compute their defaults: a half-up rule taps another layer at depths such as 30 or 35.
    return [int(round(1 + (i * (L - 4)) / (n - 1))) for i in range(n)]


LAYER_ORDER_FIX = ("list them in ascending order (a drafter trained with another order has fc's input blocks in that "
                   "order: retrain it with sorted ids)")


def layer_order_problem(layer_ids: Iterable[int]) -> str | None:
    """Why tapped layer ids in this order are refused (None: strictly increasing). Every engine (vLLM, SGLang, the
    MLX loaders) concatenates the features in ascending layer order, so a drafter whose ``fc`` saw them in another
    order gets permuted inputs there: the ids are strictly increasing everywhere (config, recipe, export)."""
    ids = list(layer_ids)
    if all(a < b for a, b in zip(ids, ids[1:])):
        return None
    return (f"layer ids must be strictly increasing (engines concatenate the features in ascending layer order, "
            f"{sorted(set(ids))})")


@dataclass
class DFlashConfig:
    """Resolved drafter config. Field names are the flat ``config.json`` names."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    # In-block semantics of sliding layers: runtimes disagree, so it is one explicit field.
    sliding_block_attention: str = "bidirectional"
    torch_dtype: str = "bfloat16"
    # MLX affine quantization of the drafter's linears ({bits, group_size, mode}); None = not quantized.
    quantization: dict[str, Any] | None = None
    # Provenance of an export (target id/revision/quantization, recipe, steps, data); engines ignore it.
    draftsmith: dict[str, Any] | None = None
    # The drafter generation: "dflash" (v1) or "dflash2". The fields below are DFlash2's (None on a v1 drafter):
    # conv taps K and group size G of the per-layer dynamic convs, rank r and candidates K of the selector,
    # and the optional logit multiplier, logit soft-cap and block-embedding scale.
    variant: str = "dflash"
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    # A YaRN block ({factor, original_max_position_embeddings, beta_fast, ...}) when the config carries one (z-lab's
    # published gpt-oss drafters copy their target's); None = plain RoPE, what draftsmith trains. A v1 drafter may
    # soft-cap its logits too (``final_logit_softcapping``, z-lab's Gemma 4 drafter: 30).
    rope_scaling: dict[str, Any] | None = None
    # Biases on q/k/v/o (Qwen3's ``attention_bias``): z-lab's published gpt-oss drafters have them; draftsmith trains
    # without.
    attention_bias: bool = False

    def __post_init__(self) -> None:
        self.target_layer_ids = [whole_number("target_layer_ids", i) for i in self.target_layer_ids]
        if self.variant == "dflash2":  # the published layout: every layer sliding, a 2048 window
            for name, default in {**DFLASH2_KEYS, **DFLASH2_OPTIONAL}.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)
            if not self.layer_types:
                self.layer_types = ["sliding_attention"] * self.num_hidden_layers
            if self.sliding_window is None:
                self.sliding_window = DFLASH2_WINDOW
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_taps * self.hidden_size

    @property
    def use_sliding_window(self) -> bool:
        return "sliding_attention" in self.layer_types

    @property
    def architecture(self) -> str:
        return ARCHITECTURES.get(self.variant, ARCHITECTURE)

    @property
    def conv_groups(self) -> int:
        """DFlash2: channel groups of a dynamic conv (H / G), one dynamic coefficient per group and tap."""
        return self.hidden_size // self.conv_group_size

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Checks that need only the config itself."""
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(name, v, "must be a positive integer", f"set {name} to a positive integer")
        if not self.rms_norm_eps > 0:  # 0 divides by zero on an all-zero row (the padded slots of a block)
            raise ConfigError("rms_norm_eps", self.rms_norm_eps, "must be positive",
                              "use the target's rms_norm_eps (e.g. 1e-6)")
        if self.head_dim % 2:
            raise ConfigError("head_dim", self.head_dim, "must be even (RoPE rotates pairs of dimensions)",
                              "use an even head_dim (the target's, e.g. 128)")
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ConfigError("rope_theta", self.rope_theta, "must be a positive RoPE base frequency",
                              "use the target's rope_theta (e.g. 1000000)")
        if self.rope_scaling is not None:
            try:
                self.rope_scaling = rope_scaling_of({**self.rope_scaling, "rope_type": "yarn"})
            except ValueError as e:
                raise ConfigError("rope_scaling", self.rope_scaling, str(e),
                                  "give factor and original_max_position_embeddings (YaRN), or no rope_scaling "
                                  "(plain RoPE)") from None
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "num_key_value_heads", self.num_key_value_heads,
                f"must divide num_attention_heads={self.num_attention_heads} (grouped-query attention)",
                "choose a divisor of num_attention_heads",
            )
        if self.block_size < 2:
            raise ConfigError("block_size", self.block_size, "a block needs the bonus token and at least one mask",
                              "use block_size >= 2 (default 16)")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids", self.target_layer_ids, "no target layer is tapped",
                              f"use default_layer_ids({self.num_target_layers})")
        last = self.num_target_layers - 1
        for i in self.target_layer_ids:
            if not 0 <= i < last:
                taps = min(self.num_taps, max(self.num_target_layers - 3, 1))
                raise ConfigError(
                    "target_layer_ids", self.target_layer_ids,
                    f"layer id {i} is outside [0, {last}) for a target with {self.num_target_layers} layers "
                    "(the last layer cannot be tapped: capture breaks in vLLM and SGLang)",
                    f"use ids in 0..{last - 1}, e.g. {default_layer_ids(self.num_target_layers, taps)}",
                )
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ConfigError("target_layer_ids", self.target_layer_ids, "a layer is tapped twice",
                              "list each layer id once")
        if problem := layer_order_problem(self.target_layer_ids):
            raise ConfigError("target_layer_ids", self.target_layer_ids, problem, LAYER_ORDER_FIX)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError("mask_token_id", self.mask_token_id,
                              f"outside the target embedding (vocab_size={self.vocab_size})",
                              "pick a spare embedding row (models.mask_token.choose_mask_token)")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError("layer_types", self.layer_types,
                              f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
                              "give one entry per drafter layer")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ConfigError("layer_types", self.layer_types, f"unknown layer type {t!r}",
                                  f"use one of {LAYER_TYPES}")
        if self.use_sliding_window and not (self.sliding_window and self.sliding_window > 0):
            raise ConfigError("sliding_window", self.sliding_window,
                              "sliding_attention layers are configured but the window is not a positive integer",
                              "set sliding_window (tokens) or make every layer full_attention")
        q = self.quantization
        if q is not None:
            if not isinstance(q, dict) or q.get("bits") not in (2, 3, 4, 5, 6, 8) or \
                    q.get("group_size") not in (32, 64, 128) or q.get("mode", "affine") != "affine":
                raise ConfigError("quantization", q, "must be MLX affine quantization {bits, group_size[, mode]}",
                                  "use bits 4 or 8 and group_size 32, 64 or 128 (mode 'affine'); re-export the drafter")
            self.quantization = {"bits": int(q["bits"]), "group_size": int(q["group_size"]), "mode": "affine"}
        if self.sliding_block_attention not in SLIDING_BLOCK_MODES:
            raise ConfigError("sliding_block_attention", self.sliding_block_attention,
                              "unknown in-block semantics for sliding layers", f"use one of {SLIDING_BLOCK_MODES}")
        if self.variant not in ARCHITECTURES:
            raise ConfigError("variant", self.variant, "unknown drafter generation",
                              f"use one of {tuple(ARCHITECTURES)}")
        if self.variant == "dflash2":
            self._validate_dflash2()
        else:
            cap = self.final_logit_softcapping  # the one DFlash2 field a v1 drafter may have (Gemma 4's)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                    or not (math.isfinite(cap) and cap > 0)):
                raise ConfigError("final_logit_softcapping", cap, "must be a positive number",
                                  "leave it out (no soft-capping) or give the cap, e.g. 30.0")
            stray = [n for n in (*DFLASH2_KEYS, *DFLASH2_OPTIONAL) if getattr(self, n) is not None
                     and n != "final_logit_softcapping"]
            if stray:
                raise ConfigError(stray[0], getattr(self, stray[0]), "is a DFlash2 setting on a variant dflash drafter",
                                  "set variant=dflash2, or leave it out")

    def _validate_dflash2(self) -> None:
        """DFlash2's keys, checked together with the shape they depend on, before any weight is read."""
        for name in DFLASH2_KEYS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(name, v, "must be a positive integer", f"use {DFLASH2_KEYS[name]} (z-lab's value)")
        H, G = self.hidden_size, self.conv_group_size
        if H % G:
            fits = max(g for g in range(1, min(G, H) + 1) if H % g == 0)
            raise ConfigError("conv_group_size", G, f"must divide hidden_size={H} (the dynamic convs share one "
                              "coefficient per group of conv_group_size channels)",
                              f"use a divisor of {H}, e.g. {fits}")
        if self.conv_kernel_size > self.block_size:
            raise ConfigError("conv_kernel_size", self.conv_kernel_size,
                              f"reaches past the block ({self.block_size} slots): the convs never cross a "
                              "block's start",
                              "use at most block_size taps (default 2)")
        if self.selector_top_k > self.vocab_size:
            raise ConfigError("selector_top_k", self.selector_top_k, f"is more than the {self.vocab_size} tokens",
                              "use fewer candidates (default 16)")
        for name in DFLASH2_OPTIONAL:
            v = getattr(self, name)
            if v is None and name == "final_logit_softcapping":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ConfigError(name, v, "must be a positive number", f"leave {name} out (default "
                                  f"{DFLASH2_OPTIONAL[name] if DFLASH2_OPTIONAL[name] is not None else 'off'})")
            setattr(self, name, float(v))
        if any(t != "sliding_attention" for t in self.layer_types):
            raise ConfigError("layer_types", self.layer_types, "a DFlash2 drafter has sliding_attention in every layer "
                              "(the layout vLLM, SGLang and z-lab's code load)",
                              f"write layer_types as sliding_attention for each layer, with sliding_window "
                              f"{DFLASH2_WINDOW}")
        if self.sliding_block_attention != "bidirectional":
            raise ConfigError("is_causal", True, "a DFlash2 drafter attends to its whole block",
                              "write is_causal: false at the top level of config.json")
        if self.sliding_window < self.block_size:  # engines disagree on a window inside the block
            raise ConfigError("sliding_window", self.sliding_window, f"is smaller than the block ({self.block_size})",
                              f"use a window of at least block_size (published drafters: {DFLASH2_WINDOW})")

    def check_target(self, *, hidden_size: int, vocab_size: int, num_layers: int,
                     emitted_ids: Iterable[int] | None = None) -> None:
        """Checks that need the target: a drafter only works with the target it was trained for."""
        if self.hidden_size != hidden_size:
            raise ConfigError("hidden_size", self.hidden_size,
                              f"the target's hidden size is {hidden_size}; the drafter must match it",
                              "use a drafter trained for this target (or set hidden_size to the target's)")
        if self.vocab_size != vocab_size:
            raise ConfigError("vocab_size", self.vocab_size,
                              f"the target's embedding has {vocab_size} rows; the drafter must match it",
                              "use a drafter trained for this target")
        if self.num_target_layers != num_layers:
            raise ConfigError("num_target_layers", self.num_target_layers,
                              f"the target has {num_layers} decoder layers",
                              "use a drafter trained for this target")
        if emitted_ids is not None and self.mask_token_id in set(emitted_ids):
            raise ConfigError("mask_token_id", self.mask_token_id,
                              "is a token the target's tokenizer emits, so drafts would confuse it with real text",
                              "pick a spare embedding row (models.mask_token.choose_mask_token)")

    # ------------------------------------------------------------------ writing
    def to_dict(self) -> dict[str, Any]:
        """The flat z-lab layout with every resolved value (what vLLM, SGLang, z-lab and MLX read):
        ``models.config_layout.flat_layout``."""
        return flat_layout(self)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        """Read the flat or the nested layout; the two must agree where both are present
        (``models.config_layout.read_layout``)."""
        return cls(**read_layout(d))

    @classmethod
    def load(cls, directory: str | Path) -> "DFlashConfig":
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a drafter folder needs config.json next to its safetensors"
                                    f"{drafter_inside_hint(path.parent)}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError("config.json", str(path), f"is not valid JSON ({e})", "re-export the drafter") from None
        return cls.from_dict(d)

    def replace(self, **changes: Any) -> "DFlashConfig":
        d = asdict(self)
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigError(sorted(unknown)[0], None, "not a drafter config field",
                              f"use one of {[f.name for f in fields(self)]}")
        d.update(changes)
        return DFlashConfig(**d)

    def as_variant(self, variant: str) -> "DFlashConfig":
        """The same backbone as another generation: DFlash2's fields at their defaults for "dflash2" (sliding
        layers, window 2048: the published layout), cleared for "dflash" (its layer kinds kept)."""
        if variant == self.variant:
            return self.replace()
        if variant == "dflash2":
            return self.replace(variant=variant, layer_types=[], sliding_window=None,
                                sliding_block_attention="bidirectional")
        return self.replace(variant=variant, **{k: None for k in (*DFLASH2_KEYS, *DFLASH2_OPTIONAL)})

    @classmethod
    def for_target(cls, target: TargetShape | None = None, /, *, mask_token_id: int, num_hidden_layers: int = 5,
                   num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                   head_dim: int | None = None, intermediate_size: int | None = None,
                   target_layer_ids: list[int] | None = None, num_taps: int = 5, rope_theta: float | None = None,
                   rms_norm_eps: float | None = None, hidden_size: int | None = None, vocab_size: int | None = None,
                   num_target_layers: int | None = None, max_position_embeddings: int | None = None,
                   **kw: Any) -> "DFlashConfig":
        """The one resolver of a drafter's shape: training, the dry-run plan and the benches call it.

        Hidden size, vocabulary, layer count and positions come from the target; heads, KV heads,
        head dim, MLP width, norm eps and the RoPE base default to the target's own (``target``), and
        any keyword overrides them. Without a ``target`` the target facts must be given as keywords
        and the attention shape defaults to 128-wide heads.
        """
        t = target
        # ``is not None`` throughout, never ``or``: an explicit 0 (or []) is the caller's value and is refused by
        # ``validate``, not silently replaced by the target's.
        pick = lambda given, *fallbacks: next((v for v in (given, *fallbacks) if v is not None), None)  # noqa: E731

        def fact(name: str, given: Any, attr: str) -> Any:
            value = given if given is not None else (getattr(t, attr) if t is not None else None)
            if value is None:
                raise ConfigError(name, None, "unknown: neither the target shape nor an override gives it",
                                  f"pass {name} or a TargetShape")
            return value

        hidden = fact("hidden_size", hidden_size, "hidden_size")
        heads = pick(num_attention_heads, t.num_attention_heads if t else None)
        head_dim = pick(head_dim, t.head_dim if t else None, hidden // heads if heads else 128)
        heads = pick(heads, max(hidden // head_dim, 1) if head_dim else 1)  # head_dim 0: validate names it
        layers = fact("num_target_layers", num_target_layers, "num_layers")
        return cls(
            hidden_size=hidden, vocab_size=fact("vocab_size", vocab_size, "vocab_size"), num_target_layers=layers,
            max_position_embeddings=pick(max_position_embeddings, t.max_position_embeddings if t else None, 40960),
            mask_token_id=mask_token_id, num_hidden_layers=num_hidden_layers, num_attention_heads=heads,
            num_key_value_heads=pick(num_key_value_heads, t.num_key_value_heads if t else None, heads),
            head_dim=head_dim,
            intermediate_size=pick(intermediate_size, t.intermediate_size if t else None, 3 * hidden),
            rms_norm_eps=pick(rms_norm_eps, t.rms_norm_eps if t else None, 1e-6),
            # The target's own base frequency, as SpecForge and z-lab's published drafters do.
            rope_theta=float(pick(rope_theta, t.rope_theta if t else None, 1_000_000.0)),
            target_layer_ids=(default_layer_ids(layers, num_taps) if target_layer_ids is None  # only when needed:
                              else target_layer_ids), **kw,  # it refuses a target too shallow for num_taps
        )

    # ------------------------------------------------------------------ size
    def parameter_counts(self) -> dict[str, int]:
        """Trained parameters by part: ``backbone`` (fc, hidden_norm, layers, norm), and for DFlash2 ``convs`` (two
        per layer, each ``base_kernel`` [2, K, H] + ``kernel_projection`` [2 K H / G, H]) and ``selector`` (two
        [V, r] codebooks + ``hidden_projection`` [r, H]). The target's embedding and LM head are borrowed."""
        H, hd = self.hidden_size, self.head_dim
        attn = H * hd * (self.num_attention_heads + 2 * self.num_key_value_heads) + self.num_attention_heads * hd * H
        if self.attention_bias:
            attn += hd * (self.num_attention_heads + 2 * self.num_key_value_heads) + H
        per_layer = attn + 3 * H * self.intermediate_size + 2 * H + 2 * hd
        counts = {"backbone": self.num_hidden_layers * per_layer + self.fc_in_features * H + 2 * H}
        if self.variant == "dflash2":
            K, r = self.conv_kernel_size, self.selector_rank
            counts["convs"] = self.num_hidden_layers * 2 * (2 * K * H + 2 * K * self.conv_groups * H)
            counts["selector"] = 2 * self.vocab_size * r + r * H
        counts["total"] = sum(counts.values())
        return counts

    def num_parameters(self) -> int:
        """Trained parameters (every part of :meth:`parameter_counts`)."""
        return self.parameter_counts()["total"]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the drafter's folder, by its published name, with its shape (the layout vLLM, SGLang and
        z-lab's code read). DFlash2's codebooks have no ``.weight``; nothing of the target is stored."""
        H, hd, heads, kv, inter = (self.hidden_size, self.head_dim, self.num_attention_heads,
                                   self.num_key_value_heads, self.intermediate_size)
        shapes = {"fc.weight": (H, self.fc_in_features), "hidden_norm.weight": (H,), "norm.weight": (H,)}
        for i in range(self.num_hidden_layers):
            p = f"layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (heads * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                p + "mlp.down_proj.weight": (H, inter)})
            if self.attention_bias:
                shapes.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                               p + "self_attn.v_proj.bias": (kv * hd,), p + "self_attn.o_proj.bias": (H,)})
            if self.variant == "dflash2":
                for conv in ("attention_conv", "mlp_conv"):
                    shapes[f"{p}{conv}.base_kernel"] = (2, self.conv_kernel_size, H)
                    shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * self.conv_kernel_size * self.conv_groups, H)
        if self.variant == "dflash2":
            r = self.selector_rank
            shapes.update({"candidate_selector.hidden_projection.weight": (r, H),
                           "candidate_selector.predecessor_codebook": (self.vocab_size, r),
                           "candidate_selector.successor_codebook": (self.vocab_size, r)})
        return shapes

    def flops_per_token(self, context: float, lm_head: bool = True) -> float:
        """Forward FLOPs (2 x MACs) per block token, attending to ``context`` keys; LM head included by default.

        DFlash2 adds per layer two convs (the coefficient projection, 2 H x 2 K H / G, and the K-tap product on
        both sides of the sublayer) and, with the LM head, the selector (``hidden_projection`` and K candidate
        scores of rank r)."""
        H, hd = self.hidden_size, self.head_dim
        proj = H * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        per_layer = 2 * (proj + 3 * H * self.intermediate_size) + 2 * 2 * self.num_attention_heads * hd * context
        head = 2 * H * self.vocab_size
        if self.variant == "dflash2":
            K, r = self.conv_kernel_size, self.selector_rank
            per_layer += 2 * (2 * H * 2 * K * self.conv_groups + 2 * 2 * K * H)
            head += 2 * H * r + 3 * self.selector_top_k * r
        return self.num_hidden_layers * per_layer + (head if lm_head else 0)
