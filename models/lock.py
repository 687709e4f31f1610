"""Output folders that never lose work: one writer at a time (``hold``), earlier results set aside (``set_aside``).

Two validate runs into one ``--out`` shared ``partial.jsonl`` (the first to finish deleted the other's rows);
two training runs into one ``out_dir`` (the same command in two terminals, a requeued job while the old one
still runs) wrote the same checkpoints and metrics. The second is refused with the holder's pid.

The OS drops the lock when the process ends, however it ends, so a crashed run never blocks the next; the file
itself stays (removing it would race a run that just opened it), unless the command created the folder and
wrote nothing else there, never wrote the one file it guards, or created the lock file and ended in an error
(a refusal of a folder that is not its own): a mistake leaves nothing behind. POSIX only (Linux, macOS);
elsewhere, and on file systems without ``flock`` (some cluster mounts), runs are not kept apart and a note
says so.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def hold(folder: str | Path, name: str, flag: str, fix: str,
         log: Callable[[str], None] | None = None, output: Path | None = None) -> Iterator[Path]:
    """Create ``folder`` and lock ``folder/name`` for the ``with`` block. ``flag`` names the folder's setting in
    the errors (``--out``, ``out_dir``); ``fix`` ends the one refusing a second writer. ``output`` is the one
    file guarded, when that is what the command writes (``--out answers.jsonl``): the errors name it, and the
    lock goes at the end if it was never written."""
    folder = Path(folder)
    what = f"{flag} {output or folder}"
    created = not folder.exists()
    fresh = created or not (folder / name).exists()  # this command's own lock file, not one an earlier run left
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / name, "a+")
    except OSError as e:  # a file in the path, a read-only mount: said now, not after the models load
        raise ValueError(f"{what}: cannot write there ({e.strerror or e}); give a folder you can write "
                         "to") from None
    with handle:
        try:
            import fcntl
        except ImportError:
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                raise ValueError(f"{what} is in use by another run (pid {holder}): {fix}") from None
            except OSError as e:
                if log:
                    log(f"note: {folder / name} cannot be locked on this file system ({e.strerror or e}): a second "
                        "run into the same folder is not refused")
            else:
                handle.seek(0)
                handle.truncate()
                handle.write(f"{os.getpid()}\n")
                handle.flush()
        failed = False
        try:
            yield folder
        except BaseException:
            failed = True
            raise
        finally:  # a command refused before it wrote anything leaves no folder holding only the lock, and a
            # refusal of someone else's folder (not prepared data, not a store) leaves no lock file in it
            if (output is not None and not output.exists()) or (failed and fresh):
                (folder / name).unlink(missing_ok=True)
            if created and not [p for p in folder.iterdir() if p.name != name]:
                (folder / name).unlink(missing_ok=True)
                folder.rmdir()


KEEP_OLD = 5  # set-aside files kept: NAME.old (the newest), .old.1, ... .old.4 (the oldest)


def set_aside(path: Path) -> Path:
    """Move ``path`` to ``<name>.old``, first shifting earlier ones to ``.old.1``, ``.old.2``, ...: an earlier
    set-aside file (hours of measurements, maybe) is never overwritten; only the oldest beyond ``KEEP_OLD`` goes."""
    olds = [path.with_name(f"{path.name}.old" + (f".{i}" if i else "")) for i in range(KEEP_OLD)]
    olds[-1].unlink(missing_ok=True)
    for newer, older in zip(reversed(olds[:-1]), reversed(olds[1:])):
        if newer.is_file():
            newer.replace(older)
    path.replace(olds[0])
    return olds[0]
