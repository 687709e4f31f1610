"""Conversations -> prepared rows, on disk all the way (``datasets``), tokenized in parallel.

For the real recipes (~800k conversations, ~3k tokens each) nothing is held as Python lists:
conversations are streamed into a JSONL file in a scratch folder, read back as an Arrow data set,
tokenized with ``datasets.map(num_proc=...)`` (order preserved, so the output does not depend on
the number of processes), then saved with ``save_to_disk``. Packing is greedy and in order, so
its groups are contiguous runs of rows, planned from the ``num_tokens`` column alone.

Each conversation gives its rows plus one empty *tally* row carrying its counters (rows dropped
for having no loss tokens, template errors); tally rows are summed and filtered out.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import datasets
import numpy as np
from datasets import Dataset, Features, Sequence, Value

from data.chat import TemplateError, tokenize_conversation
from data.packing import document_columns

COLUMNS = ["input_ids", "loss_mask", "doc_ids", "position_ids", "num_tokens", "num_loss_tokens"]
TALLIES = ["truncated", "retokenized", "dropped_no_loss", "template_errors"]


def rows_identity(*splits) -> str:
    """A cheap identity of prepared rows, in order: each split's row count, every row's token and
    loss-token counts, and the token ids of its first and last rows (reading every token of a
    multi-GB data set at each start would cost more than it adds). A checkpoint records it, so a
    resumed run trains on the rows it started on, wherever their folder now lives."""
    digest = hashlib.sha256()
    for ds in splits:
        n = len(ds)
        digest.update(json.dumps([n, ds[0]["input_ids"], ds[n - 1]["input_ids"]] if n else [0]).encode())
        numbers = ds.with_format("numpy")
        for column in ("num_tokens", "num_loss_tokens"):
            if column in ds.column_names:  # in row order, through any selection of the split
                digest.update(np.asarray(numbers[column], dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def row_features(tallies: bool = False):
    cols = {"input_ids": Sequence(Value("int32")), "loss_mask": Sequence(Value("int8")),
            "doc_ids": Sequence(Value("int32")), "position_ids": Sequence(Value("int32")),
            "num_tokens": Value("int32"), "num_loss_tokens": Value("int32")}
    if tallies:
        cols.update({k: Value("int32") for k in TALLIES})
    return Features(cols)


def _row(ids: list[int], mask: list[int], **tallies) -> dict:
    doc_ids, position_ids = document_columns([len(ids)])
    row = {"input_ids": ids, "loss_mask": mask, "doc_ids": doc_ids, "position_ids": position_ids,
           "num_tokens": len(ids), "num_loss_tokens": sum(mask)}
    row.update({k: tallies.get(k, 0) for k in TALLIES})
    return row


def tokenize_batch(batch: dict, tokenizer, thinking: bool | None, max_length: int | None) -> dict:
    """``datasets.map`` function: conversations (JSON strings) -> rows + one tally row each."""
    out: dict[str, list] = {k: [] for k in COLUMNS + TALLIES}

    def add(row: dict) -> None:
        for k, v in row.items():
            out[k].append(v)

    for text in batch["conversation"]:
        messages = json.loads(text)
        try:
            rows, dropped = tokenize_conversation(tokenizer, messages, thinking, max_length)
        except TemplateError:
            add(_row([], [], template_errors=1))
            continue
        for r in rows:
            add(_row(r.input_ids, r.loss_mask, truncated=int(r.truncated), retokenized=r.retokenized))
        add(_row([], [], dropped_no_loss=dropped))
    return out


def auto_num_proc(n: int) -> int | None:
    """Processes for ``n`` conversations: one below 20k (start-up costs more), else up to 8."""
    return None if n < 20_000 else max(1, min(8, os.cpu_count() or 1))


def tokenize_to_disk(tokenizer, convs: Iterable[dict], out: Path, scratch: Path, *, thinking: bool | None,
                     max_length: int | None, pack: bool, num_proc: int | None = None,
                     progress: bool = True) -> dict:
    """Tokenize ``convs`` (each ``{"messages": [...]}``) into the ``datasets`` folder ``out``; returns counts."""
    scratch.mkdir(parents=True, exist_ok=True)
    src = scratch / "conversations.jsonl"
    n = 0
    with src.open("w") as f:
        for conv in convs:
            f.write(json.dumps({"conversation": json.dumps(conv["messages"], ensure_ascii=False)},
                               ensure_ascii=False) + "\n")
            n += 1
    if n == 0:
        raise ValueError("no conversation to tokenize")
    if not progress:
        datasets.disable_progress_bars()
    try:
        ds = Dataset.from_json(str(src), cache_dir=str(scratch / "hf"))
        num_proc = num_proc if num_proc is not None else auto_num_proc(n)
        rows = ds.map(tokenize_batch, batched=True, batch_size=64, num_proc=num_proc if (num_proc or 1) > 1 else None,
                      remove_columns=["conversation"], features=row_features(tallies=True),
                      fn_kwargs={"tokenizer": tokenizer, "thinking": thinking, "max_length": max_length},
                      desc="tokenize", new_fingerprint=f"tokenize-{os.getpid()}-{id(scratch)}-{n}")
        counts = {k: int(sum(rows[k])) for k in TALLIES}
        lengths = rows["num_tokens"]
        keep = [i for i, length in enumerate(lengths) if length > 0]
        if not keep:
            if counts["template_errors"] == n:  # the --max-length hint below sent people the wrong way
                raise ValueError(f"the chat template failed on every conversation ({n}): the loss mask comes from "
                                 "the template rendering each assistant turn as it was written, and this one "
                                 "changes it (or its end-of-turn trailer); use the chat model's own template "
                                 "(chat_template.jinja of its folder)")
            raise ValueError(f"no row has loss tokens after tokenization ({counts}); check --max-length and the data")
        # The kept rows' index goes to a file, not memory: packing hands these rows to from_generator, which
        # hashes them, and hashing an in-memory Arrow table fails where dill pickles pyarrow by value
        # (pyarrow installed outside site-packages: "Can't pickle <class 'MonthDayNano'>").
        rows = rows.select(keep, indices_cache_file_name=str(scratch / "kept.arrow")).remove_columns(TALLIES)
        counts.update({"conversations": n, "documents": len(keep), "tokens": int(sum(lengths)),
                       "loss_tokens": int(sum(rows["num_loss_tokens"]))})
        if pack:
            rows = pack_to_dataset(rows, [lengths[i] for i in keep], max_length, scratch)
        counts["rows"] = len(rows)
        rows.save_to_disk(str(out))
    finally:
        if not progress:
            datasets.enable_progress_bars()
    return counts


def pack_plan(lengths: list[int], max_length: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges, greedy in order (what :func:`data.packing.pack_rows` does)."""
    groups, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"row of {n} tokens is longer than max_length {max_length}: truncate first")
        if used + n > max_length and i > start:
            groups.append((start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        groups.append((start, len(lengths)))
    return groups


def _packed_rows(rows, groups: list[tuple[int, int]]):
    for a, b in groups:
        part = rows[a:b]
        doc_ids, position_ids = document_columns([len(x) for x in part["input_ids"]])
        ids = [t for x in part["input_ids"] for t in x]
        mask = [m for x in part["loss_mask"] for m in x]
        yield {"input_ids": ids, "loss_mask": mask, "doc_ids": doc_ids, "position_ids": position_ids,
               "num_tokens": len(ids), "num_loss_tokens": sum(mask)}


def pack_to_dataset(rows, lengths: list[int], max_length: int, scratch: Path):
    groups = pack_plan(lengths, max_length)
    return Dataset.from_generator(_packed_rows, gen_kwargs={"rows": rows, "groups": groups},
                                  features=row_features(), cache_dir=str(scratch / "hf-packed"))
