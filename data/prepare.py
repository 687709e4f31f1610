"""Chat data -> (optionally target-regenerated) -> tokens with assistant-only loss masks.

    python -m data.prepare --target Qwen/Qwen3-8B --source chats.jsonl --out data/qwen3-8b \\
        --regenerate http://127.0.0.1:8000/v1 --thinking off --max-length 3072 --pack
    python -m data.prepare --target ./tiny-target --source alpaca.jsonl --out /tmp/tiny-data --regenerate local

Reads the source (any layout of :mod:`data.readers`), regenerates every assistant turn with the
target if ``--regenerate`` is given (resumable: ``DIR/regenerated.jsonl``), renders each
conversation with the target's chat template and derives the loss mask from it
(:mod:`data.chat`), truncates to ``--max-length`` (rows left without loss tokens are dropped and
counted) and optionally packs rows (:mod:`data.packing`).

Output ``DIR`` is a ``datasets`` folder (``datasets.load_from_disk(DIR)``, or
:func:`load_prepared`) with one row per training sequence and columns:

- ``input_ids``    (int32 list): token ids
- ``loss_mask``    (int8 list):  1 on assistant tokens (answer + end-of-turn token), else 0
- ``doc_ids``      (int32 list): document index of each token inside the row (all 0 unless packed)
- ``position_ids`` (int32 list): position of each token inside its document
- ``num_tokens``, ``num_loss_tokens`` (int32)

plus ``DIR/stats.json`` (rows, tokens, loss tokens, truncated, dropped, read summary,
regeneration report) and ``DIR/draftsmith_data.json`` (target, tokenizer fingerprint, thinking,
max length, packed), which the trainer and :mod:`data.extract` check against the target.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

META_FILE = "draftsmith_data.json"
STATS_FILE = "stats.json"


class DataMismatch(ValueError):
    pass


def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    from models.hub import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(target, what="target"))


def tokenize_all(tokenizer, convs: list[dict], thinking: bool | None, max_length: int | None,
                 progress: bool = True) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """Tokenize conversations in order; returns rows and counters."""
    from tqdm import tqdm

    from data.chat import TemplateError, tokenize_conversation

    rows, counts = [], Counter()
    for conv in tqdm(convs, desc="tokenize", unit="conv", disable=not progress):
        try:
            conv_rows, dropped = tokenize_conversation(tokenizer, conv["messages"], thinking, max_length)
        except TemplateError:
            counts["template_errors"] += 1
            continue
        counts["dropped_no_loss"] += dropped
        counts["truncated"] += sum(r.truncated for r in conv_rows)
        rows += [(r.input_ids, r.loss_mask) for r in conv_rows]
    return rows, dict(counts)


def save_prepared(records: list[dict], out: Path, meta: dict, stats: dict) -> None:
    from datasets import Dataset, Features, Sequence, Value

    features = Features({"input_ids": Sequence(Value("int32")), "loss_mask": Sequence(Value("int8")),
                         "doc_ids": Sequence(Value("int32")), "position_ids": Sequence(Value("int32")),
                         "num_tokens": Value("int32"), "num_loss_tokens": Value("int32")})
    for r in records:
        r["num_tokens"], r["num_loss_tokens"] = len(r["input_ids"]), sum(r["loss_mask"])
    Dataset.from_list(records, features=features).save_to_disk(str(out))
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2))


def load_prepared(path: str | Path, tokenizer=None, target=None, force: bool = False):
    """(dataset, meta) of a prepared folder; with ``tokenizer``, refuse data made by another one.

    With ``target``, data whose answers another target regenerated (another model, or the same model
    at another quantization: same tokenizer, other tokens) is refused unless ``force``.
    """
    from datasets import load_from_disk

    from data.chat import tokenizer_fingerprint

    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a prepared data folder (no {META_FILE}); run python -m data.prepare")
    meta = json.loads(meta_path.read_text())
    if tokenizer is not None and meta["tokenizer_hash"] != tokenizer_fingerprint(tokenizer):
        raise DataMismatch(f"{path} was tokenized for target {meta['target']!r} (tokenizer {meta['tokenizer_hash']}), "
                           f"not for this tokenizer ({tokenizer_fingerprint(tokenizer)}): re-run data.prepare")
    if target is not None:
        check_regenerated_by(meta, target, path, force)
    return load_from_disk(str(path)), meta


def regeneration_provenance(target) -> dict:
    """What ``draftsmith_data.json`` records about the target that regenerated the answers."""
    from data.store import target_identity

    ident = target_identity(target)
    return {"regenerated_by": ident["target"], "regenerated_by_fingerprint": ident["target_fingerprint"],
            "regenerated_by_quantization": getattr(target, "quantization", "none")}


def check_regenerated_by(meta: dict, target, path: Path, force: bool = False) -> None:
    """Refuse answers regenerated by another target (or quantization) than the one training runs."""
    recorded = meta.get("regenerated_by_fingerprint")
    if not meta.get("regenerated") or recorded is None:
        return
    now = regeneration_provenance(target)
    if recorded == now["regenerated_by_fingerprint"] and \
            meta.get("regenerated_by_quantization") == now["regenerated_by_quantization"]:
        return
    message = (f"{path} holds answers regenerated by {meta.get('regenerated_by')!r} (quantization "
               f"{meta.get('regenerated_by_quantization')}, fingerprint {recorded}), not by this target "
               f"{now['regenerated_by']!r} (quantization {now['regenerated_by_quantization']}, fingerprint "
               f"{now['regenerated_by_fingerprint']}): re-prepare it (point data.prepared elsewhere), or set "
               "data.force_target=true to train on them anyway")
    if not force:
        raise DataMismatch(message)
    print(f"warning: {message}", file=sys.stderr)


def prepare(target: str, source: str, out: str | Path, *, regenerate: str | None = None,
            thinking: bool | None = None, max_length: int | None = None, pack: bool = False,
            limit: int | None = None, split: str = "train", subset: str | None = None, streaming: bool = False,
            gen_kwargs: dict | None = None, progress: bool = True) -> dict:
    """The whole pipeline; returns the stats dict (also written to ``out/stats.json``)."""
    from data.chat import tokenizer_fingerprint
    from data.packing import pack_rows, unpacked_rows
    from data.readers import BadRow, ReadStats, load_conversations, to_messages

    if pack and not max_length:
        raise ValueError("--pack needs --max-length (the packed row budget)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    convs, read_stats = load_conversations(source, split=split, subset=subset, streaming=streaming, limit=limit)
    print(read_stats.summary(), file=sys.stderr)
    stats: dict = {"read": read_stats.as_dict()}

    if regenerate:
        from data.regenerate import make_generator, read_rows
        from data.regenerate import regenerate as run_regeneration

        model = None
        if regenerate == "local":
            from models.target import TargetModel
            model = TargetModel.from_pretrained(target)
        gen_kwargs = dict(gen_kwargs or {})
        server_model = gen_kwargs.pop("model", None) or str(target)
        gen = make_generator(regenerate, model=server_model, target=model, thinking=thinking, **gen_kwargs)
        report = run_regeneration(convs, out / "regenerated.jsonl", gen, progress=progress)
        print(report.line(), file=sys.stderr)
        stats["regenerate"] = json.loads(report.line())["regenerate"]
        if report.failed:
            raise RuntimeError(f"{report.failed} conversations failed to regenerate; rerun the same command to retry")
        wanted = {c["id"] for c in convs}
        regen_stats = ReadStats()
        convs = []
        for row in read_rows(out / "regenerated.jsonl"):
            if row["id"] not in wanted:
                continue
            regen_stats.seen += 1
            try:  # a target answer can be empty (EOS first): same rules as any source row
                convs.append({"id": row["id"], "messages": to_messages(row, "openai")})
                regen_stats.kept += 1
            except BadRow as why:
                regen_stats.skipped[str(why)] += 1
        stats["regenerated_rows"] = regen_stats.as_dict()

    tokenizer = load_tokenizer(target)
    rows, counts = tokenize_all(tokenizer, convs, thinking, max_length, progress)
    if not rows:
        raise ValueError(f"no row has loss tokens after tokenization ({counts}); check --max-length and the data")
    records = pack_rows(rows, max_length) if pack else unpacked_rows(rows)
    stats.update({"conversations": len(convs), "documents": len(rows), "rows": len(records),
                  "tokens": sum(len(r[0]) for r in rows), "loss_tokens": sum(sum(r[1]) for r in rows),
                  "truncated": counts.get("truncated", 0), "dropped_no_loss": counts.get("dropped_no_loss", 0),
                  "template_errors": counts.get("template_errors", 0)})
    meta = {"target": str(target), "tokenizer_hash": tokenizer_fingerprint(tokenizer), "source": str(source),
            "thinking": thinking, "max_length": max_length, "packed": pack, "regenerated": bool(regenerate),
            "columns": ["input_ids", "loss_mask", "doc_ids", "position_ids", "num_tokens", "num_loss_tokens"]}
    if regenerate == "local":  # answers are this target's own: later runs check they train against it
        meta.update(regeneration_provenance(model))
    save_prepared(records, out, meta, stats)
    return stats


def main(argv: list[str] | None = None) -> None:
    from data.regenerate import add_generation_args, parse_thinking

    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target folder or Hub id (its tokenizer and chat template)")
    p.add_argument("--source", required=True,
                   help=".jsonl/.json/.parquet file, a datasets folder, or a Hub data set id")
    p.add_argument("--out", required=True, help="output folder (a datasets save_to_disk folder + stats.json)")
    p.add_argument("--regenerate", metavar="local|URL",
                   help="regenerate assistant turns with the target: 'local' (in-process) "
                        "or an OpenAI-compatible base URL")
    p.add_argument("--thinking", choices=["on", "off", "default"], default="default",
                   help="chat template thinking switch, as the target will be served (default: template default)")
    p.add_argument("--max-length", type=int, default=None, help="truncate rows to N tokens (and the packing budget)")
    p.add_argument("--pack", action="store_true", help="pack rows up to --max-length, keeping doc_ids/position_ids")
    p.add_argument("--limit", type=int, default=None, help="only the first N usable conversations")
    p.add_argument("--split", default="train", help="data set split (Hub or datasets folder; default train)")
    p.add_argument("--subset", default=None, help="Hub data set subset / config name")
    p.add_argument("--streaming", action="store_true", help="stream a Hub data set instead of downloading it whole")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_generation_args(p)
    a = p.parse_args(argv)
    gen_kwargs = dict(model=a.model, temperature=a.temperature, max_tokens=a.max_tokens, concurrency=a.concurrency,
                      batch_size=a.batch_size, retries=a.retries, backoff=a.backoff)
    stats = prepare(a.target, a.source, a.out, regenerate=a.regenerate, thinking=parse_thinking(a.thinking),
                    max_length=a.max_length, pack=a.pack, limit=a.limit, split=a.split, subset=a.subset,
                    streaming=a.streaming, gen_kwargs=gen_kwargs, progress=not a.no_progress)
    print(json.dumps({"prepare": {k: stats[k] for k in ("rows", "documents", "tokens", "loss_tokens", "truncated",
                                                        "dropped_no_loss", "template_errors")}, "out": str(a.out)}))


if __name__ == "__main__":
    from models.cli import run_cli

    run_cli(main)
