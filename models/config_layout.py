"""The published drafter ``config.json``: reading its two layouts, writing the flat one, and what other modules
ask of a folder's ``config.json`` (is it a drafter's, is the drafter one level down, its quantization in words).

We read the z-lab "flat" layout (``block_size`` and ``rope_theta`` at top level) and the newer "nested" one
(``block_size`` only inside ``dflash_config``, ``rope_parameters`` only), and we always write the flat layout
with every resolved value, duplicated where engines disagree on where to look. ``models.config.DFlashConfig``
reads and writes through :func:`read_layout` and :func:`flat_layout` (its ``from_dict`` and ``to_dict``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.config_keys import (ARCHITECTURE, ARCHITECTURE2, ARCHITECTURES, DFLASH2_KEYS, DFLASH2_OPTIONAL,
                                MODELING_FILE, ConfigError, whole_number)
from models.rope import rope_scaling_of


def read_json_file(path: str | Path) -> Any:
    """A JSON file's content; a truncated or non-UTF-8 file is one line naming it (a bare json error said
    "Expecting value: line 6 column 23 (char 100)", no file)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def is_drafter_config(d: Any) -> bool:
    """A ``config.json`` of a DFlash drafter (our architecture name, or z-lab's nested ``dflash_config``)."""
    return isinstance(d, dict) and (bool(set(ARCHITECTURES.values()) & set(d.get("architectures") or []))
                                    or "dflash_config" in d)


def refuse_drafter_as_target(directory: str | Path, d: Any, flag: str = "--target") -> None:
    """A drafter folder given where a target belongs: its own layer count and tokenizer made the error
    further on misleading ("the target has 2 decoder layers", "no row has loss tokens")."""
    if is_drafter_config(d):
        raise ValueError(f"{flag} {directory} is a DFlash drafter ({Path(directory) / 'config.json'} names "
                         f"{ARCHITECTURE} / has dflash_config), not a target model: pass the target the drafter is "
                         "for (its folder or Hub id)")


def mlx_only(d: dict[str, Any]) -> dict[str, Any]:
    """The config of a folder only MLX reads (packed quantized weights): without ``auto_map``, so no
    transformers loader is pointed at a modeling file that cannot load it."""
    return {k: v for k, v in d.items() if k != "auto_map"}


def describe_quantization(q: dict[str, Any] | None) -> str | None:
    """A report's words for a config's ``quantization`` entry (``"4-bit affine, group 64"``, or a transformers
    ``quant_method``); None for full precision. ``inference.validate`` writes them, ``export.push`` compares."""
    if not q:
        return None
    if "bits" in q:
        return f"{q['bits']}-bit {q.get('mode', 'affine')}, group {q.get('group_size', '?')}"
    return str(q.get("quant_method") or json.dumps(q, sort_keys=True))


def drafter_inside_hint(folder: str | Path) -> str:
    """" (a training run or checkpoint folder: pass DIR/drafter)" when ``folder`` holds the drafter one level
    down: the run and checkpoint folders are what users pass by mistake (their config.json is the drafter's)."""
    folder = Path(folder)
    # a checkpoint's optimizer state (checkpoints/step_N/state) sits beside its drafter: step_N/drafter
    near = [folder / "drafter", folder / "final" / "drafter", folder.parent / "drafter"]
    inside = [d for d in near if d != folder and (d / "config.json").is_file()]
    return f" (a training run or checkpoint folder: pass {inside[0]})" if inside else ""


