"""A bf16 HF target quantized as ``mlx_lm.convert -q`` does, and ``target.quantization`` resolved to a folder.

``quantize_to_mlx`` writes an MLX folder from a bf16 HF target with mlx_lm's own functions (``load`` ->
the dtype cast of ``mlx_lm.convert`` -> ``quantize_model`` -> ``save``), so the layers skipped and the
bit widths per layer are the ones ``mlx_lm.convert -q`` picks. It needs ``mlx`` (``pip install
"mlx[cpu]" mlx-lm`` on Linux), an optional dependency imported where it is used; reading the folder back
in torch (``dequantize.py``) does not. ``resolve_target`` turns a run's ``target.path`` and
``target.quantization`` into the folder to load (quantizing here, cached, when asked).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from models.hub import fetch_model, weight_file_spans
from models.quantization import (DEFAULT_GROUP_SIZE, GROUP_SIZES, QuantizationError, check_bits_group, describe_mlx,
                                 is_mlx_quantized, parse_quantization)
from models.target import transformers_quantization_config
from models.target_folder import SUPPORTED, check_supported

QUANT_MARKER = "draftsmith_quant.json"  # written next to a folder quantize_to_mlx made (the cache key)


def weights_digest(folder: Path) -> str:
    """A hash of the folder's weight files: names, sizes, first and last MiB (``models.hub.weight_file_spans``).
    Part of the quantized folder's cache key: a target retrained or fine-tuned in place keeps its path and
    config.json, and its old quantized weights were reused."""
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
    need (``models.target_mlx.mlx_lm_load``); the written config.json is the source's own plus
    ``quantization``, so both loaders read it. Cached: a folder made with the same arguments is reused.
    """
    check_bits_group(bits, group_size)
    try:  # optional dependency: mlx, mlx_lm (models.target_mlx imports mlx)
        import mlx.core as mx
        from mlx.utils import tree_map_with_path
        from mlx_lm.utils import quantize_model, save

        from models.target_mlx import mlx_lm_load
    except ImportError as e:
        raise QuantizationError(f"quantizing to MLX needs mlx and mlx-lm ({e}): pip install 'mlx[cpu]' mlx-lm "
                                "(plain 'mlx' on macOS)") from e
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
    model, tokenizer, config = mlx_lm_load(src, source_config, lazy=True)
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


# ----------------------------------------------------------------------------- mlx:DIR is a copy of target.path
# Keys of a target's (text) config that say what model it is: a quantized copy keeps them as they are.
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
              "layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "full_attention_interval", "sliding_window")
FINGERPRINT_NORMS = ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                     "model.layers.0.post_attention_layernorm.weight")
FINGERPRINT_ROWS = 16  # embedding rows compared after dequantizing (a quantized copy is within a step of them)
OFF_STEP = 1.5  # further than this many quantization steps from the source's value: not a copy of it
OFF_SHARE = 0.01  # ... for more than this share of the compared values (a copy: none; another model: most)


def _canonical(name: str) -> str:
    """A tensor's transformers name: mlx_lm keeps a multimodal checkpoint's text tower under ``language_model.``."""
    if name.startswith("language_model."):
        return name.removeprefix("language_model.")
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def _tensor_files(directory: Path) -> dict[str, tuple[str, Path]]:
    """transformers name -> (the name stored, its safetensors file), from headers only; {} without weights."""
    from safetensors import safe_open

    from models.hub import shard_index

    index = shard_index(directory)
    if index is not None:
        return {_canonical(k): (k, directory / f) for k, f in index.items() if (directory / f).is_file()}
    found = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            found.update({_canonical(k): (k, f) for k in handle.keys()})
    return found


def _read(entry: tuple[str, Path], rows: int | None = None):
    from safetensors import safe_open

    with safe_open(str(entry[1]), framework="pt") as f:
        return f.get_slice(entry[0])[:rows] if rows else f.get_tensor(entry[0])


def _config_differences(source: dict, copy: dict) -> list[str]:
    src, cp = source.get("text_config") or source, copy.get("text_config") or copy
    out = []
    families = [SUPPORTED.get(str(d.get("model_type", t.get("model_type"))), d.get("model_type"))
                for d, t in ((source, src), (copy, cp))]
    if families[0] != families[1]:
        out.append(f"model_type {copy.get('model_type')!r}, target.path's {source.get('model_type')!r}")
    out += [f"{k} {cp[k]!r}, target.path's {src[k]!r}" for k in SHAPE_KEYS if k in src and k in cp and src[k] != cp[k]]
    return out


