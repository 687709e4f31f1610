"""Chat data set readers: every supported layout becomes one conversation form.

A conversation is ``{"id": str, "key": str, "messages": [{"role", "content"[, "reasoning_content"]}, ...]}``
with roles ``system`` / ``user`` / ``assistant``. ``id`` is the row's position in the source
(``"17"``); ``key`` is a hash of the conversation's prompts (:func:`conversation_key`), what
resumable regeneration keys on, so an edited or re-ordered source never re-uses another row's
answers. The source's own id, if it has one, is kept as ``source_id``.

Layouts (detected per row, or forced with ``layout=``):

- ``openai``:    ``messages: [{role, content}]`` (system and multi-turn included)
- ``sharegpt``:  ``conversations: [{from, value}]`` (``human``/``gpt``/``system``; role/content also read)
- ``alpaca``:    ``instruction``, optional ``input``, ``output`` (Alpaca, CodeAlpaca); optional ``system``
- ``nemotron``:  NVIDIA post-training layout: ``input`` (a list of role/content messages, or a
  string), ``output`` (string, may hold ``<think>...</think>``), optional ``system_prompt``
- ``prompt``:    ``prompt`` (a string): prompts only, read when answers are regenerated

Prompts-only data (no assistant turn: ``prompt`` rows, Alpaca without ``output``, messages that
end with the user) is usable when the answers are regenerated anyway (``need_answers=False``):
the conversation gets one empty assistant turn at the end, which regeneration fills in.

Sources: a local ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder written by
``datasets.save_to_disk``, a folder of such files, or a Hub data set id (``org/name``, read with
``datasets.load_dataset`` with ``split`` / ``subset`` / ``streaming``). A folder of files named by split
(``train.jsonl`` beside ``test.jsonl``) gives only ``split``'s files.

Bad rows (malformed JSON, a line that is not UTF-8, no assistant turn, empty content, unknown roles,
unknown layout) are skipped and counted by reason; :class:`ReadStats` prints the summary. A source with no usable
row raises :class:`NoUsableRows`, so a wrong column layout cannot silently train on nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from models.support import UserError

LAYOUTS = ("openai", "sharegpt", "alpaca", "nemotron", "prompt")
ROLE_ALIASES = {
    "system": "system", "user": "user", "assistant": "assistant",
    "human": "user", "gpt": "assistant", "chatgpt": "assistant", "bot": "assistant", "model": "assistant",
}
ID_COLUMNS = ("id", "uuid", "conversation_id", "idx")


class BadRow(ValueError):
    """A row that cannot become a conversation; the message is the reason counted in the summary.

    ``where`` (``"FILE line N"``), when set, is named in the summary for the first row of its reason, so a
    row the reader could not even decode can be found and fixed."""

    def __init__(self, reason: str, where: str | None = None):
        super().__init__(reason)
        self.where = where


class NoUsableRows(UserError, ValueError):
    pass


class SplitNotFound(UserError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return self.args[0]


@dataclass
class ReadStats:
    """Rows seen, kept, and skipped by reason."""

    seen: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    layouts: Counter = field(default_factory=Counter)
    first_at: dict = field(default_factory=dict)  # reason -> where its first row is (reasons that say where)

    def skip(self, why: BadRow | str) -> None:
        self.skipped[str(why)] += 1
        if getattr(why, "where", None):
            self.first_at.setdefault(str(why), why.where)

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {why}" + (f" (first: {self.first_at[why]})" if why in self.first_at else "")
                            for why, n in self.skipped.most_common()) or "none"
        layouts = ", ".join(f"{k}={v}" for k, v in self.layouts.most_common()) or "-"
        return f"read {self.seen} rows: kept {self.kept} (layouts {layouts}); skipped {self.skipped.total()}: {reasons}"

    def as_dict(self) -> dict:
        out = {"seen": self.seen, "kept": self.kept, "skipped": dict(self.skipped), "layouts": dict(self.layouts)}
        return {**out, "first_at": dict(self.first_at)} if self.first_at else out


# ----------------------------------------------------------------------------- layouts
def detect_layout(row: dict) -> str:
    if "messages" in row:
        return "openai"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if "input" in row and "output" in row:
        return "nemotron"
    # prompts only: usable when answers are regenerated (to_messages refuses them otherwise)
    if "instruction" in row:
        return "alpaca"
    if "input" in row:
        return "nemotron"
    if isinstance(row.get("prompt"), str):
        return "prompt"
    raise BadRow("unknown layout")


def split_think(text: str) -> tuple[str | None, str]:
    """``"<think>r</think>c"`` -> ``("r", "c")``; text without a closed think block -> ``(None, text)``."""
    if "</think>" not in text:
        return None, text
    head, content = text.split("</think>", 1)
    reasoning = head.split("<think>", 1)[-1]
    return reasoning.strip("\n"), content.lstrip("\n")


def _message(role: Any, content: Any, reasoning: Any = None) -> dict:
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise BadRow("unknown role")
    role = ROLE_ALIASES[role.lower()]
    if not isinstance(content, str) or not content.strip():
        raise BadRow("empty content")
    msg = {"role": role, "content": content}
    if role == "assistant":
        if reasoning is None:
            reasoning, msg["content"] = split_think(content)
            if not msg["content"].strip():
                raise BadRow("empty content")
        if isinstance(reasoning, str) and reasoning.strip():
            msg["reasoning_content"] = reasoning
    return msg


def _from_list(turns: Any, role_key: str, content_key: str) -> list[dict]:
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise BadRow("malformed turns")
    out = []
    for t in turns:
        rk = role_key if role_key in t else ("role" if "role" in t else "from")
        ck = content_key if content_key in t else ("content" if "content" in t else "value")
        out.append(_message(t.get(rk), t.get(ck), t.get("reasoning_content")))
    return out


def _with_answer(row: dict, prompt: list[dict]) -> list[dict]:
    """Prompt turns plus the row's ``output`` answer; prompts only when the row has none."""
    output = row.get("output")
    if output is None or (isinstance(output, str) and not output.strip()):
        return prompt
    return prompt + [_message("assistant", output)]


