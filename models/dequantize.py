"""MLX affine-quantized checkpoints read in torch: ``mx.dequantize`` bit for bit, and the transformers model.

A drafter trained on a bf16 target loses acceptance on the 4-bit target people run on a Mac. To
train against the exact weights the Mac runs, a torch node reads the MLX folder itself:

- ``dequantize`` reproduces ``mx.dequantize`` bit for bit (affine mode, bits 2/3/4/5/6/8, any group
  size): ``w = q * scale + bias`` as two separately rounded operations in the compute dtype, which
  is how MLX evaluates it (checked bitwise for fp32, bf16 and fp16 in ``tests/models/test_quant.py``).
  Packing is a little-endian bit stream: every ``bits`` bytes hold 8 values, lowest bits first
  (for 2/4/8 bits that is the same as values packed into uint32 words).
- ``dequantized_model`` reads an mlx-community style folder (``*.weight`` packed uint32 + ``*.scales`` +
  ``*.biases``, ``config.json`` with ``quantization: {group_size, bits}`` and per-layer entries, some
  layers left unquantized), undoes mlx_lm's ``sanitize`` for the architecture (Qwen3.5 text-tower
  prefixes, ``1 + w`` norms and conv1d layout; MoE ``switch_mlp`` experts re-fused into
  transformers' ``experts.gate_up_proj`` / ``experts.down_proj``; gpt-oss's and Gemma 4's experts likewise) and
  builds the transformers model;
  ``models.target.load_mlx_target`` wraps it in a target adapter. Loading needs only torch,
  safetensors and transformers, no MLX.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.initialization import no_init_weights

from models.quantization import BITS, QuantizationError
from models.target_folder import check_supported, family_facts


# ----------------------------------------------------------------------------- dequantization
def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed uint32 (or int32) words ``[..., n * bits / 32]`` -> integer values ``[..., n]`` (int64)."""
    if bits not in BITS:
        raise QuantizationError(f"{bits}-bit packing is not an MLX affine width; use one of {list(BITS)}")
    if packed.dtype not in (torch.uint32, torch.int32):
        raise QuantizationError(f"packed weights must be uint32 words, got {packed.dtype}")
    lead = packed.shape[:-1]
    raw = packed.contiguous().view(torch.uint8)  # little-endian bytes of each word
    if raw.shape[-1] % bits:
        raise QuantizationError(f"packed row of {raw.shape[-1]} bytes is not a whole number of {bits}-bit packs")
    raw = raw.reshape(*lead, -1, bits).to(torch.int64)
    word = raw[..., 0].clone()
    for i in range(1, bits):  # every `bits` bytes hold 8 values (a 64-bit word is enough for 8 x 8 bits)
        word |= raw[..., i] << (8 * i)
    shifts = torch.arange(8, dtype=torch.int64, device=packed.device) * bits
    return ((word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*lead, -1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int, bits: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """``mx.dequantize(packed, scales, biases, group_size, bits)`` in torch, bit for bit.

    ``dtype`` (default: the scales' dtype) is the compute dtype: scales and biases are cast to it first,
    as an MLX model loaded in that dtype holds them.
    """
    dtype = dtype or scales.dtype
    n = packed.shape[-1] * 32 // bits
    if n != scales.shape[-1] * group_size or scales.shape != biases.shape or packed.shape[:-1] != scales.shape[:-1]:
        raise QuantizationError(f"packed weight {tuple(packed.shape)} holds {n} values per row, but scales "
                                f"{tuple(scales.shape)} / biases {tuple(biases.shape)} at group size {group_size} "
                                f"expect {scales.shape[-1] * group_size}: wrong bits ({bits}) or group size")
    lead = packed.shape[:-1]
    packed, scales, biases = packed.reshape(-1, packed.shape[-1]), scales.reshape(-1, scales.shape[-1]), \
        biases.reshape(-1, biases.shape[-1])
    out = torch.empty(packed.shape[0], n, dtype=dtype, device=packed.device)
    rows = max(1, (1 << 24) // max(n, 1))  # unpacking holds 8 bytes per value: ~128 MiB of rows at a time
    for r in range(0, packed.shape[0], rows):
        q = unpack(packed[r:r + rows], bits).reshape(-1, scales.shape[-1], group_size).to(dtype)
        # Two rounded ops (not an FMA): how mx.dequantize evaluates it, hence bitwise equal.
        w = torch.add(torch.mul(q, scales[r:r + rows].to(dtype).unsqueeze(-1)),
                      biases[r:r + rows].to(dtype).unsqueeze(-1))
        out[r:r + rows] = w.reshape(-1, n)
    return out.reshape(*lead, n)


# ----------------------------------------------------------------------------- reading an MLX folder
def layer_params(quantization: dict, path: str, packed_cols: int, scale_cols: int) -> tuple[int, int]:
    """(bits, group_size) of layer ``path``: its own entry in ``quantization``, else the default.

    The packed and scales widths must agree (``packed_cols * 32 == scale_cols * group * bits``),
    else the checkpoint or its config is wrong, which is said.
    """
    entry = quantization.get(path)
    if isinstance(entry, dict):
        bits = int(entry.get("bits", quantization["bits"]))
        group = int(entry.get("group_size", quantization["group_size"]))
        mode = entry.get("mode", "affine")
    else:
        bits, group = int(quantization["bits"]), int(quantization["group_size"])
        mode = quantization.get("mode", "affine")
    if mode != "affine":
        raise QuantizationError(f"{path}: quantization mode {mode!r} is not supported (only MLX 'affine')")
    if bits not in BITS:
        raise QuantizationError(f"{path}: {bits} bits is not an MLX affine width; use one of {list(BITS)}")
    if packed_cols * 32 != scale_cols * group * bits:
        raise QuantizationError(f"{path}: packed width {packed_cols} words and {scale_cols} scale groups do not fit "
                                f"{bits} bits at group size {group} (the row would be {scale_cols * group} values); "
                                "the config's quantization entry does not match the weights")
    return bits, group


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("model*.safetensors")) or sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}: an MLX target folder holds model*.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def dequantize_weights(weights: dict[str, torch.Tensor], config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every quantized ``X.weight`` (with ``X.scales`` / ``X.biases``) dequantized; the rest cast to ``dtype``."""
    quant = config.get("quantization") or {}
    out: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        if key.endswith((".scales", ".biases")):
            continue
        prefix = key.removesuffix(".weight")
        if key.endswith(".weight") and f"{prefix}.scales" in weights:
            if f"{prefix}.biases" not in weights:
                raise QuantizationError(f"{prefix}: has .scales but no .biases: only MLX affine checkpoints "
                                        "(weight + scales + biases) are supported")
            if not quant:
                raise QuantizationError(f"{prefix} is quantized but config.json has no 'quantization' entry")
            scales = weights[f"{prefix}.scales"]
            bits, group = layer_params(quant, prefix, value.shape[-1], scales.shape[-1])
            out[key] = dequantize(value, scales, weights[f"{prefix}.biases"], group, bits, dtype)
        elif value.dtype in (torch.uint32, torch.int32) and key.endswith(".weight"):
            raise QuantizationError(f"{key} is packed (uint32) but {prefix}.scales is missing from the checkpoint")
        else:
            out[key] = value.to(dtype) if value.is_floating_point() else value
    orphans = sorted(k for k in weights if k.endswith(".scales") and k[:-len(".scales")] + ".weight" not in weights)
    if orphans:
        raise QuantizationError(f"{orphans[0]} has no matching .weight in the checkpoint")
    return out


# ----------------------------------------------------------------------------- mlx_lm names -> transformers names
_QWEN35_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")


def to_hf_state_dict(weights: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """Undo mlx_lm's ``sanitize`` for one family, giving the transformers *module* names.

    Qwen3 / Llama / GLM 4.x MoE: same names. Qwen3.5 (``qwen3_5*``) and Qwen3-Next: drop the
    ``language_model.`` prefix (the text tower is built as a causal LM; Kimi K2.5's too), vision weights
    dropped, conv1d back to ``[C, 1, K]``, and the ``1 + w`` norms mlx_lm folded back to transformers' ``w``
    (mlx_lm adds 1 when it converts). MoE: ``mlp.switch_mlp.{gate,up,down}_proj.weight [E, out, in]`` ->
    ``mlp.experts.gate_up_proj`` (gate then up) and ``mlp.experts.down_proj``. Latent attention (DeepSeek-V3,
    Kimi): ``self_attn.embed_q`` / ``unembed_out`` joined back into ``kv_b_proj``.
    """
    facts = family_facts(check_supported(model_type))
    out: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        if key.startswith(("vision_tower", "model.visual", "mtp.")) or ".mtp." in key:
            continue
        if key.startswith("language_model."):
            key = key.removeprefix("language_model.")
        elif key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        out[key] = value
    if facts.linear_attention is not None:  # Qwen3.5 / 3.6 and Qwen3-Next: the same norms and conv layout
        sanitized = any(k.endswith("conv1d.weight") and v.shape[-1] == 1 for k, v in out.items())
        for key, value in list(out.items()):
            if key.endswith("conv1d.weight") and value.shape[-1] == 1:
                out[key] = value.transpose(1, 2).contiguous()
            elif sanitized and value.ndim == 1 and key.endswith(_QWEN35_NORMS):
                out[key] = value - 1.0
    for key in [k for k in out if k.endswith(".mlp.switch_mlp.gate_proj.weight")]:
        prefix = key.removesuffix(".switch_mlp.gate_proj.weight")
        gate = out.pop(key)
        up = out.pop(f"{prefix}.switch_mlp.up_proj.weight")
        out[f"{prefix}.experts.gate_up_proj"] = torch.cat([gate, up], dim=-2)
        out[f"{prefix}.experts.down_proj"] = out.pop(f"{prefix}.switch_mlp.down_proj.weight")
    if facts.latent_attention:
        for key in [k for k in out if k.endswith(".self_attn.embed_q.weight")]:
            out[key.replace("embed_q", "kv_b_proj")] = latent_up_projection(out.pop(key), out.pop(
                key.replace("embed_q", "unembed_out")))
    experts = FAMILY_EXPERTS.get(check_supported(model_type))
    if experts is not None:
        experts(out)
    return out


def latent_up_projection(embed_q: torch.Tensor, unembed_out: torch.Tensor) -> torch.Tensor:
    """transformers' ``kv_b_proj.weight`` ``[heads * (nope + v), kv_lora_rank]`` of a latent-attention layer from
    mlx_lm's two halves of it: ``embed_q`` ``[heads, kv_lora_rank, nope]`` (the key half, transposed, which mlx_lm
    applies to the queries) and ``unembed_out`` ``[heads, v, kv_lora_rank]`` (the value half)."""
    return torch.cat([embed_q.transpose(1, 2), unembed_out], dim=1).reshape(-1, embed_q.shape[1]).contiguous()


# --- gpt-oss and Gemma 4 (issue 46): their experts as mlx_lm stores them -> transformers' parameters
def _gpt_oss_experts(out: dict[str, torch.Tensor]) -> None:
    """``experts.{gate,up,down}_proj.{weight,bias}`` (weights [E, out, in]) -> transformers' ``experts.gate_up_proj``
    [E, H, 2I] with gate and up interleaved (gate at even columns), ``down_proj`` [E, I, H] and their ``_bias``."""
    for key in [k for k in out if k.endswith(".mlp.experts.gate_proj.weight")]:
        p = key.removesuffix(".gate_proj.weight")
        gate, up = out.pop(key), out.pop(f"{p}.up_proj.weight")
        e, i, h = gate.shape
        out[f"{p}.gate_up_proj"] = torch.stack([gate, up], dim=-2).reshape(e, 2 * i, h).transpose(-1, -2).contiguous()
        gb, ub = out.pop(f"{p}.gate_proj.bias"), out.pop(f"{p}.up_proj.bias")
        out[f"{p}.gate_up_proj_bias"] = torch.stack([gb, ub], dim=-1).reshape(e, 2 * i)
        out[f"{p}.down_proj"] = out.pop(f"{p}.down_proj.weight").transpose(-1, -2).contiguous()
        out[f"{p}.down_proj_bias"] = out.pop(f"{p}.down_proj.bias")


def _gemma4_experts(out: dict[str, torch.Tensor]) -> None:
    """``experts.switch_glu.{gate,up,down}_proj.weight`` -> ``experts.gate_up_proj`` (gate then up) and
    ``experts.down_proj``, the layout mlx_lm's Gemma 4 ``sanitize`` splits."""
    for key in [k for k in out if k.endswith(".experts.switch_glu.gate_proj.weight")]:
        p = key.removesuffix(".switch_glu.gate_proj.weight")
        out[f"{p}.gate_up_proj"] = torch.cat([out.pop(key), out.pop(f"{p}.switch_glu.up_proj.weight")], dim=-2)
        out[f"{p}.down_proj"] = out.pop(f"{p}.switch_glu.down_proj.weight")


FAMILY_EXPERTS = {}  # family -> rewrites its experts in place
FAMILY_EXPERTS.update({"gpt_oss": _gpt_oss_experts, "gemma4": _gemma4_experts})


def build_hf_model(config_dict: dict, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """The transformers causal LM (text tower) of ``config_dict`` holding ``state`` (no random init)."""
    clean = {k: v for k, v in config_dict.items() if k not in ("quantization", "quantization_config")}
    hf_config = AutoConfig.for_model(**clean)
    text_config = hf_config.get_text_config(decoder=True)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(text_config, dtype=dtype)
    expected = model.state_dict()
    if "lm_head.weight" in expected and "lm_head.weight" not in state:
        if not getattr(text_config, "tie_word_embeddings", False):
            raise QuantizationError("the checkpoint has no lm_head.weight and the config does not tie embeddings")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise QuantizationError(f"the MLX checkpoint does not map onto {type(model).__name__}: missing {missing[:4]}, "
                                f"unexpected {unexpected[:4]}")
    for key, ref in expected.items():
        value = state[key]
        if value.shape != ref.shape:
            raise QuantizationError(f"{key}: checkpoint shape {tuple(value.shape)} != model shape {tuple(ref.shape)}")
        state[key] = value.to(ref.dtype) if value.is_floating_point() else value
    model.load_state_dict(state, strict=True, assign=True)
    if getattr(text_config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


# ----------------------------------------------------------------------------- the folder as a model
def dequantized_model(directory: Path, config: dict, dtype: torch.dtype | None = None):
    """The transformers model of an MLX affine-quantized folder (its ``config.json`` read as ``config``), on
    dequantized weights. ``dtype`` defaults to the scales' dtype (bf16 for mlx-community repos)."""
    quant = config.get("quantization")
    if not (isinstance(quant, dict) and "bits" in quant and "group_size" in quant):
        raise QuantizationError(f"{directory}/config.json has no MLX 'quantization: {{bits, group_size}}': "
                                "not an MLX affine-quantized folder")
    weights = read_safetensors(directory)
    if dtype is None:
        scales = next((v for k, v in weights.items() if k.endswith(".scales")), None)
        dtype = scales.dtype if scales is not None else torch.float32
    state = to_hf_state_dict(dequantize_weights(weights, config, dtype), config["model_type"])
    return build_hf_model(config, state, dtype)
