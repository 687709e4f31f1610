"""The exact commands to serve and run an exported drafter (printed by the exports, written in the card).

vLLM and SGLang flags are the ones their DFlash integrations read: vLLM drafts ``B - 1`` tokens
after the bonus token, SGLang counts the whole block ``B``.
"""

from __future__ import annotations

import json
import shlex


def serve_commands(drafter: str, target: str | None, block_size: int) -> dict[str, str]:
    """``{"vllm": ..., "sglang": ...}`` for a drafter folder or Hub id and its target."""
    target = target or "TARGET"
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": block_size - 1})
    return {
        "vllm": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
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