def to_messages(row: dict, layout: str, need_answers: bool = True) -> list[dict]:
    """One raw row -> validated messages. Raises :class:`BadRow` with the reason.

    ``need_answers=False`` (answers will be regenerated) keeps prompts-only rows: they end with
    one empty assistant turn for the generator to fill in.
    """
    if layout == "openai":
        msgs = _from_list(row["messages"], "role", "content")
    elif layout == "sharegpt":
        msgs = _from_list(row["conversations"], "from", "value")
    elif layout == "alpaca":
        instruction, extra = row.get("instruction"), row.get("input") or ""
        if not isinstance(instruction, str) or not isinstance(extra, str):
            raise BadRow("malformed turns")
        prompt = instruction + ("\n\n" + extra if extra.strip() else "")
        msgs = _with_answer(row, ([_message("system", row["system"])] if row.get("system") else []) +
                            [_message("user", prompt)])
    elif layout == "nemotron":
        given = row["input"]
        prompt = _from_list(given, "role", "content") if isinstance(given, list) else [_message("user", given)]
        system = row.get("system_prompt")
        if system and not any(m["role"] == "system" for m in prompt):
            prompt = [_message("system", system)] + prompt
        msgs = _with_answer(row, prompt)
    elif layout == "prompt":
        msgs = ([_message("system", row["system"])] if row.get("system") else []) + [_message("user", row["prompt"])]
    else:
        raise ValueError(f"unknown layout {layout!r}: use one of {LAYOUTS}")
    if not need_answers and msgs and not any(m["role"] == "assistant" for m in msgs):
        if msgs[-1]["role"] != "user":
            raise BadRow("no user turn")
        msgs.append({"role": "assistant", "content": ""})  # filled in by regeneration
    while msgs and msgs[-1]["role"] != "assistant":  # a trailing question has no answer to learn
        msgs.pop()
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadRow("no assistant turn")
    if msgs[0]["role"] == "assistant" or (msgs[0]["role"] == "system" and msgs[1]["role"] == "assistant"):
        raise BadRow("assistant turn before any user turn")
    return msgs


