"""How every draftsmith command ends on a user mistake: one line saying what and how to fix it."""

from __future__ import annotations

import os
from typing import Callable

# What our checks raise for bad input (missing/corrupt files, unknown keys, mismatched drafter and
# target, unsupported architectures...): all are these types or subclasses of them.
USER_ERRORS = (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError, OSError)


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main``; user errors exit with ``error: <message>`` (DRAFTSMITH_TRACEBACK=1 shows the traceback)."""
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except USER_ERRORS as e:
        if os.environ.get("DRAFTSMITH_TRACEBACK"):
            raise
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise SystemExit(f"error: {message}\n(set DRAFTSMITH_TRACEBACK=1 to see where it came from)") from None
