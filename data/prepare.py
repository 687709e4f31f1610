"""Chat data -> (optionally target-regenerated) -> tokens with assistant-only loss masks.

    python -m data.prepare --target Qwen/Qwen3-8B --source chats.jsonl --out data/qwen3-8b \\
        --regenerate http://127.0.0.1:8000/v1 --thinking off --max-length 3072 --pack
    python -m data.prepare --target ./tiny-target --source alpaca.jsonl --out /tmp/tiny-data --regenerate local
    python -m data.prepare --target Qwen/Qwen3-8B --source prompts.jsonl --out data/q --regenerate vllm

Reads the source (any layout of :mod:`data.readers`), regenerates every assistant turn with the
target if ``--regenerate`` is given (resumable: ``DIR/regenerated.jsonl``), renders each
conversation with the target's chat template and derives the loss mask from it
(:mod:`data.chat`), truncates to ``--max-length`` (rows left without loss tokens are dropped and
counted) and optionally packs rows (:mod:`data.packing`). The source is read row by row (a Hub
data set with ``--streaming`` is never downloaded whole) and tokenized on disk with
``datasets.map(num_proc=...)`` (:mod:`data.rows`).

``--regenerate`` is ``local`` (the target in this process, ``--batch-size`` conversations at a
time), ``vllm`` or ``sglang`` (draftsmith starts the engine on a free local port, regenerates and
stops it: :mod:`data.engine`), or the base URL of a running OpenAI-compatible server (checked
with one ``/v1/models`` request first). Prompts-only data (no assistant turns) is accepted when
answers are regenerated. Regenerated answers are trained on the token ids the target generated.

Re-running on an existing ``--out`` (:mod:`data.reuse`): the same settings rebuild it (re-using
the regenerated answers); other settings are refused with the differences named unless
``--rebuild``; a non-empty folder that is not a prepared-data folder is never written into. A
failed run leaves no empty ``--out`` behind.

Output ``DIR`` is a ``datasets`` folder (``datasets.load_from_disk(DIR)``, or
:func:`load_prepared`) with one row per training sequence and columns:

- ``input_ids``    (int32 list): token ids
- ``loss_mask``    (int8 list):  1 on assistant tokens (answer + end-of-turn token, none after an answer cut at
  max tokens), else 0
- ``doc_ids``      (int32 list): document index of each token inside the row (all 0 unless packed)
- ``position_ids`` (int32 list): position of each token inside its document
- ``num_tokens``, ``num_loss_tokens`` (int32)

plus ``DIR/stats.json`` (rows, tokens, loss tokens, truncated, dropped, read summary,
regeneration report) and ``DIR/draftsmith_data.json`` (target, tokenizer fingerprint, thinking,
max length, packed), which the trainer and :mod:`data.extract` check against the target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator

from data.chat import require_chat_template, tokenizer_fingerprint
from data.readers import BadRow, ReadStats, check_source, iter_conversations, no_usable_rows, to_messages
from data.regenerate import (RegenerationError, add_generation_args, check_counts, index_rows, load_local_target,
                             make_generator, parse_thinking, regenerate as run_regeneration)
from data.reuse import (CACHE_DIR, LOCK, ROW_SETTINGS, claim_folder, clean_failed, read_json, refuse_folder, reusable,
                        row_settings, settings_diff)
from data.reuse import META_FILE, PARTIAL_FILE, REGEN_FILE, STATS_FILE, DataMismatch  # noqa: F401 (re-exported)
from models.config_layout import read_json_file, refuse_drafter_as_target

SERVER_LOG = "regenerate-server.log"


NO_TOKENIZER_FIX = ("the conversations are rendered with the target's tokenizer and chat template: add the target's "
                    "tokenizer files to the folder (they come with the model's repo)")


def check_target_tokenizer(target: str, fix: str = NO_TOKENIZER_FIX) -> None:
    """The target folder (a Hub id's small files) has tokenizer files: checked before anything else is read,
    written or loaded (``models.hub.require_tokenizer_files``, the rule training and generate use)."""
    from models.hub import SMALL_FILES, require_tokenizer_files, resolve_model_dir  # start-up time (--help)

    require_tokenizer_files(resolve_model_dir(target, what="target", allow_patterns=SMALL_FILES), target, fix)


def load_tokenizer(target: str):
    from models.hub import SMALL_FILES, require_tokenizer_files, resolve_model_dir  # start-up time (--help)
    from models.target import load_tokenizer as load  # start-up time (data.prepare --help)

    directory = resolve_model_dir(target, what="target", allow_patterns=SMALL_FILES)
    if (directory / "config.json").is_file():  # a drafter's tokenizer has no chat template: "no row has loss tokens"
        refuse_drafter_as_target(target, read_json_file(directory / "config.json"))
    require_tokenizer_files(directory, target, NO_TOKENIZER_FIX)
    tokenizer = load(directory)
    require_chat_template(tokenizer, target)
    return tokenizer


def require_prepared(path: str | Path) -> Path:
    """``path``, refused unless it is a finished prepared data folder (commands check it before a target loads)."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a prepared data folder (no {META_FILE}); run python -m data.prepare")
    return path


