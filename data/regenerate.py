"""Regenerate every assistant turn with the target itself, turn by turn, resumably.

A drafter learns to predict the *target's* tokens, so published recipes replace the data set's
answers with the target's own. User and system turns are kept; assistant turn ``i`` is replaced
by the target's answer to the conversation so far (with the already regenerated turns before it).

Two generators:

- :class:`HTTPGenerator` (:mod:`data.regen_http`): any OpenAI-compatible server (vLLM, SGLang, mlx_lm.server,
  ``python -m data.serve``). Conversations run ``concurrency`` at a time; failed requests are
  retried with exponential backoff; the thinking switch is sent as
  ``chat_template_kwargs.enable_thinking`` (what vLLM and SGLang read).
- :class:`LocalGenerator`: the target in this process, batched ``generate`` (small jobs, tests).

Output is an append-only JSONL file, one line per finished conversation, keyed by ``key``: a
hash of the conversation's prompts (:func:`data.readers.conversation_key`), not its row number,
so an edited or re-ordered source never picks up another conversation's answers. Restarting
with the same ``--out`` skips keys already in the file; a line cut short by a kill is removed
first. So an interrupted run continues where it stopped, with no duplicate and no lost row.
Conversations that fail after all retries are not written (a rerun tries them again) and are
listed in ``<out>.failed.jsonl``; the report keeps the count and the first message of each
kind of error.

Every regenerated assistant message keeps the generated ``token_ids`` (without the end-of-turn
token) next to its text: training uses the target's own ids, the text is for humans (decoding
and re-tokenizing is not the identity: byte-level BPE merges, invalid UTF-8). Servers are asked
for them with vLLM's ``return_token_ids``; a server that does not return them falls back to the
text, with one warning. Before the first HTTP request, :meth:`HTTPGenerator.preflight` asks
``/v1/models`` once whether the server answers and serves the target, and fails in one line
with the command that starts one otherwise.

    python -m data.regenerate --source chats.jsonl --out regen.jsonl --server http://127.0.0.1:8000/v1 \\
        --model Qwen/Qwen3-8B --concurrency 64 --thinking off --max-tokens 4096
    python -m data.regenerate --source chats.jsonl --out regen.jsonl --target ./tiny-target --batch-size 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

from tqdm import tqdm

from data.chat import encode, render
from data.readers import ReadStats, iter_conversations, no_usable_rows, split_think
from data.regen_common import (Completion, RegenerationError, RegenReport, ServerUnavailable,  # noqa: F401
                               _assistant_message, _for_template, _result_row)
from data.regen_http import HTTPGenerator, start_command  # noqa: F401 (re-exported)
from models.support import hold


# ----------------------------------------------------------------------------- in-process
def generate_batch(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   seed: int | None = None) -> list[tuple[list[int], bool]]:
    """Left-padded batched ``generate``; per prompt: (new tokens without EOS, stopped at EOS)."""
    import torch  # start-up time (data.regenerate and data.prepare --help)

    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = target.eos_token_ids() or [tok.eos_token_id]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
    if seed is not None:
        torch.manual_seed(seed)
    kwargs = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = target.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                                    eos_token_id=eos, pad_token_id=pad, top_p=None, top_k=None, **kwargs)
    results = []
    for row in out[:, width:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        results.append((row if stop is None else row[:stop], stop is not None))
    return results


def decode_answer(tokenizer, tokens: list[int]) -> tuple[str | None, str]:
    """Generated tokens -> (reasoning, content). Special tokens are kept so ``<think>`` survives."""
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    if tokenizer.pad_token:
        text = text.replace(tokenizer.pad_token, "")
    return split_think(text)


class LocalGenerator:
    """The target in this process: conversations in batches, the batch advanced turn by turn."""

    def __init__(self, target, *, temperature: float = 0.0, max_tokens: int = 512, thinking: bool | None = None,
                 batch_size: int = 8):
        if target.tokenizer is None:
            raise ValueError("in-process regeneration needs the target's tokenizer (none found in its folder)")
        self.target, self.temperature, self.max_tokens = target, temperature, max_tokens
        self.thinking, self.batch_size = thinking, batch_size

    def regenerate_batch(self, convs: list[dict]) -> list[dict]:
        tok = self.target.tokenizer
        msgs = [[] for _ in convs]
        comps = [[] for _ in convs]
        pos = [0] * len(convs)  # next source message index per conversation
        while True:
            # advance each conversation to its next assistant turn, copying user/system turns
            waiting = []
            for k, conv in enumerate(convs):
                src = conv["messages"]
                while pos[k] < len(src) and src[pos[k]]["role"] != "assistant":
                    msgs[k].append(src[pos[k]])
                    pos[k] += 1
                if pos[k] < len(src):
                    waiting.append(k)
            if not waiting:
                break
            prompts = [encode(tok, render(tok, _for_template(msgs[k]), add_generation_prompt=True,
                                          thinking=self.thinking)) for k in waiting]
            outs = generate_batch(self.target, prompts, self.max_tokens, self.temperature)
            for k, (tokens, stopped) in zip(waiting, outs):
                reasoning, content = decode_answer(tok, tokens)
                c = Completion(content, reasoning, "stop" if stopped else "length", len(tokens) + int(stopped),
                               list(tokens))
                comps[k].append(c)
                msgs[k].append(_assistant_message(c, self.thinking))
                pos[k] += 1
        return [_result_row(c, m, cs) for c, m, cs in zip(convs, msgs, comps)]

    def run(self, convs: Iterable[dict]) -> Iterator[tuple[dict, dict | Exception]]:
        convs = iter(convs)
        while batch := [c for _, c in zip(range(self.batch_size), convs)]:
            try:
                rows = self.regenerate_batch(batch)
            except Exception as e:  # report and continue with the next batch
                for c in batch:
                    yield c, e
                continue
            yield from zip(batch, rows)


# ----------------------------------------------------------------------------- resumable driver
def _complete_lines(path: Path) -> bytes:
    """The file's bytes up to its last newline; a trailing partial line (killed mid-write) is cut off."""
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with path.open("r+b") as f:
            f.truncate(keep)
    return data[:keep]


