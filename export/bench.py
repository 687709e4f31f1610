"""Export at real drafter shapes: wall time and parity figures of export.hf / export.mlx (one JSON line each).

    python -m export.bench --shape qwen3-8b --work /tmp/export-bench
    python -m export.bench --shape qwen35-4b --mlx-quantize 4    # also a 4-bit MLX export

A drafter of a shipped recipe's target shape (the benches' one source of shapes,
``models/random_target.py``: hidden size, attention, MLP and vocabulary of the target; 5 layers, 2 for
``tiny``; seeded, initialised like a fresh HF model: normal(0, 0.02)) is saved in bf16 as training's
``final/drafter`` would be, then exported; the lines report seconds, folder size and the gate's logit
figures (max |diff|, relative error, top-1 agreement). No target is built.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from export.hf import export_hf
from export.mlx import export_mlx
from models.config import DFlashConfig, default_layer_ids
from models.drafter import DFlashDraftModel
from models.random_target import RECIPE_SHAPES, recipe_shape


def drafter_shape(recipe: str) -> dict:
    """DFlashConfig keys of a drafter for ``recipe``'s target (docs/design.md defaults: the target's hidden size
    and attention shape; the mask token on the last row, as the inference bench's random drafter)."""
    _, t = recipe_shape(recipe)
    return dict(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
                head_dim=t["head_dim"], vocab_size=t["vocab_size"], num_target_layers=t["num_hidden_layers"],
                mask_token_id=t["vocab_size"] - 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m export.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=RECIPE_SHAPES, default="qwen3-8b",
                   help="drafter for this recipe's target (random weights; default qwen3-8b)")
    p.add_argument("--work", default="/tmp/export-bench", help="scratch folder (emptied first)")
    p.add_argument("--mlx", action="store_true", help="also export.mlx (bf16)")
    p.add_argument("--mlx-quantize", type=int, choices=[4, 8], default=None, help="also a quantized MLX export")
    args = p.parse_args(argv)

    shape = drafter_shape(args.shape)
    taps = 5 if shape["num_target_layers"] >= 8 else 3
    cfg = DFlashConfig(num_hidden_layers=5 if args.shape != "tiny" else 2, block_size=16, torch_dtype="bfloat16",
                       target_layer_ids=default_layer_ids(shape["num_target_layers"], taps), **shape)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    t = time.perf_counter()
    model.save_pretrained(work / "final" / "drafter", dtype=torch.bfloat16)
    del model
    print(json.dumps({"bench": "save_source", "shape": args.shape, "s": round(time.perf_counter() - t, 2),
                      "mb": round(_size(work / "final" / "drafter"), 1)}), flush=True)

    t = time.perf_counter()
    res = export_hf(work / "final" / "drafter", work / "hf", log=lambda *_: None)
    print(json.dumps({"bench": "export.hf", "shape": args.shape, "dtype": "bf16",
                      "s": round(time.perf_counter() - t, 2), "mb": round(_size(work / "hf"), 1),
                      "parity": res["parity"]}), flush=True)
    for quant in ([None] if args.mlx else []) + ([args.mlx_quantize] if args.mlx_quantize else []):
        t = time.perf_counter()
        out = work / f"mlx{quant or ''}"
        res = export_mlx(work / "final" / "drafter", out, quantize=quant, log=lambda *_: None)
        print(json.dumps({"bench": "export.mlx", "shape": args.shape, "quantize": quant,
                          "s": round(time.perf_counter() - t, 2), "mb": round(_size(out), 1),
                          "parity": res["parity"]}), flush=True)


def _size(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 1e6


if __name__ == "__main__":
    main()