def load_prepared(path: str | Path, tokenizer=None, target=None, force: bool = False, fix: str | None = None):
    """(dataset, meta) of a prepared folder; with ``tokenizer``, refuse data made by another one.

    With ``target``, data whose answers another target regenerated (another model, or the same model
    at another quantization: same tokenizer, other tokens) is refused unless ``force``.
    """
    from datasets import load_from_disk  # start-up time (data.prepare --help)

    path = require_prepared(path)
    meta = json.loads((path / META_FILE).read_text())
    if tokenizer is not None and meta["tokenizer_hash"] != tokenizer_fingerprint(tokenizer):
        raise DataMismatch(f"{path} was tokenized for target {meta['target']!r} (tokenizer {meta['tokenizer_hash']}), "
                           f"not for this tokenizer ({tokenizer_fingerprint(tokenizer)}): re-run data.prepare")
    if target is not None:
        check_regenerated_by(meta, target, path, force, fix)
    return load_from_disk(str(path)), meta


def regeneration_provenance(target) -> dict:
    """What ``draftsmith_data.json`` records about the target that regenerated the answers."""
    from data.store import target_identity  # start-up time (data.prepare --help)

    ident = target_identity(target)
    return {"regenerated_by": ident["target"], "regenerated_by_fingerprint": ident["target_fingerprint"],
            "regenerated_by_quantization": getattr(target, "quantization", "none")}


def check_regenerated_by(meta: dict, target, path: Path, force: bool = False, fix: str | None = None) -> None:
    """Refuse answers regenerated by another target (or quantization) than the one training runs;
    ``fix`` ends the message (default: training's keys)."""
    fix = fix or "re-prepare it (point data.prepared elsewhere), or set data.force_target=true to train on them anyway"
    recorded = meta.get("regenerated_by_fingerprint")
    if not meta.get("regenerated") or recorded is None:
        return
    from data.store import is_same_target  # start-up time (data.prepare --help)

    now = regeneration_provenance(target)
    if is_same_target(recorded, target, now["regenerated_by_fingerprint"]) and \
            meta.get("regenerated_by_quantization") == now["regenerated_by_quantization"]:
        return
    message = (f"{path} holds answers regenerated by {meta.get('regenerated_by')!r} (quantization "
               f"{meta.get('regenerated_by_quantization')}, fingerprint {recorded}), not by this target "
               f"{now['regenerated_by']!r} (quantization {now['regenerated_by_quantization']}, fingerprint "
               f"{now['regenerated_by_fingerprint']}): {fix}")
    if not force:
        raise DataMismatch(message)
    print(f"warning: {message}", file=sys.stderr)


