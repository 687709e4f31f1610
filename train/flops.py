"""Model FLOPs of a training step and the card's peak: the one count behind ``train.bench``'s MFU and the
training log's (``mfu`` in ``metrics.jsonl`` on CUDA).

Model FLOPs, not hardware FLOPs: the matmuls the step needs, counted from the blocks drawn (no recompute
for gradient checkpointing, no attention FLOPs of masked-out tiles). An online step adds the frozen
target's tapped forward, ``2 x parameters of the target layers that ran x tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 tensor-core peaks (no sparsity) by a piece of torch.cuda.get_device_name(); the first piece
# found wins, so the PCIe and NVL H100s (fewer SMs, lower clocks) come before the SXM "H100".
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0,
                    "L40S": 362.0, "4090": 165.0, "B200": 2250.0}


def peak_tflops(device_name: str) -> float | None:
    """The card's dense bf16 peak (TFLOP/s) that MFU divides by; None for a card not in the table."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


@dataclass(frozen=True)
class DrafterShape:
    """What the drafter's FLOPs depend on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    taps: int
    vocab: int
    block: int

    @classmethod
    def of(cls, cfg) -> DrafterShape:
        """From a canonical drafter config (``models.config.DFlashConfig``)."""
        return cls(hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                   kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
                   taps=len(cfg.target_layer_ids), vocab=cfg.vocab_size, block=cfg.block_size)


def drafter_flops(s: DrafterShape, blocks, scored: int, context_tokens: int) -> float:
    """Model FLOPs of one drafter micro-batch (forward + backward, no recompute), from the blocks drawn (on the
    host in training: nothing is read back from the GPU).

    Per query token: the layer matmuls x3 (forward, input and weight grads). Attention x3 over the keys each
    query sees (context before its anchor + its own block). The context's fc x2 (weight grad only: features
    need none) and each layer's context k/v projections x3, over ``context_tokens``. The frozen LM head x2
    (forward + input grad) over the ``scored`` slots only.
    """
    H = s.hidden
    q = int(blocks.valid.sum()) * s.block
    keys = int(((blocks.anchors + s.block) * blocks.valid).sum()) * s.block
    proj = H * s.head_dim * (2 * s.heads + 2 * s.kv_heads) + 3 * H * s.intermediate
    return float(3 * s.layers * (2 * proj * q + 4 * s.heads * s.head_dim * keys)
                 + 2 * 2 * s.taps * H * H * context_tokens + 3 * s.layers * 2 * 2 * H * s.kv_heads * s.head_dim
                 * context_tokens + 2 * 2 * H * s.vocab * scored)


def target_flops(parameters: int, tokens: int) -> float:
    """The frozen target's forward over ``tokens``: 2 FLOPs per parameter that ran, per token."""
    return 2.0 * parameters * tokens


def tapped_parameters(target, layer_ids: list[int], with_logits: bool = False) -> int:
    """Parameters of the target layers a tapped forward runs (it stops after the deepest tap), plus the LM head
    when it computes logits (online KL)."""
    ran = sum(p.numel() for layer in target.layers[: max(layer_ids) + 1] for p in layer.parameters())
    return ran + (target.lm_head.weight.numel() if with_logits else 0)
