"""Resumable validation: each measured prompt is appended to ``--out/partial.jsonl`` as it finishes.

A validate run of many prompts and repeats takes a while on a laptop; when it is interrupted (Ctrl-C,
a closed lid, a crash), the same command measures only the prompts that are missing. The file's
first line records a hash of every setting that changes the numbers (target, drafter and its
weights, backend, dtype, block size, prompts, tokens, temperature, repeats, seed, versions) and the
settings themselves; a file written with other settings is set aside as ``partial.jsonl.old`` (earlier
ones shifted to ``.old.1`` ...), never mixed in, and the note names the settings that differ. The
finished report replaces the file.

Only one run writes into a folder at a time (``LOCK``, held by validate through ``models.support.hold``): two
runs sharing ``partial.jsonl`` would set each other's rows aside or append to one file, and the first to
finish would delete the other's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from inference.report import PromptRun
from inference.stats import GenerationResult
from models.support import set_aside

PARTIAL = "partial.jsonl"
LOCK = ".validate.lock"


def settings_key(environment: dict) -> str:
    """Hash of the report's environment as it stands before measuring (no time, no peak memory yet)."""
    return hashlib.sha256(json.dumps(environment, sort_keys=True, default=str).encode()).hexdigest()[:16]


def differing(old: dict | None, new: dict | None) -> list[str]:
    """Names of the settings that differ between two recorded environments (sorted)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return []
    norm = lambda v: json.dumps(v, sort_keys=True, default=str)  # noqa: E731  (as settings_key hashes them)
    return sorted(k for k in old.keys() | new.keys() if norm(old.get(k)) != norm(new.get(k)))


def load(out: str | Path, key: str, log, settings: dict | None = None) -> dict[int, tuple[PromptRun, dict]]:
    """Prompts measured earlier with these settings: position in the prompt set -> (run, its peak memory).

    ``settings``: the environment ``key`` hashes; a file written with other settings is set aside, and the
    note names the settings that differ (files of earlier versions recorded only the hash)."""
    path = Path(out) / PARTIAL
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    try:
        head = json.loads(lines[0]) if lines else {}
    except ValueError:
        head = {}
    if not isinstance(head, dict):
        head = {}
    if head.get("settings") != key:
        old = set_aside(path)
        keys = differing(head.get("environment"), settings)
        what = f"other settings ({', '.join(keys)} differ)" if keys else "other settings"
        log(f"note: {path} was measured with {what}: set aside as {old.name}, starting over")
        return {}
    done = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
        except ValueError:  # the line being written when the run stopped
            continue
        results = {mode: [GenerationResult(**r) for r in row[mode]] for mode in ("dflash", "baseline")}
        run = PromptRun(row["id"], row["category"], row["prompt_tokens"], results["dflash"], results["baseline"])
        done[int(row["index"])] = (run, row["peaks"])
    return done


class Recorder:
    """Appends each finished prompt (and creates the file with its settings line first)."""

    def __init__(self, out: str | Path, key: str, settings: dict | None = None):
        self.path = Path(out) / PARTIAL
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.is_file():  # the settings beside their hash: a later run names those that differ
            head = {"settings": key} if settings is None else {"settings": key, "environment": settings}
            self.path.write_text(json.dumps(head, sort_keys=True, default=str) + "\n")
        else:  # a row cut short by the kill: end its line, or the next row is glued to it and lost too
            with open(self.path, "rb+") as f:
                size = f.seek(0, 2)
                if size:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        f.write(b"\n")

    def __call__(self, index: int, run: PromptRun, peaks: dict) -> None:
        row = {"index": index, "id": run.id, "category": run.category, "prompt_tokens": run.prompt_tokens,
               "dflash": [asdict(r) for r in run.dflash], "baseline": [asdict(r) for r in run.baseline],
               "peaks": peaks}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)