def prepare(target: str, source: str, out: str | Path, *, regenerate: str | None = None,
            thinking: bool | None = None, max_length: int | None = None, pack: bool = False,
            limit: int | None = None, split: str = "train", subset: str | None = None, streaming: bool = False,
            gen_kwargs: dict | None = None, progress: bool = True, rebuild: bool = False, reuse: bool = False,
            num_proc: int | None = None, server_log: str | Path | None = None, engine_timeout: float = 1800.0,
            make_room=None, target_model=None, log=None) -> dict:
    """The whole pipeline; returns the stats dict (also written to ``out/stats.json``).

    ``reuse``: a finished folder with the same settings is returned as it is (what training does).
    ``rebuild``: a folder prepared with other settings is rebuilt instead of refused.
    ``server_log``: where a started vLLM / SGLang engine logs (default ``out/regenerate-server.log``).
    ``make_room``: entered while that engine runs (training moves its target off the GPU meanwhile).
    ``target_model``: an already loaded ``TargetModel`` for ``regenerate='local'`` (training passes its
    own, so answers come from the weights and device it trains against instead of a second CPU copy).
    """
    check_row_budget(max_length, pack)
    out = Path(out)
    log = log or (lambda message: print(message, file=sys.stderr))
    gen_kwargs = dict(gen_kwargs or {})
    regenerate = None if regenerate in (None, "", "none") else regenerate
    tokenizer, wanted = wanted_settings(target, source, regenerate=regenerate, thinking=thinking,
                                        max_length=max_length, pack=pack, limit=limit, split=split, subset=subset,
                                        gen_kwargs=gen_kwargs, target_model=target_model)
    if reuse and reusable(out, wanted):
        return read_json(out / STATS_FILE) or {}
    created = not out.exists()
    claim_folder(out, wanted, rebuild)
    try:
        return _build(target, source, out, tokenizer, wanted, regenerate=regenerate, thinking=thinking,
                      max_length=max_length, pack=pack, limit=limit, split=split, subset=subset, streaming=streaming,
                      gen_kwargs=gen_kwargs, progress=progress, num_proc=num_proc,
                      server_log=Path(server_log) if server_log else out / SERVER_LOG,
                      engine_timeout=engine_timeout, make_room=make_room, target_model=target_model, log=log)
    except BaseException:
        clean_failed(out, created)
        raise


def check_row_budget(max_length: int | None, pack: bool) -> None:
    if max_length is not None and max_length < 1:  # training's data.max_length comes here too
        raise ValueError(f"max length {max_length}: use 1 or more tokens (the row budget), or leave it unset for "
                         "no truncation")
    if pack and not max_length:
        raise ValueError("--pack needs --max-length (the packed row budget)")


def check_before_loading(target: str, source: str, out: str | Path, *, rebuild: bool, **settings) -> None:
    """What :func:`prepare` refuses, checked before ``--regenerate local`` loads the target (minutes for a large
    one): the row budget, the target's tokenizer and chat template, and an ``out`` that is not prepared data or
    holds other settings. The regenerating target's fingerprint is compared by ``prepare`` once it is loaded."""
    check_row_budget(settings.get("max_length"), settings.get("pack", False))
    _, wanted = wanted_settings(target, source, answers_by=False, **settings)
    refuse_folder(Path(out), wanted, rebuild, keys=[k for k in ROW_SETTINGS if k != "answers_by"])


def wanted_settings(target: str, source: str, *, regenerate, thinking, max_length, pack, limit, split, subset,
                    gen_kwargs, target_model=None, answers_by: bool = True) -> tuple:
    """(tokenizer, the settings a folder prepared with these arguments records). With local regeneration
    they include the regenerating target's fingerprint and quantization (``answers_by``, unless
    ``answers_by=False``): answers of another target, finished or from an interrupted run, are never reused
    under this one's name."""
    tokenizer = load_tokenizer(target)
    wanted = row_settings(source=source, split=split, subset=subset, limit=limit, regenerate=regenerate,
                          thinking=thinking, max_length=max_length, pack=pack,
                          tokenizer_hash=tokenizer_fingerprint(tokenizer), gen_kwargs=gen_kwargs)
    if wanted["regenerate"] == "local" and answers_by:
        maker = regeneration_provenance(target_model if target_model is not None else target)
        wanted["answers_by"] = (f"{maker['regenerated_by_fingerprint']} (quantization "
                                f"{maker['regenerated_by_quantization']})")
    return tokenizer, wanted