# ----------------------------------------------------------------------------- writing
def flat_layout(config) -> dict[str, Any]:
    """The flat z-lab layout of a ``models.config.DFlashConfig`` with every resolved value (what vLLM, SGLang,
    z-lab and MLX read): its ``to_dict``."""
    d: dict[str, Any] = {
        "architectures": [config.architecture],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": f"{MODELING_FILE}.{config.architecture}"},
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.use_sliding_window,
        "torch_dtype": config.torch_dtype,
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        # Plain full-head 1-D RoPE, whatever the target uses (never a Qwen3.5 mrope block); YaRN only when the
        # config carried it (a published gpt-oss drafter's).
        "rope_theta": config.rope_theta,
        "rope_parameters": ({"rope_type": "default", "rope_theta": config.rope_theta} if not config.rope_scaling
                            else {"rope_type": "yarn", "rope_theta": config.rope_theta, **config.rope_scaling}),
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
            "sliding_block_attention": config.sliding_block_attention,
        },
    }
    if config.variant == "dflash2":  # exactly the published dflash_config keys (always bidirectional: is_causal)
        nested = d["dflash_config"]
        del nested["sliding_block_attention"]
        nested.update({k: getattr(config, k) for k in DFLASH2_KEYS})
        nested.update({k: getattr(config, k) for k, default in DFLASH2_OPTIONAL.items()
                       if getattr(config, k) != default})
    if config.variant == "dflash" and config.final_logit_softcapping:
        d["final_logit_softcapping"] = config.final_logit_softcapping  # top level, as z-lab's Gemma 4 drafter
    if config.quantization:
        d["quantization"] = dict(config.quantization)
        d["quantization_config"] = dict(config.quantization)  # mlx-lm writes both, with the same value
    if config.draftsmith:
        d["draftsmith"] = dict(config.draftsmith)
    if config.use_sliding_window and config.sliding_block_attention == "bidirectional":
        # z-lab's modeling code makes sliding layers causal unless told otherwise.
        d["is_causal"] = False
    return d


# ----------------------------------------------------------------------------- reading
def _sliding_block_mode(d: dict[str, Any], nested: dict[str, Any], layer_types: list[str]) -> str:
    """Our explicit field if present; else z-lab's convention (sliding layers causal unless is_causal=false).
    ``is_causal: true`` is refused with or without sliding layers: runtimes that read it make full-attention
    layers causal inside the block, and running such a drafter bidirectionally would draft other tokens."""
    is_causal = d.get("is_causal")
    if is_causal:
        raise ConfigError("is_causal", is_causal, "makes every layer causal inside the block, full-attention "
                          "layers included, which draftsmith does not implement",
                          "set dflash_config.sliding_block_attention to 'causal' (sliding layers only) instead")
    if "sliding_block_attention" in nested:
        return nested["sliding_block_attention"]
    if "sliding_attention" not in layer_types:
        return "bidirectional"
    return "causal" if is_causal is None else "bidirectional"


def _variant(d: dict[str, Any], nested: dict[str, Any]) -> str:
    """"dflash2" for the DFlash2 architecture or its conv/selector keys (what SGLang switches on), else "dflash"."""
    names = d.get("architectures") or []
    keys = [k for k in DFLASH2_KEYS if k in nested or k in d]
    if ARCHITECTURE in names and keys:
        raise ConfigError("architectures", names, f"names {ARCHITECTURE} but the config has DFlash2's {keys}",
                          f"write architectures: [{ARCHITECTURE2!r}] (a DFlash2 drafter) or drop those keys")
    return "dflash2" if ARCHITECTURE2 in names or keys else "dflash"


