"""Stopping a run from outside, and starting it again: SIGTERM (what job schedulers send on preemption) handled
as Ctrl-C, deferred to the end of the step under way inside the loop (``train.loop.stop_due``); and the command
that resumes a run, as it was launched (``train.loop.interrupted_message`` prints it)."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from pathlib import Path


class Preempted(KeyboardInterrupt):
    """SIGTERM (what job schedulers send on preemption, and ``kill``): the run stops as Ctrl-C stops it, with the
    status a process ended by SIGTERM has (128 + 15)."""

    exit_status = 143
    what = "stopped by SIGTERM"


class StopRequest:
    """SIGTERM during training. Outside the loop it stops the run at once, as Ctrl-C does. Inside it (``deferring``)
    it is noted, and the loop stops at the end of the step under way with that step's state on disk
    (``train.loop.stop_due``); a second SIGTERM stops it at once."""

    def __init__(self):
        self.signalled = False
        self.deferring = False

    def handle(self, signum, frame) -> None:
        if self.deferring and not self.signalled:
            self.signalled = True
            return
        raise Preempted()


@contextlib.contextmanager
def sigterm_as_interrupt(stop: StopRequest):
    """SIGTERM handled by ``stop`` for the ``with`` block (the main thread only: elsewhere the default stays)."""
    import signal

    try:
        previous = signal.signal(signal.SIGTERM, stop.handle)
    except ValueError:  # not the main thread (a run started from a thread): nothing to install
        yield stop
        return
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- the resume command
def launch_command(world: int) -> str:
    """How this run was started, for the resume hint: ``draftsmith train``, ``python train/distill.py`` (the
    script, in the checkout), ``python -m train.distill``, ``draftsmith-distill``, under ``accelerate launch``
    with several processes. ``python -m train.distill`` where it cannot tell (called from Python): it works
    from any directory once the package is installed."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    script = sys.argv[0] if sys.argv else ""
    if spec is not None and spec.name == "train.distill":
        program = ["-m", "train.distill"]
    elif Path(script).name == "distill.py":
        program = [script]
    elif Path(script).name == "draftsmith-distill" and world == 1:
        return "draftsmith-distill"
    elif Path(script).name == "draftsmith":  # the draftsmith command, an executable: accelerate's --no_python
        launcher = ["accelerate", "launch", "--no_python", "--num_processes", str(world)] if world > 1 else []
        return shlex.join(launcher + ["draftsmith", "train"])
    else:
        program = ["-m", "train.distill"]
    launcher = ["accelerate", "launch", "--num_processes", str(world)] if world > 1 else ["python"]
    return shlex.join(launcher + program)


def resume_command(args: list[str], world: int) -> str:
    """The command that continues this run: the same arguments plus ``resume=true``."""
    kept = [a for a in args if a != "--resume" and not a.startswith(("resume=", "--resume="))]
    return " ".join([launch_command(world), *map(shlex.quote, kept), "resume=true"])


def launcher_note(world: int) -> str:
    """What the resume hint cannot rebuild: accelerate's own flags (a config file, several machines) do
    not reach the processes it starts, only their effects (these environment variables) do."""
    env = os.environ
    custom = any(env.get(k, "").lower() == "true" for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))
    nodes = env.get("WORLD_SIZE") not in (None, env.get("LOCAL_WORLD_SIZE"))
    if world > 1 and (custom or nodes):
        return ("\n  with the launcher flags the run was started with (--config_file, --num_machines, --machine_rank, "
                "--main_process_ip ...), on every node")
    return ""