def ensure_prepared(target: str, source: str | None, out: str | Path, *, explicit: bool = False,
                    rebuild: bool = False, log=None, **kwargs) -> None:
    """Training's entry (main process): make ``out`` a prepared folder that matches the settings.

    ``out_dir/data`` (``explicit=False``): a folder with the same settings is re-used, other
    settings are refused naming the difference, or rebuilt with ``rebuild``. A finished folder the
    user named (``data.prepared=DIR``, ``explicit=True``) is used as it is unless ``rebuild``: its own
    ``draftsmith_data.json`` describes it, and a warning names the settings that differ from the
    recipe's. ``kwargs`` are :func:`prepare`'s.
    """
    out = Path(out)
    log = log or (lambda message: print(message, file=sys.stderr))
    meta = read_json(out / META_FILE)
    if not source:
        if meta is not None:
            return
        raise ValueError(f"data.source is empty and no prepared data set exists at {out}: set data.source "
                         "(file, folder, Hub id or tiny)")
    if meta is not None and explicit and not rebuild:
        gen_kwargs = dict(kwargs.get("gen_kwargs") or {})
        regenerate = kwargs.get("regenerate")
        _, wanted = wanted_settings(target, source, regenerate=None if regenerate in (None, "", "none") else regenerate,
                                    thinking=kwargs.get("thinking"), max_length=kwargs.get("max_length"),
                                    pack=kwargs.get("pack", False), limit=kwargs.get("limit"),
                                    split=kwargs.get("split", "train"), subset=kwargs.get("subset"),
                                    gen_kwargs=gen_kwargs, target_model=kwargs.get("target_model"))
        # pack (and a set thinking) that differ are refused when the rows load: not warned about here too
        refused = ("packed", "thinking") if kwargs.get("thinking") is not None else ("packed",)
        diff = settings_diff(meta, wanted, keys=[k for k in ROW_SETTINGS if k not in refused])
        if diff:
            log(f"warning: data.prepared={out} was prepared with other settings than the recipe's "
                f"({'; '.join(diff)}); using it as it is (data.rebuild=true rebuilds it from the recipe)")
        return
    log(f"preparing data: {source} -> {out} (regenerate={kwargs.get('regenerate')}, "
        f"thinking={kwargs.get('thinking')})" if meta is None else f"checking prepared data {out} against the recipe")
    prepare(target, source, out, reuse=True, rebuild=rebuild, log=log, **kwargs)


def _checked(convs: Iterator[dict], read_stats, source: str) -> Iterator[dict]:
    """Pass conversations through; at the end, a source with no usable row is an error (as before streaming)."""
    yield from convs
    if read_stats.kept == 0:
        raise no_usable_rows(source, read_stats)


def _answered(convs: Iterator[dict], regen_stats, path: Path) -> Iterator[dict]:
    """Pass regenerated conversations through; none usable at all is named (it once surfaced as "no
    conversation to tokenize")."""
    yield from convs
    if regen_stats.kept == 0:
        raise ValueError(f"no regenerated answer is usable ({regen_stats.summary()}): the target answered every "
                         f"prompt with nothing (or only whitespace). Look at {path}: a target that is barely trained, "
                         "or ends its turn at once under this chat template / thinking setting, cannot teach a "
                         "drafter; fit it longer, fix the thinking switch, or prepare without regeneration. Answers "
                         f"are kept once written: when the server was at fault, delete {path} and rerun the same "
                         "command to regenerate them")


def _build(target, source, out: Path, tokenizer, wanted: dict, *, regenerate, thinking, max_length, pack, limit,
           split, subset, streaming, gen_kwargs, progress, num_proc, server_log: Path, engine_timeout, make_room,
           log, target_model=None) -> dict:
    from data.rows import COLUMNS, tokenize_to_disk  # start-up time (data.prepare --help)

    read_stats = ReadStats()
    convs = _checked(iter_conversations(source, split=split, subset=subset, streaming=streaming, limit=limit,
                                        stats=read_stats, need_answers=not regenerate), read_stats, str(source))
    stats: dict = {}
    model = None
    if regenerate:
        model, keys, report = _regenerate(target, convs, out, regenerate, thinking, gen_kwargs, progress,
                                          server_log, engine_timeout, make_room, log, target_model)
        stats["regenerate"] = json.loads(report.line())["regenerate"]
        regen_stats, answers = ReadStats(), Counter()
        convs = _answered(regenerated_conversations(out / REGEN_FILE, keys, regen_stats, answers), regen_stats,
                          out / REGEN_FILE)
    counts = tokenize_to_disk(tokenizer, convs, out, out / CACHE_DIR, thinking=thinking, max_length=max_length,
                              pack=pack, num_proc=num_proc, progress=progress)
    if regenerate:
        stats["regenerated_rows"] = regen_stats.as_dict()
        # "regenerate" is this run's work; these are the answers the rows hold, also those of earlier runs
        stats["regenerated_answers"] = {k: answers[k] for k in ("rows", "truncated", "turns", "tokens_generated")}
        if counts["retokenized"]:
            log(f"warning: {counts['retokenized']} regenerated answers had no token ids that spell their text; "
                "they were re-tokenized from the text")
    log(read_stats.summary())
    stats = {"read": read_stats.as_dict(), **stats, **counts}
    meta = {"target": str(target), **wanted, "regenerated": bool(regenerate), "columns": COLUMNS}
    if regenerate == "local":  # answers are this target's own: later runs check they train against it
        meta.update(regeneration_provenance(model))
    _finish(out, meta, stats)
    return stats


