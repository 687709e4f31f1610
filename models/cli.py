"""How every draftsmith command ends on a user mistake: one line saying what and how to fix it.

A *user error* is one of the project's own error types (all subclass :class:`UserError`), a
``ValueError`` raised by one of our checks, or a clear OS error (missing file, no permission,
unreachable host). Everything else (``TypeError``, ``KeyError``, ``IndexError``,
``AttributeError``, ``RuntimeError`` from torch...) is a bug in draftsmith or a library and keeps
its full traceback, so it can be reported and fixed instead of hiding behind a one-liner.
"""

from __future__ import annotations

import os
from collections.abc import Callable


class UserError(Exception):
    """Base of every draftsmith error that means "your input is wrong; here is the fix".

    Project error types inherit from it *and* from the builtin type they behave like
    (``class ConfigKeyError(UserError, KeyError)``), so existing ``except KeyError`` still works.
    """


# Why ValueError is in: the project's checks raise it for bad values everywhere (a wrong layer id,
# an empty path), and a library ValueError almost always comes from a value the user passed.
# Why TypeError/KeyError are out: from our own code they are nearly always bugs (a wrong call,
# a missing dict key), and their one-line form ("error: 'input_ids'") says nothing useful.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
    PermissionError, ConnectionError, TimeoutError,
)


def is_user_error(e: BaseException) -> bool:
    """True for errors that end a command with one line (see the module docstring)."""
    if isinstance(e, USER_ERRORS):
        return True
    # A bare OSError raised by our own checks (hub fetch, data set download) carries its message;
    # OSError subclasses not listed above (BrokenPipe, ChildProcessError...) are environment
    # trouble too, and their message names the file or host.
    return type(e) is OSError and bool(e.args)


# The dtype names every command takes: torch's and MLX's own (float32, bfloat16, float16) and the short
# ones training's keys and the exports spell (fp32, bf16, fp16). One table, so `--dtype bf16` works
# wherever `target.dtype=bf16` does (it was getattr(torch, "bf16"): an AttributeError traceback).
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}


def parse_dtype(name: str | None, flag: str = "--dtype", auto: bool = False) -> str | None:
    """A dtype flag's value as torch and MLX name it (``bf16`` -> ``bfloat16``); None stays None, and
    ``auto`` too where the command has it (``auto=True``)."""
    if name is None or (auto and name == "auto"):
        return name
    canonical = DTYPE_NAMES.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"{flag} {name!r} is not a compute dtype draftsmith runs in: use one of float32, bfloat16, "
                         f"float16 (or fp32, bf16, fp16){' or auto' if auto else ''}")
    return canonical


class DeviceNameError(UserError, ValueError):
    """A ``--device`` value that names no device at all (a typo), as opposed to one this machine lacks."""


def check_device(device: str | None, flag: str = "--device", kinds: tuple[str, ...] = ("cpu", "cuda", "mps"),
                 auto: bool = False) -> str | None:
    """A torch ``--device`` checked before any weights load: a malformed name (:class:`DeviceNameError`), CUDA or
    MPS that torch does not see, or a GPU index past the last one is one line, not torch's RuntimeError
    traceback after the target loaded. None stays None (the command's default), and ``auto`` where the
    command has it."""
    if device is None or (auto and device == "auto"):
        return device
    kind, colon, index = str(device).partition(":")
    if kind not in kinds or (colon and not (kind == "cuda" and index.isdigit())):
        names = [k + (" (cuda:N for another GPU)" if k == "cuda" else "") for k in kinds] + (["auto"] if auto else [])
        choices = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise DeviceNameError(f"{flag} {device!r}: use {choices}, or leave it out")
    import torch

    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{flag} {device} but torch sees no CUDA device: use {flag} cpu (or leave {flag} out)")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"{flag} {device}: torch sees {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} mps but torch sees no MPS (Apple GPU) device: use {flag} cpu (or leave {flag} out)")
    return device


def run_cli(main: Callable[[], object], interrupted: str | None = None) -> None:
    """Run ``main``; user errors exit with ``error: <message>`` (DRAFTSMITH_TRACEBACK=1 shows the traceback).

    Ctrl-C exits with status 130 after ``interrupted: <what happens on a rerun>`` when the command says
    (training prints its own resume command)."""
    import sys

    try:
        main()
        sys.stdout.flush()  # inside the try: a closed pipe shows up here when the output was buffered
    except KeyboardInterrupt:
        if interrupted:
            print(f"interrupted: {interrupted}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            # `draftsmith-distill --help | head`: the reader has gone. Quiet, as shell tools are; devnull
            # takes what is still buffered so the interpreter's own flush at exit does not complain either.
            # (Another broken pipe, a regeneration server's socket, is an error like any other below.)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None
        if not is_user_error(e) or os.environ.get("DRAFTSMITH_TRACEBACK"):
            raise
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise SystemExit(f"error: {message}\n(set DRAFTSMITH_TRACEBACK=1 to see where it came from)") from None


def _stdout_closed() -> bool:
    """True when nobody reads our standard output any more (the far end of its pipe was closed)."""
    import select
    import sys

    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    if not hasattr(select, "poll"):  # Windows: no way to ask; a broken pipe there is stdout's in practice
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))
