"""Work that only the main process does, with every process leaving together, or failing together.

Under ``accelerate launch`` the main process prepares the data while the others wait at a barrier.
If the main process fails before the barrier, the others would wait there forever; so the main
process always reaches the collective, carrying either "done" or its error, and the other
processes raise that error instead of hanging. Works with one process (no collective at all),
and with gloo or NCCL process groups (``torch.distributed.broadcast_object_list``).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from models.cli import UserError

T = TypeVar("T")


class MainProcessFailed(UserError, RuntimeError):
    """Raised on the other processes when the main process failed (its own error is raised there)."""


def _group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def run_on_main(fn: Callable[[], T], accelerator=None, what: str = "the main process's work") -> T | None:
    """Run ``fn`` on the main process only; returns its result there (None elsewhere).

    Every process returns after ``fn`` finished on the main process; if it raised (Ctrl-C included),
    the main process re-raises it and every other process raises :class:`MainProcessFailed`.
    """
    dist = _group()
    is_main = accelerator.is_main_process if accelerator is not None else (dist is None or dist.get_rank() == 0)
    result, error = None, None
    if is_main:
        try:
            result = fn()
        except BaseException as e:  # reach the collective first, then raise
            error = e
    if dist is not None:
        message = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(message, src=0)
        if error is None and message[0] is not None:
            raise MainProcessFailed(f"{what} failed on the main process ({message[0]}); see its output for details")
    if error is not None:
        raise error
    return result