def _finish(out: Path, meta: dict, stats: dict) -> None:
    """Stats, then the metadata last and atomically: its presence means the folder is complete."""
    shutil.rmtree(out / CACHE_DIR, ignore_errors=True)
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2))
    tmp = out / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(out / META_FILE)
    (out / PARTIAL_FILE).unlink(missing_ok=True)


def _regenerate(target, convs: Iterator[dict], out: Path, regenerate: str, thinking, gen_kwargs: dict,
                progress: bool, server_log: Path, engine_timeout: float, make_room, log, target_model=None):
    """Regenerate every conversation (resumable); returns (in-process target or None, keys in source order,
    report). Starts and stops a vLLM / SGLang engine when asked to."""
    keys: list[str] = []

    def tee() -> Iterator[dict]:  # the source is read once: remember its order for tokenizing
        for conv in convs:
            keys.append(conv["key"])
            yield conv

    model = None
    server_model = gen_kwargs.pop("model", None) or str(target)
    with contextlib.ExitStack() as stack:
        spec = regenerate
        if regenerate in ("vllm", "sglang"):
            from data.engine import running_engine  # start-up time (data.prepare --help)

            spec = stack.enter_context(running_engine(regenerate, str(target), server_log, timeout=engine_timeout,
                                                      log=log, make_room=make_room))
            server_model = str(target)
        elif regenerate == "local":
            from models.target import TargetModel  # start-up time (data.prepare --help)

            model = target_model
            if model is None or not model.has_layers:  # none given, or only its embedding and head (offline run)
                where = {} if model is None else {"dtype": model.dtype, "device": model.device}
                model = TargetModel.from_pretrained(target, **where)
        gen = make_generator(spec, model=server_model, target=model, thinking=thinking, **gen_kwargs)
        report = run_regeneration(tee(), out / REGEN_FILE, gen, progress=progress)
    log(report.line())
    if report.failed:
        raise RegenerationError(f"{report.failed} of {report.rows_total} conversations failed to regenerate "
                                f"({report.error_summary()}); rerun the same command to retry them (the answers "
                                f"already generated are kept in {out / REGEN_FILE})")
    return model, keys, report


