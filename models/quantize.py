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
from models.target_folder import check_supported

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
    need (``models.target_mlx.load_mlx_lm``); the written config.json is the source's own plus
    ``quantization``, so both loaders read it. Cached: a folder made with the same arguments is reused.
    """
    check_bits_group(bits, group_size)
    try:  # optional dependency: mlx, mlx_lm (models.target_mlx imports mlx)
        import mlx.core as mx
        from mlx.utils import tree_map_with_path
        from mlx_lm.utils import quantize_model, save

        from models.target_mlx import load_mlx_lm
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
    # mlx_lm's load, with the config overrides transformers 5 folders need and gpt-oss's bf16 experts read
    model, tokenizer, config = load_mlx_lm(src, source_config, lazy=True)
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
        return str(folder), None
    if spec.kind == "mlx":
        out = Path(work_dir) / f"target-mlx-{spec.bits}bit-g{spec.group_size}"
        return str(quantize_to_mlx(path, out, bits=spec.bits, group_size=spec.group_size, revision=revision,
                                   log=log)), None
    transformers_quantization_config(quantization)
    return path, quantization
