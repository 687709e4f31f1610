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