def row_key(row: dict) -> str | None:
    """A regenerated row's resume key; rows written before keys existed have none (regenerated again)."""
    return row.get("key")


def done_keys(path: Path) -> set[str]:
    """Conversation keys already in ``path`` (see :func:`data.readers.conversation_key`)."""
    return set(index_rows(path))


def done_ids(path: Path) -> set[str]:
    """Row ids already in ``path`` (for inspection; resume uses :func:`done_keys`)."""
    if not path.exists():
        return set()
    return {json.loads(line)["id"] for line in _complete_lines(path).splitlines() if line.strip()}


def index_rows(path: str | Path) -> dict[str, int]:
    """key -> byte offset of its line in ``path`` (first occurrence): random access without loading rows."""
    path = Path(path)
    if not path.exists():
        return {}
    index: dict[str, int] = {}
    offset = 0
    for line in _complete_lines(path).splitlines(keepends=True):
        if line.strip():
            key = row_key(json.loads(line))
            if key is not None:
                index.setdefault(key, offset)
        offset += len(line)
    return index


def read_rows(path: str | Path) -> list[dict]:
    """Regenerated rows sorted by id (numeric ids numerically): a deterministic order for inspection."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: (0, int(r["id"]), "") if str(r["id"]).isdigit() else (1, 0, str(r["id"])))


def regenerate(convs: Iterable[dict], out: str | Path, generator, *, progress: bool = True,
               total: int | None = None) -> RegenReport:
    """Regenerate ``convs`` into the JSONL file ``out``, skipping conversation keys it already holds.

    ``convs`` is consumed lazily (a streamed source is never held in memory); ``total`` only sizes
    the progress bar.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    have, queued = done_keys(out), set()
    report = RegenReport(out=str(out))
    failed_path = out.with_name(out.name + ".failed.jsonl")
    start = time.time()
    bar = tqdm(total=total, desc="regenerate", unit="row", disable=not progress)

    def todo() -> Iterator[dict]:
        for conv in convs:
            report.rows_total += 1
            key = conv.get("key", conv["id"])
            if key in have or key in queued:  # done by an earlier run, or the same prompt as a row before it
                report.already_done += key in have
                report.duplicates += key in queued
                bar.update(1)
                continue
            queued.add(key)
            yield conv

    failures = []
    with out.open("a") as f, bar:
        for conv, result in generator.run(todo()):
            if isinstance(result, Exception):
                report.failed += 1
                report.add_error(result)
                failures.append({"id": conv["id"], "key": conv.get("key"),
                                 "error": f"{type(result).__name__}: {result}"})
            else:
                f.write(json.dumps(result, ensure_ascii=False) + "\n")
                f.flush()  # one complete line per finished row: what resume relies on
                report.done += 1
                report.turns += result["regen"]["turns"]
                report.tokens_generated += result["regen"]["tokens"]
                report.truncated += "length" in result["regen"]["finish_reasons"]
            bar.update(1)
    if failures:
        failed_path.write_text("".join(json.dumps(x) + "\n" for x in failures))
    elif failed_path.exists():
        failed_path.unlink()
    report.seconds = round(time.time() - start, 3)
    return report


