"""When a prepared-data folder may be re-used, rebuilt, or must be refused.

A prepared folder (``python -m data.prepare --out DIR``, or ``out_dir/data`` of a training run)
records in ``draftsmith_data.json`` every setting that changes its rows: the source (and, for a
local source, its size and modification time and a hash of its content), split, subset, limit,
regeneration mode and generation settings, thinking switch, max length, packing and the tokenizer. While it is being
built, ``draftsmith_data.partial.json`` records the same settings, so an interrupted
regeneration is recognised and resumed.

- A folder with the same settings is re-used as it is. A local source is the same when its size and
  modification time are, or else when its content is: a run folder moved or copied elsewhere (the tiny
  recipe's source lives inside it), or a source copied to a node's local disk, is still recognised.
- Other settings are refused with the differences named, unless a rebuild is asked for
  (``data.rebuild=true`` / ``--rebuild``). A rebuild keeps the regenerated answers
  (``regenerated.jsonl``) when the regeneration settings did not change: they are keyed by a hash
  of each conversation, so a changed source only regenerates the conversations that are new.
- A non-empty folder that is neither (a drafter folder, a home directory) is never written into.
- A failed build leaves no empty folder behind; it keeps one that holds regenerated answers, so a
  rerun resumes them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from data.chat import LABEL_RULES, LABEL_RULES_BEFORE_RECORDED
from models.support import UserError

META_FILE = "draftsmith_data.json"
PARTIAL_FILE = "draftsmith_data.partial.json"
STATS_FILE = "stats.json"
REGEN_FILE = "regenerated.jsonl"
CACHE_DIR = ".prepare-cache"
LOCK = ".prepare.lock"  # data.prepare holds it while it writes the folder (models.support)
# Settings that change the prepared rows, compared on re-use (in this order in messages).
ROW_SETTINGS = ("source", "source_fingerprint", "split", "subset", "limit", "regenerate", "answers_by", "generation",
                "thinking", "max_length", "packed", "tokenizer_hash", "label_rules")
# Settings that change the regenerated answers themselves (answers_by: the local regenerating target).
REGEN_SETTINGS = ("regenerate", "answers_by", "generation", "thinking", "tokenizer_hash")
FIX = ("rebuild it with the new settings (data.rebuild=true, or --rebuild for python -m data.prepare), or choose "
       "another folder (data.prepared=DIR, or --out DIR)")


class DataMismatch(UserError, ValueError):
    """Prepared data made with other settings, for another tokenizer, or by another target."""


class NotPreparedFolder(UserError, ValueError):
    """A non-empty folder that draftsmith did not write: never written into."""


def regenerate_mode(spec: str | None) -> str | None:
    """What a regeneration setting means for the rows: None, local, vllm, sglang or server (any URL).

    The URL itself is not compared: the same target behind another address gives the same answers.
    """
    if spec in (None, "", "none"):
        return None
    return "server" if str(spec).startswith(("http://", "https://")) else str(spec)


def source_fingerprint(source: str) -> str | None:
    """Size and modification time of a local source (file or folder); None for a Hub id."""
    path = Path(source).expanduser()
    if path.is_file():
        st = path.stat()
        return f"{st.st_size}:{st.st_mtime_ns}"
    if path.is_dir():
        parts = sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                       for p in path.rglob("*") if p.is_file())
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_content(source: str) -> str | None:
    """A hash of a local source's bytes (a folder's: of its files' names and bytes, hidden ones such as
    ``.git`` left out); None for a Hub id. Read only when building a folder, or when the cheap size and
    modification time check fails, so a multi-GB source is not hashed at every start."""
    path = Path(source).expanduser()
    if path.is_file():
        return _file_sha256(path)[:16]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        parts = [(str(p.relative_to(path)), _file_sha256(p)) for p in files]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return None


def with_content(wanted: dict) -> dict:
    """``wanted`` with the source's content hash filled in (once: the dict keeps it)."""
    if "source_content" not in wanted:
        wanted["source_content"] = source_content(wanted["source"])
    return wanted


def row_settings(*, source: str, split: str, subset: str | None, limit: int | None, regenerate: str | None,
                 thinking: bool | None, max_length: int | None, pack: bool, tokenizer_hash: str,
                 gen_kwargs: dict | None = None) -> dict:
    """The settings recorded in, and compared against, a prepared folder."""
    mode = regenerate_mode(regenerate)
    gen = gen_kwargs or {}
    generation = ({"max_tokens": gen.get("max_tokens"), "temperature": gen.get("temperature", 0.0)}
                  if mode else None)
    return {"source": str(source), "source_fingerprint": source_fingerprint(str(source)), "split": split,
            "subset": subset, "limit": limit, "regenerate": mode, "generation": generation, "thinking": thinking,
            "max_length": max_length, "packed": bool(pack), "tokenizer_hash": tokenizer_hash,
            "label_rules": LABEL_RULES}


def same_source(recorded: dict, wanted: dict) -> bool:
    """The same path with the same size and mtime, or (recorded by a folder of this version) the same
    content wherever it now lives."""
    if recorded.get("source") == wanted.get("source") and \
            recorded.get("source_fingerprint") == wanted.get("source_fingerprint"):
        return True
    if recorded.get("source_content") is None or wanted.get("source_fingerprint") is None:
        return False  # a Hub id, or a folder prepared before contents were hashed
    return recorded["source_content"] == with_content(wanted)["source_content"]


