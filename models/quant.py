"""Quantized targets: MLX affine checkpoints dequantized in torch, bf16 targets quantized as mlx_lm does.

A drafter trained on a bf16 target loses acceptance on the 4-bit target people run on a Mac. To
train against the exact weights the Mac runs, a torch node reads the MLX folder itself:

- ``dequantize`` reproduces ``mx.dequantize`` bit for bit (affine mode, bits 2/3/4/5/6/8, any group
  size): ``w = q * scale + bias`` as two separately rounded operations in the compute dtype, which
  is how MLX evaluates it (checked bitwise for fp32, bf16 and fp16 in ``tests/test_quant.py``).
  Packing is a little-endian bit stream: every ``bits`` bytes hold 8 values, lowest bits first
  (for 2/4/8 bits that is the same as values packed into uint32 words).
- ``load_mlx_target`` reads an mlx-community style folder (``*.weight`` packed uint32 + ``*.scales`` +
  ``*.biases``, ``config.json`` with ``quantization: {group_size, bits}`` and per-layer entries, some
  layers left unquantized), undoes mlx_lm's ``sanitize`` for the architecture (Qwen3.5 text-tower
  prefixes, ``1 + w`` norms and conv1d layout; MoE ``switch_mlp`` experts re-fused into
  transformers' ``experts.gate_up_proj`` / ``experts.down_proj``) and builds the transformers model.
- ``quantize_to_mlx`` writes such a folder from a bf16 HF target with mlx_lm's own functions
  (``load`` -> the dtype cast of ``mlx_lm.convert`` -> ``quantize_model`` -> ``save``), so the layers
  skipped and the bit widths per layer are the ones ``mlx_lm.convert -q`` picks. It needs ``mlx``
  (``pip install "mlx[cpu]" mlx-lm`` on Linux); loading needs only torch and safetensors.

``target.quantization`` values (``parse_quantization``): ``none``, ``mlx:PATH_OR_ID`` (an existing
MLX folder or Hub repo), ``mlx-3bit`` / ``mlx-4bit`` / ``mlx-8bit`` (quantize the bf16 target here,
group size 64 as mlx_lm's default; ``mlx-4bit-g32`` picks another group size), ``bnb-4bit`` and
``fp8`` (transformers' bitsandbytes / FP8 loaders, where installed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from models.support import UserError

BITS = (2, 3, 4, 5, 6, 8)  # affine widths MLX packs
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64  # mlx_lm.convert's default for affine
QUANT_MARKER = "draftsmith_quant.json"  # written next to a folder quantize_to_mlx made (the cache key)


class QuantizationError(UserError, ValueError):
    """A quantization value, checkpoint or layer that cannot be used as asked."""


# ----------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class QuantSpec:
    kind: str  # none | mlx | bnb | fp8
    bits: int | None = None
    group_size: int | None = None
    path: str | None = None  # mlx:PATH_OR_ID

    def describe(self) -> str:
        """What a checkpoint records as ``trained against``."""
        if self.kind == "none":
            return "none"
        if self.kind == "mlx" and self.path:
            return f"mlx:{self.path}"
        if self.kind == "mlx":
            return f"mlx-{self.bits}bit-g{self.group_size}"
        return {"bnb": "bnb-4bit", "fp8": "fp8"}[self.kind]


_MLX_BITS = re.compile(r"^mlx-(\d+)bit(?:-g(\d+))?$")
VALUES = "none | mlx:PATH_OR_ID | mlx-3bit | mlx-4bit | mlx-8bit (optionally -g32/-g64/-g128) | bnb-4bit | fp8"


def parse_quantization(value: str | None) -> QuantSpec:
    """``target.quantization`` -> ``QuantSpec``; a clear error for anything else."""
    text = "none" if value in (None, "", False) else str(value).strip()
    if text == "none":
        return QuantSpec("none")
    if text.startswith("mlx:"):
        path = text[4:].strip()
        if not path:
            raise QuantizationError("target.quantization=mlx: needs a folder or Hub id after 'mlx:' "
                                    "(e.g. mlx:mlx-community/Qwen3-4B-4bit)")
        return QuantSpec("mlx", path=path)
    m = _MLX_BITS.match(text)
    if m:
        bits, group = int(m.group(1)), int(m.group(2) or DEFAULT_GROUP_SIZE)
        check_bits_group(bits, group, what=f"target.quantization={text}")
        return QuantSpec("mlx", bits=bits, group_size=group)
    if text == "bnb-4bit":
        return QuantSpec("bnb", bits=4)
    if text == "fp8":
        return QuantSpec("fp8", bits=8)
    raise QuantizationError(f"target.quantization={text!r} is not a quantization draftsmith knows: use {VALUES}")


def check_bits_group(bits: int, group_size: int, what: str = "quantization") -> None:
    if bits not in BITS:
        raise QuantizationError(f"{what}: {bits} bits is not an MLX affine width; use one of {list(BITS)}")
    if group_size not in GROUP_SIZES:
        raise QuantizationError(f"{what}: group size {group_size} is not supported; use one of {list(GROUP_SIZES)}")


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
def is_mlx_quantized(directory: str | Path) -> bool:
    """A folder whose config.json carries MLX affine ``quantization: {bits, group_size}``."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        return False
    q = json.loads(config_path.read_text()).get("quantization")
    return isinstance(q, dict) and "bits" in q and "group_size" in q


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
    from safetensors.torch import load_file

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

    Qwen3 / Llama: same names. Qwen3.5 (``qwen3_5*``): drop the ``language_model.`` prefix (the text
    tower is built as a causal LM), vision weights dropped, conv1d back to ``[C, 1, K]``, and the
    ``1 + w`` norms mlx_lm folded back to transformers' ``w`` (mlx_lm adds 1 when it converts).
    MoE: ``mlp.switch_mlp.{gate,up,down}_proj.weight [E, out, in]`` -> ``mlp.experts.gate_up_proj``
    (gate then up) and ``mlp.experts.down_proj``.
    """
    from models.target import check_supported

    family = check_supported(model_type)
    out: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        if key.startswith(("vision_tower", "model.visual", "mtp.")) or ".mtp." in key:
            continue
        if key.startswith("language_model."):
            key = key.removeprefix("language_model.")
        elif key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        out[key] = value
    if family == "qwen3_5":
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
    return out


def build_hf_model(config_dict: dict, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """The transformers causal LM (text tower) of ``config_dict`` holding ``state`` (no random init)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

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