def _weight_differences(source: Path, copy: Path, config: dict, family: str) -> tuple[list[str], int]:
    """(what differs, tensors compared) between target.path's weights and the MLX folder's: norms (stored in float in
    an MLX folder: equal after the cast, or ``1 + w`` where mlx_lm stores Qwen3.5's norms so) and the first embedding
    rows (within ``OFF_STEP`` quantization steps once dequantized)."""
    import torch

    from models.dequantize import dequantize, layer_params

    mine, theirs = _tensor_files(source), _tensor_files(copy)
    problems, compared = [], 0
    for key in FINGERPRINT_NORMS:
        if key not in mine or key not in theirs:
            continue
        w, q = _read(mine[key]).float(), _read(theirs[key])
        shifted = [(w.to(q.dtype) + 1).to(q.dtype), (w + 1).to(q.dtype)] if family == "qwen3_5" else []
        compared += 1
        if not any(torch.equal(c, q) for c in [w.to(q.dtype), *shifted]):
            problems.append(f"{key} differs (max |diff| {(w - q.float()).abs().max().item():.3g})")
    key = "model.embed_tokens.weight"
    prefix = theirs.get(key, ("",))[0].removesuffix(".weight")
    scales, biases = (theirs.get(f"model.embed_tokens.{p}") for p in ("scales", "biases"))
    if key in mine and key in theirs and scales and biases:
        packed, s, b = _read(theirs[key], FINGERPRINT_ROWS), _read(scales, FINGERPRINT_ROWS), _read(biases,
                                                                                                    FINGERPRINT_ROWS)
        bits, group = layer_params(config.get("quantization") or {}, prefix, packed.shape[-1], s.shape[-1])
        dq = dequantize(packed, s, b, group, bits, torch.float32)
        w = _read(mine[key], FINGERPRINT_ROWS).float()
        step = s.float().abs().repeat_interleave(group, dim=-1)
        slack = 2 ** -7 * (w.abs() + b.float().abs().repeat_interleave(group, dim=-1)) + 1e-6  # bf16 rounding
        off = ((w - dq).abs() > OFF_STEP * step + slack).float().mean().item()
        compared += 1
        if off > OFF_SHARE:
            problems.append(f"its first {FINGERPRINT_ROWS} embedding rows dequantize to other values ({off:.0%} of "
                            f"them more than {OFF_STEP:g} quantization steps from target.path's)")
    return problems, compared


def check_quantized_copy(folder: Path, spec_path: str, path: str, revision: str | None = None) -> str:
    """Refuse ``target.quantization=mlx:DIR`` when DIR was not made from ``target.path``: training ran against DIR's
    weights while the drafter, its exports, serve commands and card named ``target.path``. The configs' shape keys
    must agree; where ``target.path``'s weights are on this machine, a fingerprint too (norms, first embedding
    rows). Returns what was checked."""
    from models.hub import SMALL_FILES, resolve_model_dir

    source = resolve_model_dir(path, revision=revision, what="target", allow_patterns=SMALL_FILES)
    config = json.loads((folder / "config.json").read_text())
    source_config = json.loads((source / "config.json").read_text()) if (source / "config.json").is_file() else {}
    problems = _config_differences(source_config, config) if source_config else []
    checked = "config"
    if not problems:
        family = SUPPORTED.get(str(config.get("model_type")), "")
        weights, compared = _weight_differences(source, folder, config, family)
        problems += weights
        checked = f"config and {compared} weight fingerprints" if compared else \
            "config (weights not compared: target.path's weights are not on this machine)"
    if problems:
        raise QuantizationError(
            f"target.quantization=mlx:{spec_path}: {folder} is not a quantized copy of target.path={path}: "
            + "; ".join(problems) + f". Train against a quantized copy of {path} (target.quantization=mlx-4bit "
            f"quantizes it here, as mlx_lm.convert -q does), or set target.path to the model {spec_path} was made "
            "from")
    return checked


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
        folder = fetch_model(spec.path, revision=revision, what="quantized target")
        if not is_mlx_quantized(folder):
            raise QuantizationError(f"target.quantization=mlx:{spec.path}: {folder} has no MLX 'quantization' in its "
                                    "config.json; give an MLX-quantized folder, or mlx-4bit to quantize target.path")
        checked = check_quantized_copy(folder, spec.path, path, revision)
        log(f"target.quantization=mlx:{spec.path}: a quantized copy of target.path={path} ({checked} checked); the "
            "drafter records it as the target it trained against")
        return str(folder), None
    if spec.kind == "mlx":
        out = Path(work_dir) / f"target-mlx-{spec.bits}bit-g{spec.group_size}"
        return str(quantize_to_mlx(path, out, bits=spec.bits, group_size=spec.group_size, revision=revision,
                                   log=log)), None
    transformers_quantization_config(quantization)
    return path, quantization
