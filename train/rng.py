"""Every random stream of a training run, in one place.

Two streams decide what a run trains on, and both are pure functions of their inputs (no shared
generator state), so the data-order state of a run is just ``(epoch, step in epoch)``:

* the data order of epoch ``e``: a permutation drawn from ``(seed, e)`` (:func:`epoch_order`);
* the anchors of a row: one generator per ``(seed, epoch, row)`` (:func:`row_generators`), so a
  row's blocks do not depend on the batch size, gradient accumulation or process count, and a
  resumed run draws exactly the anchors an uninterrupted one would. Held-out rows use
  ``(seed, "eval", row)``: the same blocks at every evaluation.
"""

from __future__ import annotations

import hashlib

import torch


def stream_seed(*parts) -> int:
    """A 63-bit seed from any parts (seed, epoch, step, rank...): independent streams, no shared state."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def epoch_order(n: int, seed: int, epoch: int, rank: int, world: int) -> list[int]:
    """This process's share of epoch ``epoch``'s permutation (equal share per process)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
    perm = perm[: len(perm) - len(perm) % world] if world > 1 else perm
    return perm[rank::world]


def row_generators(seed: int, epoch: int | str, rows) -> list[torch.Generator]:
    """One anchor generator per data row (``epoch="eval"`` for held-out rows)."""
    return [torch.Generator().manual_seed(stream_seed(seed, epoch, int(r))) for r in rows]
