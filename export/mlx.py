"""Export a drafter as an MLX folder (optionally 4/8-bit) for draftsmith's MLX loop on a Mac.

    python -m export.mlx --checkpoint runs/qwen3-8b/final/drafter --out exports/qwen3-8b-dflash-mlx
    python -m export.mlx --checkpoint runs/qwen3-8b --out exports/qwen3-8b-dflash-mlx-4bit --quantize 4 --group-size 64

MLX-native safetensors under the same tensor names as the HF folder; ``config.json`` keeps every
flat DFlash key plus ``quantization`` and ``quantization_config`` (``{bits, group_size, mode}``,
the same value in both, as mlx-lm writes them) when quantized. Quantization is MLX affine
(``nn.quantize``) of every linear whose input width the group size divides. An unquantized folder
also ships ``modeling_dflash.py`` (its safetensors load in transformers too); a quantized one drops
``auto_map``, since only MLX reads packed weights.

Gate before the folder is moved into place: the schema (``export/check.py``), the config round
trip, the reloaded weights bit-equal to the ones written, and the MLX drafter's logits on a random
block against the float32 torch drafter's: within a tolerance for the dtype when not quantized; for
a quantized draft the logit error and the top-1 agreement are reported, with a warning below 90%.

A DFlash2 drafter keeps its published names; quantization covers its linears (``kernel_projection``
and ``hidden_projection`` included) and leaves ``base_kernel`` and the two selector codebooks in the
folder's float dtype. Its gate also reports how often the MLX selector walk drafts the torch fp32
one's tokens on the random block.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from export.check import (LOW_TOP1, ExportCheckError, check_parity, config_differences, logit_stats, modeling_file_name,
                          raise_if, random_block, schema_problems, stand_in_head, target_problems, weight_problems)
from export.folder import check_out, staging
from export.hf import NOT_EXPORTED, provenance
from export.source import full_precision_source
from export.usage import QUANTIZED_MLX_LOADERS
from models.weights import check_finite, folder_tensors
from models.config import DFlashConfig
from models.config_layout import mlx_only
from models.drafter2 import load_drafter as load_torch_drafter, select as torch_select, unary_logits as torch_unary

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m export.mlx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint (runs/NAME/checkpoints/step_N), run folder (runs/NAME) or HF drafter folder")
    p.add_argument("--out", required=True, help="folder to write (must be new or empty; see --overwrite)")
    p.add_argument("--quantize", type=int, choices=[4, 8], default=None, help="affine-quantize the linears (bits)")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None,
                   help="quantization group, with --quantize (default 64)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the norms and unquantized weights (default bf16)")
    p.add_argument("--target", default=None, help="target Hub id or local folder to record (default: training's); "
                   "also checked against the drafter (a Hub id from its config and tokenizer files only)")
    p.add_argument("--target-revision", default=None, help="target revision to record")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier draftsmith export at --out")
    args = p.parse_args(argv)
    if args.group_size is not None and args.quantize is None:  # was ignored: a bf16 export the user did not expect
        p.error("--group-size applies to quantized exports: add --quantize 4 (or 8), or leave --group-size out")
    args.group_size = args.group_size or 64
    return args


def torch_logits(model, inputs: dict, head: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        hidden = model(torch.from_numpy(inputs["noise"]), torch.from_numpy(inputs["features"]),
                       torch.from_numpy(inputs["positions"]))
    return hidden.double().numpy() @ head.T.astype(np.float64)


def mlx_logits(model, inputs: dict, head: np.ndarray) -> np.ndarray:
    import mlx.core as mx  # optional dependency: mlx

    dtype = model.dtype
    hidden = model(mx.array(inputs["noise"]).astype(dtype), mx.array(inputs["features"]).astype(dtype),
                   mx.array(inputs["positions"]))
    return np.array(hidden.astype(mx.float32)).astype(np.float64) @ head.T.astype(np.float64)


def selector_agreement(reference, model, inputs: dict, head: np.ndarray) -> float:
    """DFlash2: the share of slots where the MLX drafter's greedy selector walk (through the stand-in head) drafts
    the torch fp32 drafter's token, on the gate's random blocks."""
    import mlx.core as mx  # optional dependency: mlx

    from models.drafter2_mlx import select, unary_logits  # optional dependency: mlx

    c = reference.config
    with torch.no_grad():
        hidden = reference(torch.from_numpy(inputs["noise"]), torch.from_numpy(inputs["features"]),
                           torch.from_numpy(inputs["positions"]))[:, 1:]
        bonus = torch.arange(hidden.shape[0]) % head.shape[0]
        sel = reference.candidate_selector
        want = torch_select(torch_unary(hidden @ torch.from_numpy(head).T, c.output_multiplier,
                                        c.final_logit_softcapping), sel.hidden_projection(hidden),
                            sel.predecessor_codebook, sel.successor_codebook, bonus, c.selector_top_k).tokens.numpy()
    dtype = model.dtype
    hidden = model(mx.array(inputs["noise"]).astype(dtype), mx.array(inputs["features"]).astype(dtype),
                   mx.array(inputs["positions"]))[:, 1:].astype(mx.float32)
    sel = model.candidate_selector
    got = select(unary_logits(hidden @ mx.array(head).T, c.output_multiplier, c.final_logit_softcapping),
                 sel.hidden_projection(hidden.astype(dtype)), sel.predecessor_codebook, sel.successor_codebook,
                 mx.array(bonus.numpy()), c.selector_top_k).tokens
    return float((np.array(got) == want).mean())


def gate(folder: Path, model, reference, dtype: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Checks on the written MLX folder; raises ``ExportCheckError`` (nothing moved) on failure."""
    import mlx.core as mx  # optional dependency: mlx
    from mlx.utils import tree_flatten  # optional dependency: mlx

    from models.drafter2_mlx import load_drafter  # optional dependency: mlx

    d = json.loads((folder / "config.json").read_text())
    raise_if(schema_problems(d, folder, hf=False), f"{folder.name}/config.json fails the engine schema")
    written = model.config.replace(torch_dtype=dtype, quantization=model.quantization)
    raise_if(config_differences(written, DFlashConfig.from_dict(d)), "config.json does not read back as written")
    raise_if(weight_problems(folder, written), "the written weights do not match config.json")
    again = load_drafter(folder)
    mine, theirs = dict(tree_flatten(model.parameters())), dict(tree_flatten(again.parameters()))
    changed = [k for k, v in mine.items() if k not in theirs or not mx.array_equal(v, theirs[k]).item()]
    raise_if([f"{k} changed on the way to disk" for k in changed], "the reloaded MLX weights differ")
    log("check: engine schema, config round trip, weights bit-equal after reload")
    inputs = random_block(written)
    head = stand_in_head(written)
    stats = logit_stats(torch_logits(reference, inputs, head), mlx_logits(again, inputs, head))
    what = f"MLX drafter ({dtype}{', %d-bit' % model.quantization['bits'] if model.quantization else ''}) vs torch fp32"
    if written.variant == "dflash2":
        stats["selector_tokens"] = selector_agreement(reference, again, inputs, head)
        log(f"check: {what}: the selector walk drafts the same token in {stats['selector_tokens']:.1%} of slots")
    if model.quantization:
        log(f"check: {what}: logits max |diff| {stats['max_abs']:.3e} (mean {stats['mean_abs']:.3e}), "
            f"top-1 agreement {stats['top1']:.1%} on a random block")
        if not np.isfinite(stats["max_abs"]):
            raise ExportCheckError(f"{what}: logits are not finite; nothing was exported")
        if stats["top1"] < LOW_TOP1:
            q = model.quantization
            tries = ["--quantize 8"] * (q["bits"] < 8) + ["a smaller --group-size"] * (q["group_size"] > 32)
            msg = (f"the quantized draft agrees with the full-precision one on only {stats['top1']:.1%} of top-1 "
                   "tokens (random block): expect lower acceptance; "
                   + (f"try {' or '.join(tries)}" if tries else "or export it unquantized (bf16)"))
            log(f"warning: {msg}")
    else:
        check_parity(stats, dtype, what)
        log(f"check: {what}: logits max |diff| {stats['max_abs']:.2e}")
    return stats