# ----------------------------------------------------------------------------- sources
def _jsonl_rows(path: Path) -> Iterator[dict | BadRow]:
    if path.suffix == ".json":  # one document: a bad byte or bracket anywhere spoils all of it
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))  # -sig: a BOM (Windows editors) is no error
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not a UTF-8 JSON document ({e}); a .jsonl file (one row a line) skips "
                             "bad rows instead") from None
        # an item that is not an object gets the reason a .jsonl line gets (it was counted as "malformed turns")
        for row in data if isinstance(data, list) else [data]:
            yield row if isinstance(row, dict) else BadRow("JSON that is not an object")
        return
    # Decoded line by line: one Latin-1 row among millions aborted the whole read with "'utf-8' codec
    # can't decode byte 0xe9", naming no file. surrogateescape keeps the bad bytes visible per line.
    # utf-8-sig: a byte-order mark (Windows editors write one) made the first row "malformed JSON", dropped.
    with path.open(encoding="utf-8-sig", errors="surrogateescape") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                yield BadRow("not UTF-8 text", where=f"{path} line {number}")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                yield BadRow("malformed JSON")
                continue
            yield row if isinstance(row, dict) else BadRow("JSON that is not an object")


def _parquet_rows(path: Path) -> Iterator[dict]:
    import pyarrow as pa  # start-up time (data.prepare and data.regenerate --help)
    import pyarrow.parquet as pq  # start-up time (data.prepare and data.regenerate --help)

    # pyarrow's own message ("Parquet magic bytes not found in footer") named no file: in a folder of many shards,
    # the one cut short by an interrupted download could not be found. (The consumer's own errors never reach
    # this try: they are raised in its frame, not at the yield.)
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable Parquet file ({e}): it may be cut short (an interrupted "
                         "download or copy): fetch or write it again, or move it out of the source") from None


def _hub_rows(name: str, split: str, subset: str | None, streaming: bool,
              revision: str | None = None) -> Iterator[dict]:
    from datasets import load_dataset  # start-up time (data.prepare and data.regenerate --help)

    try:
        ds = load_dataset(name, subset, split=split, streaming=streaming, revision=revision)
    except Exception as e:  # datasets raises many types; all mean "could not get it"
        raise OSError(f"could not load data set {name!r} (subset={subset}, split={split}): "
                      f"{type(e).__name__}: {e}") from e
    yield from ds


def _disk_rows(path: Path, split: str) -> Iterator[dict]:
    from datasets import DatasetDict, load_from_disk  # start-up time (data.prepare and data.regenerate --help)

    ds = load_from_disk(str(path))
    if not isinstance(ds, DatasetDict):
        yield from ds
        return
    # "chat+code" concatenates splits, as datasets.load_dataset does for Hub ids.
    for one in split.split("+"):
        if one not in ds:
            raise SplitNotFound(f"split {one!r} not in {path} (splits: {list(ds)}; join several with '+')")
        yield from ds[one]


FILE_TYPES = (".jsonl", ".json", ".parquet")


def _check_file_type(path: Path) -> None:
    if path.suffix not in FILE_TYPES:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl, .json or .parquet)")


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _folder_files(path: Path, split: str | None = None) -> list[Path]:
    """The files of a folder source; with ``split``, only that split's when their names say which split they hold
    (``train.jsonl`` / ``test.jsonl``, ``data/train-00000-of-00002.parquet``, ``train/`` and ``test/`` folders: a
    Hub data set downloaded as it is), as ``datasets`` names them. Read whole, such a folder mixed the test rows
    into the training data whatever ``--split`` said."""
    files = sorted(p for p in path.rglob("*") if p.suffix in FILE_TYPES)
    if not files:
        raise FileNotFoundError(f"{path} holds no .jsonl/.json/.parquet files and is not a save_to_disk folder")
    if split is None:
        return files
    # start-up time (data.prepare and data.regenerate --help)
    from datasets.data_files import DataFilesDict, get_data_patterns

    named = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    if len(named) < 2:  # one split (or none named): the folder is its rows
        return files
    chosen: list[Path] = []
    for one in split.split("+"):
        if one not in named:
            raise SplitNotFound(f"split {one!r} not in {path} (its files hold splits {sorted(map(str, named))}; "
                                "choose one with --split, or join several with '+')")
        held = {Path(f).resolve() for f in named[one]}
        chosen += [f for f in files if f.resolve() in held]
    return chosen