def load_mlx_target(path_or_id: str | Path, dtype: torch.dtype | None = None, device=None, revision: str | None = None):
    """An MLX affine-quantized folder or Hub repo -> a ``models.target.TargetModel`` on dequantized weights.

    ``dtype`` defaults to the scales' dtype (bf16 for mlx-community repos). The adapter's
    ``quantization`` attribute says what it was loaded from.
    """
    from models.target import TargetModel, read_target_config

    directory, config = read_target_config(path_or_id, revision, what="quantized target")
    model_type = config["model_type"]
    quant = config.get("quantization")
    if not (isinstance(quant, dict) and "bits" in quant and "group_size" in quant):
        raise QuantizationError(f"{directory}/config.json has no MLX 'quantization: {{bits, group_size}}': "
                                "not an MLX affine-quantized folder")
    weights = read_safetensors(directory)
    if dtype is None:
        scales = next((v for k, v in weights.items() if k.endswith(".scales")), None)
        dtype = scales.dtype if scales is not None else torch.float32
    state = to_hf_state_dict(dequantize_weights(weights, config, dtype), model_type)
    model = build_hf_model(config, state, dtype)
    if device is not None:
        model = model.to(device)
    tokenizer = None
    if any(directory.glob("tokenizer*")):
        from models.target import load_tokenizer

        tokenizer = load_tokenizer(directory)
    target = TargetModel(model, tokenizer=tokenizer, name=str(path_or_id))
    target.quantization = describe_mlx(config)
    return target


def describe_mlx(config: dict) -> str:
    q = config.get("quantization") or {}
    return f"mlx-{q.get('bits')}bit-g{q.get('group_size')}"


# ----------------------------------------------------------------------------- quantizing with mlx_lm
def weights_digest(folder: Path) -> str:
    """A hash of the folder's weight files: names, sizes, first and last MiB (``models.hub.weight_file_spans``).
    Part of the quantized folder's cache key: a target retrained or fine-tuned in place keeps its path and
    config.json, and its old quantized weights were reused."""
    import hashlib

    from models.hub import weight_file_spans

    h = hashlib.sha256()
    for name, size, head, tail in weight_file_spans(Path(folder)):
        h.update(f"{name}:{size}".encode())
        h.update(head)
        h.update(tail)
    return h.hexdigest()[:16]