def export_mlx(checkpoint: str | Path, out: str | Path, quantize: int | None = None, group_size: int = 64,
               dtype: str = "bf16", target: str | None = None, target_revision: str | None = None,
               overwrite: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Write, check and place the MLX folder; returns a summary (paths, parity figures)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    try:
        import mlx.core as mx  # optional dependency: mlx
    except ImportError:
        raise OSError("export.mlx needs MLX: pip install 'draftsmith[mlx]' (mlx on macOS, mlx[cpu] on Linux)") from None
    from models.drafter2_mlx import load_drafter  # optional dependency: mlx

    if quantize not in (None, 4, 8):
        raise ValueError(f"--quantize {quantize}: use 4 or 8 (bits)")
    if group_size not in (32, 64, 128):
        raise ValueError(f"--group-size {group_size}: use 32, 64 or 128")
    out = Path(out)
    src = full_precision_source(checkpoint, "export.mlx")
    check_out(out, overwrite, src.drafter_dir)
    log(f"source: {src.drafter_dir} ({src.kind})")
    check_finite(folder_tensors(src.drafter_dir), str(src.drafter_dir), NOT_EXPORTED)  # as stored, before any cast
    reference = load_torch_drafter(src.drafter_dir, dtype=torch.float32)
    model = load_drafter(src.drafter_dir, dtype=getattr(mx, DTYPES[dtype]))
    prov = provenance(src.provenance, target, target_revision, log)
    model.config = model.config.replace(draftsmith=prov or None)
    problems, checked = target_problems(model.config, prov.get("target"))
    raise_if(problems, "the drafter does not fit its target")
    log(f"check: {checked}")
    if quantize:
        check_group_size(model, group_size)
        model.quantize(bits=quantize, group_size=group_size)
    with staging(out, overwrite) as tmp:
        model.save_pretrained(tmp)
        _finish_folder(tmp, quantized=bool(quantize))
        stats = gate(tmp, model, reference, DTYPES[dtype], log)
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    log(f"exported {out} (MLX, {dtype}{f', {quantize}-bit g{group_size}' if quantize else ''}, {size:.1f} MB)")
    log("run it with draftsmith's MLX loop:\n  python -m inference.generate --backend mlx --target "
        f"{prov.get('quantized_target') or prov.get('target', 'TARGET')} --draft {out} --prompt "
        "\"Explain KV caching.\" --chat --baseline")
    if quantize:
        log(f"note: {QUANTIZED_MLX_LOADERS}")
    return {"out": str(out), "source": str(src.drafter_dir), "dtype": dtype, "quantization": model.quantization,
            "provenance": prov, "parity": stats}


def check_group_size(model, group_size: int) -> None:
    """Refuse a group size that does not divide every linear's input width: those linears would stay
    unquantized in a folder labelled as quantized (mlx quantizes a row in whole groups)."""
    import mlx.nn as nn  # optional dependency: mlx

    widths = {name: m.weight.shape[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    left = sorted(name for name, width in widths.items() if width % group_size)
    if not left:
        return
    fits = [g for g in (128, 64, 32) if all(w % g == 0 for w in widths.values())]
    fix = (f"use --group-size {fits[0]} (the largest that divides them all)" if fits else
           "no group size divides them all: export without --quantize")
    raise ValueError(f"--group-size {group_size} does not divide the input width of {len(left)} of the drafter's "
                     f"{len(widths)} linears (e.g. {left[0]}: {widths[left[0]]}), which would stay unquantized: "
                     + fix)


def _flat(params):
    from mlx.utils import tree_flatten  # optional dependency: mlx

    return tree_flatten(params)


def _finish_folder(folder: Path, quantized: bool) -> None:
    """A quantized folder is MLX-only (no ``auto_map``); an unquantized one ships the modeling file."""
    if quantized:
        path = folder / "config.json"
        path.write_text(json.dumps(mlx_only(json.loads(path.read_text())), indent=2) + "\n")
    else:
        shipped = Path(__file__).resolve().parent.parent / "models" / "hf_dflash.py"
        (folder / modeling_file_name()).write_text(shipped.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    return export_mlx(args.checkpoint, args.out, quantize=args.quantize, group_size=args.group_size, dtype=args.dtype,
                      target=args.target, target_revision=args.target_revision, overwrite=args.overwrite)


def cli() -> None:
    """The ``draftsmith-export-mlx`` console script: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.support import run_cli

    run_cli(main, interrupted=("--out is untouched (an export is written aside and moved in when complete): "
                                    "rerun the command"))


if __name__ == "__main__":
    cli()
