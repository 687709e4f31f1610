"""The exact commands to serve and run an exported drafter (printed by the exports, written in the card).

vLLM and SGLang flags are the ones their DFlash integrations read: vLLM drafts ``B - 1`` tokens
after the bonus token, SGLang counts the whole block ``B``. Both pick DFlash2 from the folder's
``DFlash2DraftModel`` architecture (same flags); vLLM runs its selector only on the V2 model runner.
Every printed serve command comes with the engine releases that load the folder correctly
(``engine_requirements``): vLLM >= 0.22.0, SGLang >= 0.5.13 (>= 0.5.18 with sliding layers) for
DFlash, the builds named in ``ENGINE_REQUIREMENTS`` for DFlash2.
"""

from __future__ import annotations

import json
import shlex


# The engine releases that load a DFlash (v1) folder correctly: older ones run it, wrongly and without a word.
ENGINE_REQUIREMENTS_V1 = {
    "vllm": ("vLLM >= 0.22.0 (0.20-0.21 tap each target layer one layer early: MT-bench acceptance 3.92 instead of "
             "4.11; fixed by vLLM PR #40727)"),
    "sglang": "SGLang >= 0.5.13 (0.5.11-0.5.12 ignore the drafter's RoPE base: wrong for every non-1e6 target)",
}
# Drafters with sliding-window layers: earlier SGLang releases run those layers causally inside the block.
SGLANG_SLIDING = ("SGLang >= 0.5.18 (this drafter has sliding-window layers, which earlier releases run causally; "
                  "0.5.11-0.5.12 also ignore the RoPE base)")
# Which MLX loaders read a quantized MLX drafter folder (packed weights + scales + biases).
QUANTIZED_MLX_LOADERS = ("this quantized MLX folder loads in draftsmith's MLX loop and in bstnxbt/dflash-mlx; z-lab's "
                         "model_mlx.py and Aryagm/dflash-mlx refuse its extra scales/biases: give those the bf16 "
                         "folder (export.mlx without --quantize, or the export.hf folder)")
# What each engine needs to serve a DFlash2 drafter: only what is established (SPEC of the published support).
ENGINE_REQUIREMENTS = {
    "dflash2": {
        "vllm": ("a vLLM build containing PR #52816 (DFlash2DraftModel, merged 2026-08-21): the first release "
                 "containing PR #52816 (0.28.0 is expected to be it; not verified), or a nightly from after the "
                 "merge; the selector runs only on the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)"),
        "sglang": ("an SGLang build containing PR #35371 (merged 2026-08-18): unreleased as of 0.5.18 (no tagged "
                   "release had it on 2026-09-02): install SGLang from its main branch"),
    },
}


def engine_requirements(variant: str, sliding: bool = False) -> dict[str, str]:
    """``{"vllm": ..., "sglang": ...}``: the minimum engine builds that load a drafter of this generation correctly
    (``sliding``: a v1 drafter with sliding-window layers; every DFlash2 layer slides, and its own note says so)."""
    if variant in ENGINE_REQUIREMENTS:
        return dict(ENGINE_REQUIREMENTS[variant])
    return {**ENGINE_REQUIREMENTS_V1, **({"sglang": SGLANG_SLIDING} if sliding else {})}


def serve_commands(drafter: str, target: str | None, block_size: int, variant: str = "dflash") -> dict[str, str]:
    """``{"vllm": ..., "sglang": ...}`` for a drafter folder or Hub id and its target."""
    target = target or "TARGET"
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": block_size - 1})
    runner = "VLLM_USE_V2_MODEL_RUNNER=1 " if variant == "dflash2" else ""  # DFlash2's selector: V2 runner only
    return {
        "vllm": f"{runner}vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
        "sglang": (f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
                   f"--speculative-algorithm DFLASH --speculative-draft-model-path {shlex.quote(str(drafter))} "
                   f"--speculative-num-draft-tokens {block_size}"),
    }


def draftsmith_commands(drafter: str, target: str | None, mlx: bool) -> dict[str, str]:
    """draftsmith's own loops on this drafter (MLX on a Mac, torch elsewhere) and its validation."""
    target = target or "TARGET"
    backend = "mlx" if mlx else "torch"
    return {
        "generate": (f"python -m inference.generate --backend {backend} --target {shlex.quote(target)} "
                     f"--draft {shlex.quote(str(drafter))} --prompt \"Explain KV caching.\" --chat --baseline"),
        "validate": (f"python -m inference.validate --backend {backend} --target {shlex.quote(target)} "
                     f"--draft {shlex.quote(str(drafter))}"),
    }


def transformers_snippet(drafter: str) -> str:
    """Loading the drafter with plain transformers (the shipped modeling file, via ``auto_map``)."""
    return (
        "from transformers import AutoModel\n"
        f"draft = AutoModel.from_pretrained({str(drafter)!r}, trust_remote_code=True)\n"
        "# forward(noise_embedding [b, B, H], target_hidden [b, c, taps*H], position_ids [b, c+B]) -> hidden\n"
        "# states at the block positions; apply the target's LM head for logits."
    )