def settings_path(out: str | Path) -> Path:
    """``<out>.settings.json``: the generation settings the answers in ``out`` were made with."""
    out = Path(out)
    return out.with_name(out.name + ".settings.json")


def check_settings(out: str | Path, settings: dict) -> None:
    """Refuse to resume ``out`` when its answers were generated with other ``settings``, naming each
    change; record ``settings`` next to it otherwise (a resumed file never mixes two settings' answers).

    An output without recorded settings (written before they were) is resumed as it is."""
    out, path = Path(out), settings_path(out)
    recorded = None
    if path.is_file():
        try:
            recorded = json.loads(path.read_text())
        except ValueError:
            recorded = None
    if out.is_file() and out.stat().st_size and isinstance(recorded, dict):
        diff = [f"{k}: {recorded[k]!r} -> {v!r}" for k, v in settings.items() if k in recorded and recorded[k] != v]
        if diff:
            raise RegenerationError(
                f"{out} holds answers regenerated with other settings ({'; '.join(diff)}): resuming would mix "
                f"the answers of both. Write to a new --out, or delete {out} and {path} to regenerate every "
                "answer with these settings (or rerun with the recorded settings to resume it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n")


def check_out(source: str, out: str | Path) -> None:
    """Refuse an ``--out`` that is not this command's own answers file, before anything is written or loaded:
    the file is appended to, and a last line without a newline is cut first (a row killed mid-write), so
    ``--out`` naming the source (or other data) cut its last conversation and appended answers to it."""
    out = Path(out)
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a folder: give the JSONL file to write the answers to (e.g. "
                                f"{out / 'regenerated.jsonl'}); data.prepare --out is the one that takes a folder")
    if not out.is_file() or not out.stat().st_size:
        return
    if Path(source).is_file() and out.samefile(source):
        raise FileExistsError(f"--out {out} is the --source file: the answers would be appended to it (and its last "
                              "line cut when it has no newline): write them to a new file")
    with out.open("rb") as f:
        first = f.readline(1 << 20)
    if not first.endswith(b"\n"):  # a lone line cut by a kill during the first row's write: resume cuts it
        return
    try:
        row = json.loads(first)
    except (ValueError, UnicodeDecodeError):
        row = None
    if not (isinstance(row, dict) and "regen" in row):
        raise FileExistsError(f"--out {out} holds other data, not answers written by data.regenerate: they would be "
                              "appended to it (and its last line cut when it has no newline): write them to a new "
                              "file")


def make_generator(spec: str, *, model: str | None = None, target=None, thinking: bool | None = None,
                   temperature: float = 0.0, max_tokens: int = 512, concurrency: int = 8, batch_size: int = 8,
                   retries: int = 5, backoff: float = 1.0, request_timeout: float = 600.0, preflight: bool = True):
    """``spec`` is ``local`` (uses ``target``) or a server base URL (uses ``model``; checked first with
    :meth:`HTTPGenerator.preflight` unless ``preflight=False``)."""
    if spec == "local":
        if target is None:
            raise ValueError("--regenerate local needs a loaded target")
        return LocalGenerator(target, temperature=temperature, max_tokens=max_tokens, thinking=thinking,
                              batch_size=batch_size)
    if not spec.startswith(("http://", "https://")):
        raise ValueError(f"--regenerate {spec!r}: use 'local', 'vllm', 'sglang' or a server base URL like "
                         "http://127.0.0.1:8000/v1")
    gen = HTTPGenerator(spec, model or "", temperature=temperature, max_tokens=max_tokens, thinking=thinking,
                        concurrency=concurrency, retries=retries, backoff=backoff, timeout=request_timeout)
    if preflight:
        gen.preflight()
    return gen


