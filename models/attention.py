"""HF attention implementations the project switches a target to for one call.

``CAUSAL_SDPA`` is HF's own SDPA function under a name HF has no mask builder for. HF's mask builders
check the inputs on the host before they decide there is nothing to mask (are the position ids one
sequence per row, is the padding mask all ones): each check reads a GPU value back, so the host waits for
every kernel queued before it, and the GPU then idles while the host queues the next ones, once per
target forward of every training micro-batch. For an unpadded, uncached call of a target whose attention
is all full (causal) layers, HF's builders end at "no mask" and SDPA runs with ``is_causal``; under this
name the builders are skipped, the attention gets no mask and SDPA takes the same ``is_causal`` path, with
nothing read back. Sliding-window layers need their window mask: targets with them keep HF's builders.
"""

from __future__ import annotations

from contextlib import contextmanager

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CAUSAL_SDPA = "draftsmith_causal_sdpa"
AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)

# Layer types whose mask for an unpadded, uncached call is "none" (causal attention; linear attention
# masks only padding).
MASK_FREE_LAYERS = {"full_attention", "linear_attention"}


def mask_free(configs: list, layer_types: list[str]) -> bool:
    """Whether an unpadded, uncached call may run under ``CAUSAL_SDPA``: every config on SDPA and every
    layer full or linear attention (other implementations, eager's additive mask or flex's block mask,
    need the mask HF builds)."""
    return (set(layer_types) <= MASK_FREE_LAYERS
            and all(getattr(c, "_attn_implementation", None) == "sdpa" for c in configs))


@contextmanager
def attention_implementation(configs: list, name: str | None):
    """The attention layers of ``configs`` dispatch to ``name`` inside the block (unchanged for ``None``)."""
    saved = [c._attn_implementation for c in configs]
    try:
        if name is not None:
            for c in configs:
                c._attn_implementation = name
        yield
    finally:
        for c, before in zip(configs, saved):
            c._attn_implementation = before
