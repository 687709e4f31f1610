"""Prompt sets for ``python -m inference.validate``: the shipped ones, a JSONL file, or a data set.

``--prompts`` takes

- ``code`` / ``math`` / ``chat`` / ``long`` / ``all``: the sets shipped in ``inference/prompts/``
  (original prompts written for draftsmith; ``all`` = the four categories); several as ``code,math``;
- a ``.jsonl`` / ``.json`` / ``.parquet`` file or a folder (a ``datasets.save_to_disk`` folder too);
- a Hub data set id (``openai/gsm8k`` with ``--subset main --split test``, an mt-bench-like set...).

Rows are read by ``data.readers`` (openai ``messages``, ShareGPT ``conversations``, Alpaca,
``prompt``), plus ``question`` (gsm8k-like) and ``turns`` (mt-bench-like: the first turn). A row's
prompt is its conversation up to the first assistant turn; its category is the row's own
``category`` column, else the source's name. ``--n`` keeps the first N prompts of each category.
The prompts are rendered with the target's own chat template and an explicit thinking switch.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from data import readers
from data.chat import encode, render, require_chat_template
from data.readers import BadRow, detect_layout, to_messages

BUILTIN = ("code", "math", "chat", "long")


@dataclass
class Prompt:
    id: str
    category: str
    messages: list[dict]


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("inference.prompts") / f"{name}.jsonl"))


def _row_messages(row: dict) -> list[dict] | None:
    """The prompt turns of one raw row (None: no usable user turn)."""
    # a blank question or first turn is no prompt (measured as an empty user turn), as a blank message is not
    if isinstance(row.get("question"), str):
        return [{"role": "user", "content": row["question"]}] if row["question"].strip() else None
    turns = row.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return [{"role": "user", "content": turns[0]}] if turns[0].strip() else None
    try:
        msgs = to_messages(row, detect_layout(row), need_answers=False)
    except (BadRow, KeyError, TypeError, AttributeError):
        return None
    head: list[dict] = []
    for m in msgs:
        if m["role"] == "assistant":
            break
        head.append({"role": m["role"], "content": m["content"]})
    return head if head and head[-1]["role"] == "user" and head[-1]["content"].strip() else None


def _source_name(source: str) -> str:
    path = Path(source)
    return path.stem if path.suffix else source.rstrip("/").split("/")[-1]


def shipped_sets(spec: str) -> tuple[str, ...]:
    """The shipped sets ``--prompts`` names: one (``code``), ``all``, or several (``code,math``); () for anything
    else (a file, a folder, a Hub id). A list with a name that is no shipped set is refused, naming it."""
    if spec == "all":
        return BUILTIN
    if spec in BUILTIN:
        return (spec,)
    parts = [part.strip() for part in spec.split(",")]
    if len(parts) < 2 or Path(spec).expanduser().exists():
        return ()
    unknown = [part for part in parts if part not in BUILTIN + ("all",)]
    if unknown:
        raise FileNotFoundError(f"--prompts {spec}: {', '.join(map(repr, unknown))} is not a shipped prompt set "
                                f"(shipped: {', '.join(BUILTIN)} or all; several: code,math)")
    return tuple(name for name in BUILTIN if name in parts or "all" in parts)


def load_prompts(spec: str, n: int | None = None, split: str = "test", subset: str | None = None) -> list[Prompt]:
    """The prompts ``--prompts spec`` names, the first ``n`` per category; empty is an error."""
    if n is not None and n < 1:
        raise ValueError(f"--n {n}: give at least 1 prompt per category (or leave --n out for all of them)")
    names = shipped_sets(spec)
    local = Path(spec).expanduser()
    if not names and not local.exists() and (local.suffix in (".jsonl", ".json", ".parquet")
                                             or spec.startswith(("/", "./", "../", "~"))):
        # a path, not a Hub id (org/name): asking the Hub for it took retries and a misleading message
        raise FileNotFoundError(f"--prompts {spec}: no such file or folder (the shipped sets: {', '.join(BUILTIN)} "
                                "or all)")
    if not names and "/" not in spec and not local.exists():  # a mistyped set name
        raise FileNotFoundError(f"--prompts {spec!r} is not a shipped prompt set ({', '.join(BUILTIN)} or all), a "
                                "local file or folder, or a Hub data set id org/name")
    sources = [(str(builtin_path(name)), name) for name in names] or [(spec, _source_name(spec))]
    prompts: list[Prompt] = []
    per_category: Counter = Counter()
    skipped: Counter = Counter()
    first_at: dict[str, str] = {}  # where the first row of a reason is, for reasons the reader locates
    for source, default_category in sources:
        categorized = False  # whether any row so far names its category (then more categories may follow)
        for index, row in enumerate(readers.iter_source_rows(source, split=split, subset=subset)):
            if not isinstance(row, dict):
                why = str(row) if isinstance(row, BadRow) else "malformed JSON"
                skipped[why] += 1
                if getattr(row, "where", None):
                    first_at.setdefault(why, row.where)
                continue
            msgs = _row_messages(row)
            if msgs is None:
                skipped["no user turn"] += 1
                continue
            categorized = categorized or bool(row.get("category"))
            category = str(row.get("category") or default_category)
            if n is not None and per_category[category] >= n:
                continue
            per_category[category] += 1
            prompts.append(Prompt(str(row.get("id", f"{default_category}-{index}")), category, msgs))
            if n is not None and not categorized and per_category[default_category] >= n:
                break  # a set without categories is done at n: a Hub data set was read to its last row
    said = ", ".join(f"{k}: {v}" + (f", first at {first_at[k]}" if k in first_at else "") for k, v in skipped.items())
    if not prompts:
        raise ValueError(f"--prompts {spec}: no usable prompts (rows need messages/conversations with a user turn, "
                         "or a prompt, question or turns column)" + (f"; skipped {said}" if skipped else ""))
    if skipped:  # said, not silently dropped
        print(f"--prompts {spec}: skipped {sum(skipped.values())} row(s) ({said})", file=sys.stderr)
    return prompts


def prompt_set_hash(prompts: list[Prompt], thinking: str) -> str:
    """Identifies the prompt set (texts, order, thinking switch), whatever the tokenizer."""
    blob = json.dumps([[p.id, p.category, p.messages] for p in prompts] + [thinking], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def render_prompts(tokenizer, prompts: list[Prompt], thinking: str) -> list[list[int]]:
    """Token ids of each prompt through the target's chat template, generation prompt added."""
    if tokenizer is None:
        raise ValueError("the target folder has no tokenizer: validate renders prompts with the target's chat template")
    require_chat_template(tokenizer, "the target", "; validate's prompts are chat turns")
    return [encode(tokenizer, render(tokenizer, p.messages, add_generation_prompt=True, thinking=thinking == "on"))
            for p in prompts]