def settings_diff(recorded: dict, wanted: dict, keys=ROW_SETTINGS) -> list[str]:
    """``key: old -> new`` for every setting that differs. Keys a folder did not record are not compared
    (folders prepared before they were recorded), except the labelling rules: a folder that did not record
    them was labelled by the first ones."""
    diff = []
    for key in keys:
        if key == "label_rules" and key in wanted:
            rules = label_rules_of(recorded)
            if rules != wanted[key]:
                diff.append(f"labelling rules: version {rules} -> {wanted[key]} (prepared by "
                            f"{'an older' if rules < wanted[key] else 'a newer'} draftsmith, whose loss labels "
                            "differ; a rebuild keeps the regenerated answers)")
            continue
        if key not in recorded or recorded[key] == wanted.get(key):
            continue
        if key in ("source", "source_fingerprint"):
            if same_source(recorded, wanted):
                continue
            if key == "source_fingerprint":
                if recorded.get("source") == wanted.get("source"):  # else the path's own line says it
                    diff.append(f"source {wanted['source']!r} changed since it was prepared (its content differs)"
                                if recorded.get("source_content") else
                                f"source {wanted['source']!r} changed since it was prepared (size:mtime "
                                f"{recorded[key]} -> {wanted[key]})")
                continue
        label = {"packed": "pack", "answers_by": "regenerating target"}.get(key, key)
        diff.append(f"{label}: {recorded[key]!r} -> {wanted.get(key)!r}")
    return diff


def label_rules_of(meta: dict) -> int:
    """The labelling rules' version a prepared folder was labelled by (folders that did not record it: the first)."""
    return meta.get("label_rules", LABEL_RULES_BEFORE_RECORDED)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def reusable(out: Path, wanted: dict) -> bool:
    """True when ``out`` is a finished prepared folder with exactly these settings."""
    meta = read_json(out / META_FILE)
    return meta is not None and not settings_diff(meta, wanted)


def refuse_folder(out: Path, wanted: dict, rebuild: bool, keys=ROW_SETTINGS) -> dict | None:
    """Refuse an ``out`` a build with ``wanted`` settings must not write into (a file, a folder draftsmith did not
    write, data prepared with other settings among ``keys`` unless ``rebuild``); writes nothing. Returns the
    settings the folder records (None: new, empty, or only what a failed regeneration left; {}: its record is
    unreadable and ``rebuild`` was asked)."""
    if out.exists() and not out.is_dir():
        raise NotPreparedFolder(f"{out} is a file, not a folder: choose a new or empty folder for the prepared data")
    recorded = (read_json(out / META_FILE) or read_json(out / PARTIAL_FILE)) if out.is_dir() else None
    unreadable = [out / name for name in (META_FILE, PARTIAL_FILE) if recorded is None and (out / name).is_file()]
    if unreadable:  # ours, but its settings are unknown: it was refused as "not a prepared-data folder"
        if not rebuild:
            raise DataMismatch(f"{unreadable[0]} is not readable JSON (cut short, or edited by hand), so the "
                               f"settings {out} was prepared with are unknown: {FIX}")
        return {}  # rebuilt from scratch: no answers kept, their settings are unknown too
    ours = {REGEN_FILE, REGEN_FILE + ".failed.jsonl", "regenerate-server.log",  # left by a failed regeneration
            LOCK}  # held by the data.prepare command that calls this
    if recorded is None and out.is_dir() and any(p.name not in ours for p in out.iterdir()):
        raise NotPreparedFolder(
            f"{out} is not empty and is not a prepared-data folder (no {META_FILE}): draftsmith does not write "
            "into it. Choose a new or empty folder (data.prepared=DIR, or --out DIR)")
    if recorded is not None:
        diff = settings_diff(recorded, wanted, keys)
        if diff and not rebuild:
            state = "prepared" if (out / META_FILE).exists() else "partly prepared"
            raise DataMismatch(f"{out} holds data {state} with other settings ({'; '.join(diff)}): {FIX}")
    return recorded


def claim_folder(out: Path, wanted: dict, rebuild: bool) -> None:
    """Make ``out`` ready for a build with ``wanted`` settings, or refuse (see the module docstring).

    Writes the partial marker, so from here on the folder is recognised as ours.
    """
    recorded = refuse_folder(out, wanted, rebuild)
    if recorded is not None:
        clear(out, keep_answers=bool(recorded) and not settings_diff(recorded, wanted, REGEN_SETTINGS))
    out.mkdir(parents=True, exist_ok=True)
    (out / PARTIAL_FILE).write_text(json.dumps(with_content(wanted), indent=2))


def clear(out: Path, keep_answers: bool) -> None:
    """Remove what a build of ours wrote (never other files); keep ``regenerated.jsonl`` if asked."""
    names = [META_FILE, PARTIAL_FILE, STATS_FILE, "state.json", "dataset_info.json", REGEN_FILE + ".failed.jsonl"]
    if not keep_answers:
        names.append(REGEN_FILE)
    for name in names:
        (out / name).unlink(missing_ok=True)
    for shard in out.glob("data-*-of-*.arrow"):
        shard.unlink()
    shutil.rmtree(out / CACHE_DIR, ignore_errors=True)


def has_answers(out: Path) -> bool:
    path = out / REGEN_FILE
    return path.is_file() and path.stat().st_size > 0


def clean_failed(out: Path, created: bool) -> None:
    """After a failed build: remove a folder we created unless it holds answers worth resuming."""
    shutil.rmtree(out / CACHE_DIR, ignore_errors=True)
    if not out.is_dir() or (out / META_FILE).exists():
        return
    if has_answers(out):
        return  # the partial marker stays: a rerun recognises the folder and resumes
    (out / PARTIAL_FILE).unlink(missing_ok=True)
    (out / (REGEN_FILE + ".failed.jsonl")).unlink(missing_ok=True)
    (out / REGEN_FILE).unlink(missing_ok=True)
    if created and not any(out.iterdir()):
        out.rmdir()