def regenerated_conversations(path: Path, keys: list[str], stats, answers: Counter | None = None) -> Iterator[dict]:
    """The regenerated conversations in source order, looked up by key; assistant turns keep their token ids.

    ``answers`` counts what the answers used hold (rows, truncated rows, turns, tokens generated), whichever
    run generated them: a resumed run's own report counts only what it generated."""
    index = index_rows(path)
    with path.open() as f:
        for pos, key in enumerate(keys):
            stats.seen += 1
            if key not in index:
                stats.skipped["not regenerated"] += 1
                continue
            f.seek(index[key])
            row = json.loads(f.readline())
            try:  # a target answer can be empty (EOS first): same rules as any source row
                messages = to_messages(row, "openai")
            except BadRow as why:
                stats.skipped[str(why)] += 1
                continue
            if answers is not None and isinstance(row.get("regen"), dict):  # rows kept only
                regen = row["regen"]
                answers.update({"rows": 1, "truncated": int("length" in regen.get("finish_reasons", [])),
                                "turns": regen.get("turns", 0), "tokens_generated": regen.get("tokens", 0)})
            generated = [m for m in row["messages"] if m.get("role") == "assistant"]
            reasons = list((row.get("regen") or {}).get("finish_reasons") or [])
            reasons += [None] * (len(generated) - len(reasons))
            for new, raw, reason in zip((m for m in messages if m["role"] == "assistant"), generated, reasons):
                if raw.get("token_ids") is not None:
                    new["token_ids"] = raw["token_ids"]
                if reason == "length":  # cut at max tokens: the template's end-of-turn token is not a label
                    new["cut"] = True
            stats.kept += 1
            yield {"id": str(pos), "messages": messages}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target folder or Hub id (its tokenizer and chat template)")
    p.add_argument("--source", required=True,
                   help=".jsonl/.json/.parquet file, a datasets folder, or a Hub data set id")
    p.add_argument("--out", required=True, help="output folder (a datasets save_to_disk folder + stats.json)")
    p.add_argument("--regenerate", metavar="local|vllm|sglang|URL",
                   help="regenerate assistant turns with the target: 'local' (in-process), 'vllm' / 'sglang' "
                        "(started here on a free port, stopped after), or a running server's base URL")
    p.add_argument("--thinking", choices=["on", "off", "default"], default="default",
                   help="chat template thinking switch, as the target will be served (default: template default)")
    p.add_argument("--max-length", type=int, default=None, help="truncate rows to N tokens (and the packing budget)")
    p.add_argument("--pack", action="store_true", help="pack rows up to --max-length, keeping doc_ids/position_ids")
    p.add_argument("--limit", type=int, default=None, help="only the first N usable conversations")
    p.add_argument("--split", default="train", help="data set split (Hub or datasets folder; default train)")
    p.add_argument("--subset", default=None, help="Hub data set subset / config name")
    p.add_argument("--streaming", action="store_true", help="stream a Hub data set instead of downloading it whole")
    p.add_argument("--rebuild", action="store_true",
                   help="--out was prepared with other settings: rebuild it (default: refuse, naming the difference)")
    p.add_argument("--num-proc", type=int, default=None,
                   help="tokenizer processes (default: 1 below 20k conversations, else up to 8)")
    p.add_argument("--server-log", default=None,
                   help="log of a started vLLM/SGLang (default OUT/regenerate-server.log)")
    p.add_argument("--engine-timeout", type=float, default=1800.0,
                   help="seconds a started vLLM/SGLang may take to come up (default 1800)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_generation_args(p)
    a = p.parse_args(argv)
    check_counts(p, a)
    if a.quantization != "none" and a.regenerate != "local":
        p.error("--quantization applies to --regenerate local (a server generates with the weights it serves)")
    gen_kwargs = dict(model=a.model, temperature=a.temperature, max_tokens=a.max_tokens, concurrency=a.concurrency,
                      batch_size=a.batch_size, retries=a.retries, backoff=a.backoff,
                      request_timeout=a.request_timeout)
    check_source(a.source, a.subset)  # before the target loads (minutes for a large one)
    check_target_tokenizer(a.target)  # before anything is written: transformers built an empty tokenizer without them
    from models.support import full_disk_named, hold

    # A second prepare into --out (a relaunch while the first still regenerates) would append to the same
    # answers file and clear what the first wrote: refused before the target loads.
    with full_disk_named(a.out, "it resumes: the regenerated answers are kept, the rest is redone"), \
            hold(a.out, LOCK, "--out", "wait for it to end (the same command then resumes), or give this one its "
                 "own --out", print):
        target_model = None
        if a.regenerate == "local":  # the target loads in minutes: what can be refused without it is refused first
            check_before_loading(a.target, a.source, a.out, rebuild=a.rebuild, regenerate=a.regenerate,
                                 thinking=parse_thinking(a.thinking), max_length=a.max_length, pack=a.pack,
                                 limit=a.limit, split=a.split, subset=a.subset, gen_kwargs=gen_kwargs)
            target_model = load_local_target(a, a.target)
        stats = prepare(a.target, a.source, a.out, regenerate=a.regenerate, thinking=parse_thinking(a.thinking),
                        max_length=a.max_length, pack=a.pack, limit=a.limit, split=a.split, subset=a.subset,
                        streaming=a.streaming, gen_kwargs=gen_kwargs, progress=not a.no_progress,
                        rebuild=a.rebuild, num_proc=a.num_proc, server_log=a.server_log,
                        engine_timeout=a.engine_timeout, target_model=target_model)
    print(json.dumps({"prepare": {k: stats[k] for k in ("rows", "documents", "tokens", "loss_tokens", "truncated",
                                                        "dropped_no_loss", "template_errors")}, "out": str(a.out)}))


def cli() -> None:
    """The ``draftsmith-prepare`` console script: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.support import run_cli

    run_cli(main, interrupted='rerun the same command to resume: regenerated answers are kept, the rest is redone')


if __name__ == "__main__":
    cli()