def quantize_to_mlx(hf_path: str | Path, out_dir: str | Path, bits: int = 4, group_size: int = DEFAULT_GROUP_SIZE,
                    dtype: str | None = None, revision: str | None = None, log=print) -> Path:
    """Write ``out_dir``: the HF target quantized as ``mlx_lm.convert -q --q-bits B --q-group-size G`` does.

    Same steps as mlx_lm's ``convert`` (its ``load``, its dtype cast, ``quantize_model`` with the
    model's own ``quant_predicate``, its ``save``), plus the config overrides transformers 5 configs
    need (``models.target_mlx.mlx_lm_overrides``); the written config.json is the source's own plus
    ``quantization``, so both loaders read it. Cached: a folder made with the same arguments is reused.
    """
    check_bits_group(bits, group_size)
    try:
        import mlx.core as mx
        from mlx.utils import tree_map_with_path
        from mlx_lm.utils import load, quantize_model, save
    except ImportError as e:
        raise QuantizationError(f"quantizing to MLX needs mlx and mlx-lm ({e}): pip install 'mlx[cpu]' mlx-lm "
                                "(plain 'mlx' on macOS)") from e
    from models.hub import fetch_model
    from models.target import check_supported
    from models.target_mlx import mlx_lm_overrides

    src = fetch_model(hf_path, revision=revision, what="target")
    out = Path(out_dir)
    stamp = {"source": str(hf_path), "revision": revision, "bits": bits, "group_size": group_size, "dtype": dtype,
             "source_config": json.loads((src / "config.json").read_text()), "source_weights": weights_digest(src)}
    marker = out / QUANT_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    if out.exists() and any(out.iterdir()):
        if not marker.is_file():
            raise QuantizationError(f"{out} exists and was not written by draftsmith's quantizer: pick an empty folder")
        import shutil

        shutil.rmtree(out)  # made from other arguments: rebuild
    source_config = stamp["source_config"]
    check_supported(source_config.get("model_type", "<missing model_type>"))
    if source_config.get("quantization"):
        raise QuantizationError(f"{hf_path} is already quantized ({describe_mlx(source_config)}): use "
                                f"target.quantization=mlx:{hf_path} to train against it as it is")
    hidden = (source_config.get("text_config") or source_config).get("hidden_size")
    if hidden and hidden % group_size:
        fits = [g for g in GROUP_SIZES if hidden % g == 0]
        raise QuantizationError(f"group size {group_size} does not divide the target's hidden size {hidden}: mlx_lm "
                                f"would leave every such layer unquantized; use group size {fits or 'none fits'}")
    log(f"quantizing {hf_path} to MLX {bits}-bit, group size {group_size} (mlx_lm) -> {out}")
    model, tokenizer, config = load(str(src), return_config=True, lazy=True,
                                    model_config=mlx_lm_overrides(source_config))
    # mlx_lm.convert: cast floating weights to --dtype, else the config's torch_dtype.
    cast = dtype or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if cast in ("float16", "bfloat16", "float32"):
        keep = getattr(model, "cast_predicate", lambda _k: True)
        target_dtype = getattr(mx, cast)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(target_dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
    model, qconfig = quantize_model(model, config, group_size, bits)
    written = dict(source_config)
    written["quantization"] = qconfig["quantization"]
    save(out, src, model, tokenizer, written)
    marker.write_text(json.dumps(stamp, indent=2))
    return out


# ----------------------------------------------------------------------------- transformers quantizers
def transformers_quantization_config(value: str | None):
    """``bnb-4bit`` / ``fp8`` -> the transformers ``quantization_config`` to load with; None otherwise.

    The backend must be installed: the error says what to install instead of failing mid-load.
    """
    spec = parse_quantization(value)
    if spec.kind == "bnb":
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise QuantizationError("target.quantization=bnb-4bit needs bitsandbytes: pip install bitsandbytes "
                                    "(CUDA), or use mlx-4bit, which runs anywhere")
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    if spec.kind == "fp8":
        from transformers import FineGrainedFP8Config

        if not torch.cuda.is_available():
            raise QuantizationError("target.quantization=fp8 needs a CUDA GPU (transformers' FP8 kernels); "
                                    "on CPU use mlx-8bit")
        return FineGrainedFP8Config()
    if spec.kind == "mlx":
        raise QuantizationError(f"target.quantization={value}: MLX quantization is resolved to a folder first "
                                "(models.quant.resolve_target); load that folder")
    return None


def resolve_target(path: str, quantization: str | None, work_dir: str | Path, revision: str | None = None,
                   log=print) -> tuple[str, str | None]:
    """(folder or id to load, transformers quantization or None) for ``target.path`` + ``target.quantization``.

    ``mlx:PATH_OR_ID`` loads that MLX folder (``path`` is then only the bf16 reference); ``mlx-Nbit``
    quantizes ``path`` with mlx_lm into ``work_dir/target-mlx-Nbit-gG`` (cached); ``bnb-4bit`` / ``fp8``
    are passed to transformers (checked here, before any weight loads).
    """
    spec = parse_quantization(quantization)
    if spec.kind == "none":
        return path, None
    if spec.kind == "mlx" and spec.path:
        from models.hub import fetch_model

        folder = fetch_model(spec.path, revision=revision, what="quantized target")
        if not is_mlx_quantized(folder):
            raise QuantizationError(f"target.quantization=mlx:{spec.path}: {folder} has no MLX 'quantization' in its "
                                    "config.json; give an MLX-quantized folder, or mlx-4bit to quantize target.path")
        return str(folder), None
    if spec.kind == "mlx":
        out = Path(work_dir) / f"target-mlx-{spec.bits}bit-g{spec.group_size}"
        return str(quantize_to_mlx(path, out, bits=spec.bits, group_size=spec.group_size, revision=revision,
                                   log=log)), None
    transformers_quantization_config(quantization)
    return path, quantization


def trained_against(path: str, quantization: str | None) -> str:
    """The "trained against" line of exports and model cards, from a run's ``target.path`` and
    ``target.quantization`` (a ``target.path`` that is itself an MLX folder counts as ``mlx:PATH``)."""
    spec = parse_quantization(quantization)
    if spec.kind == "none":
        folder = Path(str(path)).expanduser()
        if folder.is_dir() and is_mlx_quantized(folder):
            return f"mlx:{path} ({describe_mlx(json.loads((folder / 'config.json').read_text()))})"
        return "none (unquantized weights)"
    return spec.describe()