def iter_source_rows(source: str | Path, split: str = "train", subset: str | None = None,
                     streaming: bool = False, revision: str | None = None) -> Iterator[dict | BadRow]:
    """Raw rows of a source, in a stable order. Malformed JSON lines come out as :class:`BadRow`."""
    path = Path(source).expanduser()
    refuse_local_subset(path, subset)
    if path.is_file():
        _check_file_type(path)
        if path.suffix in (".jsonl", ".json"):
            yield from _jsonl_rows(path)
        else:
            yield from _parquet_rows(path)
    elif path.is_dir():
        if _is_saved_dataset(path):
            yield from _disk_rows(path, split)
            return
        for f in _folder_files(path, split):
            yield from iter_source_rows(f)
    elif "/" in str(source) and not str(source).startswith((".", "/", "~")):
        yield from _hub_rows(str(source), split, subset, streaming, revision)
    else:
        check_source(source)


def refuse_local_subset(source: str | Path, subset: str | None) -> None:
    """A subset names a configuration of a Hub data set: given with a local source it was ignored, and recorded in
    the prepared folder's settings (changing it later was refused as "other settings")."""
    path = Path(source).expanduser()
    if subset and path.exists():
        raise ValueError(f"subset {subset!r} names a configuration of a Hub data set, and {path} is local (read "
                         "whole): drop the subset (--subset / data.subset)")


def check_source(source: str | Path, subset: str | None = None) -> None:
    """Refuse a source that is neither a local file / folder nor shaped like a Hub id, a file of a type no reader
    reads (a .csv), a folder with no file to read and a local source with a subset, before any work (the rows are
    read lazily, so a command that loads the target first found these only after it)."""
    path = Path(source).expanduser()
    if not path.exists() and ("/" not in str(source) or str(source).startswith((".", "/", "~"))):
        raise FileNotFoundError(f"data source {str(source)!r} is neither a local file/folder nor a Hub id org/name")
    refuse_local_subset(path, subset)
    if path.is_file():
        _check_file_type(path)
    elif path.is_dir() and not _is_saved_dataset(path):
        _folder_files(path)


def iter_conversations(source: str | Path, *, split: str = "train", subset: str | None = None,
                       streaming: bool = False, layout: str = "auto", limit: int | None = None,
                       stats: ReadStats | None = None, revision: str | None = None,
                       need_answers: bool = True) -> Iterator[dict]:
    """Yield conversations from ``source``, skipping and counting bad rows in ``stats``."""
    stats = stats if stats is not None else ReadStats()
    for index, row in enumerate(iter_source_rows(source, split, subset, streaming, revision)):
        if limit is not None and stats.kept >= limit:
            break
        stats.seen += 1
        try:
            if isinstance(row, BadRow):
                raise row
            kind = detect_layout(row) if layout == "auto" else layout
            messages = to_messages(row, kind, need_answers)
        except BadRow as why:
            stats.skip(why)
            continue
        except (KeyError, TypeError, AttributeError):
            stats.skipped["malformed turns"] += 1
            continue
        stats.kept += 1
        stats.layouts[kind] += 1
        conv = {"id": str(index), "key": conversation_key(messages), "messages": messages}
        source_id = next((row[k] for k in ID_COLUMNS if row.get(k) is not None), None)
        if source_id is not None:
            conv["source_id"] = str(source_id)
        yield conv


def conversation_key(messages: list[dict]) -> str:
    """Hash of what regeneration answers: roles and prompt turns, not the data set's own answers.

    The same prompts give the same key whatever the row number or the old answers, so a resumed
    regeneration re-uses an answer only for exactly the conversation it was generated for.
    """
    shape = [[m["role"], "" if m["role"] == "assistant" else m["content"]] for m in messages]
    return hashlib.sha256(json.dumps(shape, ensure_ascii=False).encode()).hexdigest()[:32]


def load_conversations(source: str | Path, **kwargs) -> tuple[list[dict], ReadStats]:
    """All usable conversations of ``source`` and the read summary; no usable row is an error."""
    stats = ReadStats()
    convs = list(iter_conversations(source, stats=stats, **kwargs))
    if not convs:
        raise no_usable_rows(source, stats)
    return convs, stats


def no_usable_rows(source: str | Path, stats: ReadStats) -> NoUsableRows:
    """The error for a source without one usable conversation, with the hint that fits its rows."""
    hint = (" Prompts-only data (no assistant turns) is usable when the answers are regenerated "
            "(--regenerate / data.regenerate)." if stats.skipped.get("no assistant turn") else "")
    return NoUsableRows(f"{source}: no usable conversations. {stats.summary()}. Supported layouts: openai "
                        "(messages), sharegpt (conversations), alpaca (instruction/input/output), nemotron "
                        f"(input/output), prompt (prompts only, with regeneration).{hint}")
