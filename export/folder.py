"""Write into a temporary folder next to ``--out``, move it into place only after every check passed.

A failed export leaves ``--out`` exactly as it was (absent, empty, or the user's files); one killed
between its two final renames is put right by the next export to the same ``--out``. An existing
non-empty ``--out`` is replaced only with ``--overwrite`` and only when it is itself a draftsmith
export (its config.json carries the ``draftsmith`` block or the DFlash architecture): we never
delete a folder we did not write.

An ``--out`` that is a symlink is written where it points (the link stays, pointing at the new export; an
earlier export there is replaced, not left behind). An ``--out`` that cannot be replaced as a whole (a mount
point: renaming or removing it fails with "Device or resource busy"; a folder whose parent is not writable)
is written in place: the export is staged in a hidden folder inside it and its files are moved in (the
previous export's files moved aside first, removed after).
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
from models.config_keys import ARCHITECTURES
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


IN_PLACE_STAGING = ".draftsmith-export."  # staging folders inside an --out written in place (+ 8 characters + .tmp)
IN_PLACE_OLD = ".draftsmith-old"  # the previous export's files while the new ones move in (in place)


def placed(out: Path) -> Path:
    """The folder an export to ``out`` writes: ``out`` itself, or where it points when it (or a folder above it)
    is a symlink. Renaming the link itself replaced the link with a folder and left the earlier export where the
    link had pointed (and a stray ``.NAME.old`` link beside it)."""
    return Path(os.path.realpath(out))


def in_place(folder: Path) -> bool:
    """Whether an existing folder is written in place: a mount point (it cannot be renamed or removed: EBUSY), or a
    folder whose parent we cannot write into (no staging folder beside it, no rename)."""
    return folder.is_dir() and (os.path.ismount(folder) or not os.access(folder.parent, os.W_OK | os.X_OK))


def contents(folder: Path) -> list[Path]:
    """What ``folder`` holds, less an in-place export's own hidden folders and a mount point's ``lost+found``."""
    mount = os.path.ismount(folder)
    return [p for p in folder.iterdir() if not p.name.startswith((IN_PLACE_STAGING, IN_PLACE_OLD))
            and not (mount and p.name == "lost+found")]


def check_out(out: Path, overwrite: bool, source: Path | None = None) -> None:
    """Refuse an ``--out`` we must not replace, before any work is done."""
    real = placed(out)
    recover_replaced(out)
    if real.exists() and not real.is_dir():
        raise FileExistsError(f"--out {out} is a file: pass a folder path")
    if source is not None and real == source.resolve():
        raise ValueError(f"--out {out} is the folder being exported: pass a new folder")
    refuse_training_output(out, "export", "export")
    if real != out.absolute():
        refuse_training_output(real, "export", "export")
    writable = real if in_place(real) else next(p for p in (real.parent, *real.parent.parents) if p.exists())
    if not os.access(writable, os.W_OK | os.X_OK):
        where = f"{out} (-> {real})" if real != out.absolute() else str(out)
        raise PermissionError(f"--out {where}: no permission to write into {writable}: pass a folder you can "
                              "write to")
    if real.is_dir() and contents(real):
        if not overwrite:
            raise FileExistsError(f"--out {out} exists and is not empty: pass a new folder, or --overwrite to "
                                  "replace an earlier export there")
        if not _is_export(real):
            raise FileExistsError(f"--out {out} holds files that are not a draftsmith export: --overwrite only "
                                  "replaces an earlier export; pass a new folder")
        kept = _not_written_by_export(real)
        if kept:  # the folder is replaced whole: a hand-written README.md (which push uploads as it is) was lost
            shown = ", ".join(kept[:8]) + (f" (+{len(kept) - 8} more)" if len(kept) > 8 else "")
            raise FileExistsError(f"--out {out} is an earlier export that also holds files an export does not write "
                                  f"({shown}): --overwrite would delete them; move them out of the folder (or delete "
                                  "them) and export again")


@contextmanager
def staging(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temp folder beside ``out`` (where a symlink ``out`` points); on success it replaces that folder, on
    any error it is removed. A folder that cannot be replaced whole (``in_place``) gets the files moved in."""
    given, out = out, placed(out)
    if in_place(out):
        with _staging_inside(given, out, overwrite) as tmp:
            yield tmp
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        yield tmp
        _share(tmp)
        if out.is_dir() and any(out.iterdir()):
            check_out(given, overwrite)
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


def _share(folder: Path) -> None:
    """mkdtemp (and some writers) make files private; an export is meant to be shared."""
    os.chmod(folder, 0o755)
    for f in folder.rglob("*"):
        if f.is_file():
            f.chmod(0o644)


@contextmanager
def _staging_inside(given: Path, out: Path, overwrite: bool) -> Iterator[Path]:
    """``staging`` for a folder written in place: stage in a hidden folder inside it, then move the previous
    export's files aside (``IN_PLACE_OLD``), the new ones in, and remove the old ones."""
    remove_stale_staging(out)
    tmp = Path(tempfile.mkdtemp(prefix=IN_PLACE_STAGING, suffix=".tmp", dir=out))
    try:
        yield tmp
        _share(tmp)
        check_out(given, overwrite)
        old = out / IN_PLACE_OLD
        shutil.rmtree(old, ignore_errors=True)
        old.mkdir()
        previous = contents(out)
        for f in previous:
            f.rename(old / f.name)
        moved = []
        try:
            for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):  # config.json last: it marks it
                f.rename(out / f.name)
                moved.append(out / f.name)
        except BaseException:  # put the previous export back; a kill is put right by the next export here
            for f in moved:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
            for f in previous:
                (old / f.name).rename(f)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def recover_replaced(out: Path) -> None:
    """Finish what an ``--overwrite`` export killed between its two renames left (``staging`` moves the
    previous export to ``.NAME.old``, then the new one to ``NAME``): the previous export goes back to
    ``out`` when nothing took its place; when the new one is in place, the old copy is removed."""
    out = placed(out)
    inside = out / IN_PLACE_OLD
    if inside.is_dir():  # an export written in place, killed while its files moved in
        if contents(out):
            shutil.rmtree(inside, ignore_errors=True)
        else:
            for f in inside.iterdir():
                f.rename(out / f.name)
            inside.rmdir()
            print(f"note: put the previous export back at {out} (an --overwrite export to it was cut before it "
                  "finished)", file=sys.stderr)
        return
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
    inside = re.compile(rf"{re.escape(IN_PLACE_STAGING)}[A-Za-z0-9_]{{8}}\.tmp")
    beside = [p for p in out.parent.iterdir() if shape.fullmatch(p.name)] if out.parent.is_dir() else []
    within = [p for p in out.iterdir() if inside.fullmatch(p.name)] if out.is_dir() else []
    for p in beside + within:
        if not p.is_dir():
            continue
        newest = max([p.stat().st_mtime] + [f.stat().st_mtime for f in p.rglob("*")])
        if time.time() - newest > STALE_AFTER_S:
            shutil.rmtree(p, ignore_errors=True)