def parse_thinking(value: str | None) -> bool | None:
    return {None: None, "on": True, "off": False, "default": None}[value]


def add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regeneration")
    g.add_argument("--model", help="model name sent to the server (default: the --target argument)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    g.add_argument("--max-tokens", type=int, default=2048, help="max new tokens per assistant turn (default 2048)")
    g.add_argument("--concurrency", type=int, default=16, help="conversations in flight against a server (default 16)")
    g.add_argument("--batch-size", type=int, default=8, help="conversations per batch in-process (default 8)")
    g.add_argument("--retries", type=int, default=5, help="retries per request, exponential backoff (default 5)")
    g.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds (default 1)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one server request may take before it is retried (default 600; a request in "
                        "flight also ends only then after Ctrl-C)")
    g.add_argument("--device", default="auto",
                   help="in-process generation: cuda, cpu, mps... (default auto: cuda when available, else cpu)")
    g.add_argument("--dtype", default="auto", help="in-process generation: bfloat16 (bf16), float32 (fp32) or "
                                                    "float16 (fp16) (default: the checkpoint's; float32 on cpu)")
    g.add_argument("--device-map", default=None,
                   help="in-process generation of a target larger than one GPU: auto | balanced | sequential")
    g.add_argument("--max-memory", default=None, help="with --device-map: budget per device, e.g. 0=70GiB,1=70GiB")
    g.add_argument("--quantization", default="none", metavar="none|mlx:PATH|mlx-4bit|bnb-4bit|fp8",
                   help="in-process generation by the quantized target the drafter will be trained against (as "
                        "target.quantization in training; mlx-Nbit quantizes --target into a target-mlx-Nbit-gG "
                        "folder beside the output)")


def check_counts(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Counts below 1 read nothing: --limit 0 / --batch-size 0 ended in "no usable conversations, read 0 rows"
    without naming the flag (and --max-length -5 silently cut the last 5 tokens of every row)."""
    fixes = {"limit": "use 1 or more conversations, or leave it out for all of them",
             "batch_size": "use 1 or more conversations per in-process batch (default 8)",
             "max_length": "use 1 or more tokens, or leave it out for no truncation",
             # these failed every conversation after the target loaded ("rerun to retry them"), or never ran
             "max_tokens": "use 1 or more new tokens per answer (default 2048)",
             "concurrency": "use 1 or more conversations in flight (default 16)"}
    for flag, fix in fixes.items():
        value = getattr(a, flag, None)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} {value}: {fix}")
    if getattr(a, "retries", 0) < 0:  # no try at all: every conversation failed with an internal error
        p.error(f"--retries {a.retries}: use 0 or more retries per request (default 5)")
    if not 0 <= getattr(a, "temperature", 0) < float("inf"):  # in-process, a negative one was greedy without a word
        p.error(f"--temperature {a.temperature}: use 0 for greedy answers or a positive value to sample")
    if not getattr(a, "request_timeout", 1) > 0:  # nan too: urllib's timeout would never or always fire
        p.error(f"--request-timeout {a.request_timeout}: use a positive number of seconds (default 600)")


def load_local_target(a: argparse.Namespace, path: str):
    """The in-process generator's target, placed as the flags say: on a GPU when there is one (a
    second CPU-only copy made local regeneration of a real data set hours slower than needed)."""
    import torch  # start-up time (data.regenerate and data.prepare --help)

    from models.support import check_device, parse_dtype
    from models.quantize import resolve_target  # start-up time (data.regenerate and data.prepare --help)
    from models.target import TargetModel  # start-up time (data.regenerate and data.prepare --help)

    # Flags first: a quantization below may take minutes, and torch's own errors come after the weights load.
    a.dtype, a.device = parse_dtype(a.dtype, auto=True), check_device(a.device, auto=True)
    # The answers must come from the weights training will use (data provenance is checked there).
    out = getattr(a, "out", None)  # mlx-Nbit: the quantized folder goes beside the output
    path, tq = resolve_target(path, a.quantization, Path(out).resolve().parent if out else Path.cwd())
    if a.device_map:
        return TargetModel.from_pretrained(path, dtype=a.dtype, device_map=a.device_map, max_memory=a.max_memory,
                                           quantization=tq)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = a.dtype if a.dtype != "auto" or device != "cpu" else "float32"
    return TargetModel.from_pretrained(path, dtype=dtype, device=device, max_memory=a.max_memory, quantization=tq)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m data.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="chat data: .jsonl/.json/.parquet, a datasets folder, or a Hub id")
    p.add_argument("--out", required=True, help="output JSONL; rerun with the same path to resume")
    p.add_argument("--server", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--target", help="target folder or Hub id: generate in-process (or the server's model name)")
    p.add_argument("--thinking", choices=["on", "off", "default"], default="default",
                   help="chat template thinking switch (enable_thinking); 'default' leaves the template's default")
    p.add_argument("--split", default="train", help="split of a Hub data set; \"+\" joins splits (default train)")
    p.add_argument("--subset", default=None, help="subset (configuration) of a Hub data set")
    p.add_argument("--limit", type=int, default=None, help="only the first N usable conversations")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    add_generation_args(p)
    a = p.parse_args(argv)
    check_counts(p, a)
    check_out(a.source, a.out)
    if not a.server and not a.target:
        p.error("give --server URL (OpenAI-compatible) or --target (in-process generation)")
    if a.server and a.quantization != "none":
        p.error("--quantization applies to in-process generation (--target without --server): a server generates "
                "with the weights it serves")
    # Two runs appending to one answers file regenerated the same conversations twice (and both paid for it).
    out = Path(a.out)
    with hold(out.parent, f"{out.name}.lock", "--out", "wait for it to end (the same command then resumes), or "
              "give this one its own --out", output=out):
        regenerate_from_args(a)


def regenerate_from_args(a: argparse.Namespace) -> None:
    """``main`` once the flags are checked, holding ``--out``."""
    stats = ReadStats()  # the source is streamed: read as regeneration goes
    convs = iter_conversations(a.source, split=a.split, subset=a.subset, limit=a.limit, stats=stats,
                               need_answers=False)
    # The first conversation is read before the target loads (minutes): a mistyped --source, or one without a
    # usable row, was found only after it, leaving an empty --out and its settings file behind.
    first = next(convs, None)
    if first is None:
        raise no_usable_rows(a.source, stats)
    convs = itertools.chain([first], convs)
    settings = lambda model: {"model": model, "quantization": a.quantization,  # noqa: E731
                              "thinking": parse_thinking(a.thinking), "max_tokens": a.max_tokens,
                              "temperature": a.temperature}
    target = None
    if not a.server:  # checked before the target loads (minutes for a large one), not after
        check_settings(a.out, settings(str(a.target)))
        target = load_local_target(a, a.target)
    gen = make_generator(a.server or "local", model=a.model or a.target, target=target,
                         thinking=parse_thinking(a.thinking), temperature=a.temperature, max_tokens=a.max_tokens,
                         concurrency=a.concurrency, batch_size=a.batch_size, retries=a.retries, backoff=a.backoff,
                         request_timeout=a.request_timeout)
    if a.server:  # the server's own name for its model, known after the preflight
        check_settings(a.out, settings(gen.model))
    report = regenerate(convs, a.out, gen, progress=not a.no_progress)
    print(stats.summary(), file=sys.stderr)
    if stats.kept == 0:
        raise no_usable_rows(a.source, stats)
    print(report.line())
    if report.failed:
        raise RegenerationError(f"{report.failed} conversations failed ({report.error_summary()}); see "
                                f"{a.out}.failed.jsonl, and rerun the same command to retry them")


def cli() -> None:
    """``draftsmith regenerate``: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.support import run_cli

    run_cli(main, interrupted='rerun the same command to resume: finished answers are kept')


if __name__ == "__main__":
    cli()
