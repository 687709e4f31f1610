"""Write into a temporary folder next to ``--out``, move it into place only after every check passed.

A failed export leaves ``--out`` exactly as it was (absent, empty, or the user's files); one killed
between its two final renames is put right by the next export to the same ``--out``. An existing
non-empty ``--out`` is replaced only with ``--overwrite`` and only when it is itself a draftsmith
export (its config.json carries the ``draftsmith`` block or the DFlash architecture): we never
delete a folder we did not write.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from export.card import MARKER
from export.push import sort_files
from models.config import ARCHITECTURES
from models.provenance import refuse_training_output


def _is_export(folder: Path) -> bool:
    try:
        d = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    names = set(d.get("architectures") or []) if isinstance(d, dict) else set()
    return isinstance(d, dict) and ("draftsmith" in d or bool(names & set(ARCHITECTURES.values())))


def _not_written_by_export(folder: Path) -> list[str]:
    """Files in an earlier export that no export writes (``export.push.sort_files``), and a README.md that is
    not push's generated card."""
    written, other = sort_files(folder)
    readme = folder / "README.md"
    if "README.md" in written and MARKER not in readme.read_text(errors="replace"):
        other = ["README.md (not written by draftsmith)", *other]
    return other


def check_out(out: Path, overwrite: bool, source: Path | None = None) -> None:
    """Refuse an ``--out`` we must not replace, before any work is done."""
    recover_replaced(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: pass a folder path")
    if source is not None and out.resolve() == source.resolve():
        raise ValueError(f"--out {out} is the folder being exported: pass a new folder")
    refuse_training_output(out, "export", "export")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"--out {out} exists and is not empty: pass a new folder, or --overwrite to "
                                  "replace an earlier export there")
        if not _is_export(out):
            raise FileExistsError(f"--out {out} holds files that are not a draftsmith export: --overwrite only "
                                  "replaces an earlier export; pass a new folder")
        kept = _not_written_by_export(out)
        if kept:  # the folder is replaced whole: a hand-written README.md (which push uploads as it is) was lost
            shown = ", ".join(kept[:8]) + (f" (+{len(kept) - 8} more)" if len(kept) > 8 else "")
            raise FileExistsError(f"--out {out} is an earlier export that also holds files an export does not write "
                                  f"({shown}): --overwrite would delete them; move them out of the folder (or delete "
                                  "them) and export again")


@contextmanager
def staging(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temp folder beside ``out``; on success it replaces ``out``, on any error it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp (and some writers) make files private; an export is meant to be shared
        for f in tmp.rglob("*"):
            if f.is_file():
                f.chmod(0o644)
        if out.is_dir() and any(out.iterdir()):
            check_out(out, overwrite)
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:  # an error here puts the previous export back; a kill is put right next time
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            if out.is_dir():
                out.rmdir()
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def recover_replaced(out: Path) -> None:
    """Finish what an ``--overwrite`` export killed between its two renames left (``staging`` moves the
    previous export to ``.NAME.old``, then the new one to ``NAME``): the previous export goes back to
    ``out`` when nothing took its place; when the new one is in place, the old copy is removed."""
    old = out.with_name(f".{out.name}.old")
    if not (old.is_dir() and _is_export(old)):
        return
    if out.is_dir() and any(out.iterdir()):
        shutil.rmtree(old, ignore_errors=True)  # cut after the new export moved in: the old copy is garbage
        return
    if out.is_dir():
        out.rmdir()
    old.rename(out)
    print(f"note: put the previous export back at {out} (an --overwrite export to it was cut before it "
          f"finished, leaving it as {old.name})", file=sys.stderr)


STALE_AFTER_S = 3600  # a staging folder untouched this long belongs to no running export


def remove_stale_staging(out: Path) -> None:
    """Remove the staging folders a killed export to ``out`` left (a drafter's size each): exactly this
    folder's name and mkdtemp's 8 random characters (``.drafter.x`` is not ``.drafter.mlx-q4.x``), and
    nothing written for an hour (a concurrent export's staging folder is being written)."""
    shape = re.compile(rf"\.{re.escape(out.name)}\.[A-Za-z0-9_]{{8}}\.tmp")
    for p in out.parent.iterdir() if out.parent.is_dir() else []:
        if not (p.is_dir() and shape.fullmatch(p.name)):
            continue
        newest = max([p.stat().st_mtime] + [f.stat().st_mtime for f in p.rglob("*")])
        if time.time() - newest > STALE_AFTER_S:
            shutil.rmtree(p, ignore_errors=True)
