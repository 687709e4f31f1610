"""Host-to-GPU copies that do not wait for the GPU.

A copy from pageable host memory to a GPU makes the host wait for every kernel already queued on the
stream, ``non_blocking=True`` or not: the CUDA driver stages pageable memory through its own pinned
buffer and may synchronize with the stream to do so. In the training step that wait is the same bubble
as a read back (the GPU runs dry while the host queues the next kernels). Copied from pinned memory, the
transfer is queued like a kernel; PyTorch's caching host allocator keeps the pinned block until the
copy has run.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``, queued without the host waiting (a host tensor bound for a GPU goes through
    pinned memory; anything else is ``t.to(device, non_blocking=True)``)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