def read_layout(d: dict[str, Any]) -> dict[str, Any]:
    """The ``models.config.DFlashConfig`` fields of a ``config.json`` in the flat or the nested layout (its
    ``from_dict``); the two must agree where both are present."""
    nested = d.get("dflash_config") or {}

    def pick(name: str, *sources: tuple[str, Any], required: bool = True) -> Any:
        found = [(where, v) for where, v in sources if v is not None]
        if not found:
            if not required:
                return None
            raise ConfigError(name, None, "missing from config.json",
                              f"add {name} (flat top level or inside dflash_config)")
        values = {json.dumps(v) for _, v in found}
        if len(values) > 1:
            raise ConfigError(name, dict(found), "given twice with different values",
                              "make both places agree")
        return found[0][1]

    rope_params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    other = d.get("rope_scaling") if d.get("rope_parameters") else None
    if other and other.get("rope_type", other.get("type", "default")) != rope_type:
        raise ConfigError("rope_scaling", other, f"says another RoPE than rope_parameters ({rope_type})",
                          "keep one rope block, or make both agree")
    try:
        rope_scaling = rope_scaling_of(rope_params)
    except ValueError as e:
        raise ConfigError("rope_parameters.rope_type", rope_type,
                          f"{e}: draftsmith's drafters run plain full-head RoPE or the YaRN block z-lab's "
                          "gpt-oss drafters publish",
                          "write rope_parameters={'rope_type': 'default', 'rope_theta': ...}") from None
    rope_theta = pick("rope_theta", ("rope_theta", d.get("rope_theta")),
                      ("rope_parameters.rope_theta", rope_params.get("rope_theta")))
    block_size = pick("block_size", ("block_size", d.get("block_size")),
                      ("dflash_config.block_size", nested.get("block_size")))
    mask_token_id = pick("mask_token_id", ("dflash_config.mask_token_id", nested.get("mask_token_id")),
                         ("mask_token_id", d.get("mask_token_id")))
    layer_ids = pick("target_layer_ids", ("dflash_config.target_layer_ids", nested.get("target_layer_ids")),
                     ("target_layer_ids", d.get("target_layer_ids")))
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if d.get(name) is None:  # read as d[name] below: a KeyError traceback in every loader
            raise ConfigError(name, None, "missing from config.json",
                              f"add the drafter's {name} at the top level (or export the drafter again)")
    num_layers = d.get("num_hidden_layers")
    layer_types = d.get("layer_types") or []
    head_dim = d.get("head_dim") or (d["hidden_size"] // d["num_attention_heads"])
    num_target_layers = d.get("num_target_layers")
    if num_target_layers is None:
        raise ConfigError("num_target_layers", None, "missing from config.json",
                          "add the target's decoder layer count (SGLang needs it too)")
    variant = _variant(d, nested)
    dflash2 = {}
    if variant == "dflash2":
        if d.get("is_causal") is not False:  # absent: z-lab's code makes the sliding layers causal
            raise ConfigError("is_causal", d.get("is_causal"), "a DFlash2 drafter attends to its whole block, so "
                              "config.json must say is_causal: false (absent or true makes its layers causal)",
                              "write is_causal: false at the top level of config.json")
        # z-lab's lookup: dflash_config first, then the top level (speculators' flat configs)
        for name in (*DFLASH2_KEYS, *DFLASH2_OPTIONAL):
            value = pick(name, (f"dflash_config.{name}", nested.get(name)), (name, d.get(name)),
                         required=name in DFLASH2_KEYS)
            dflash2[name] = whole_number(name, value) if name in DFLASH2_KEYS else value
        if not dflash2["final_logit_softcapping"]:  # 0 means off, as in z-lab's code
            dflash2["final_logit_softcapping"] = None
    else:  # a v1 drafter's logit soft-cap (z-lab's Gemma 4 drafter: top level); 0 means off
        cap = pick("final_logit_softcapping", ("dflash_config.final_logit_softcapping",
                                               nested.get("final_logit_softcapping")),
                   ("final_logit_softcapping", d.get("final_logit_softcapping")), required=False)
        dflash2["final_logit_softcapping"] = cap or None
    slides = d.get("use_sliding_window") or "sliding_attention" in layer_types
    sliding = d.get("sliding_window") if slides else None
    if d.get("use_sliding_window") and not layer_types:
        raise ConfigError("layer_types", None,
                          "use_sliding_window is true but no layer_types say which layers slide",
                          "list layer_types explicitly")
    return dict(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=head_dim,
        vocab_size=d["vocab_size"],
        num_target_layers=num_target_layers,
        target_layer_ids=list(layer_ids),
        mask_token_id=whole_number("mask_token_id", mask_token_id),
        block_size=whole_number("block_size", block_size),
        max_position_embeddings=d.get("max_position_embeddings", 40960),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        layer_types=list(layer_types),
        sliding_window=sliding,
        sliding_block_attention=_sliding_block_mode(d, nested, layer_types),
        torch_dtype=d.get("torch_dtype") or d.get("dtype") or "bfloat16",
        quantization=d.get("quantization") or None,
        draftsmith=d.get("draftsmith") or None,
        variant=variant,
        rope_scaling=rope_scaling,
        attention_bias=bool(d.get("attention_bias") or False),
        **dflash2,
    )
