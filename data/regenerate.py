"""Regenerate every assistant turn with the target itself, turn by turn, resumably.

A drafter learns to predict the *target's* tokens, so published recipes replace the data set's
answers with the target's own. User and system turns are kept; assistant turn ``i`` is replaced
by the target's answer to the conversation so far (with the already regenerated turns before it).

Two generators:

- :class:`HTTPGenerator`: any OpenAI-compatible server (vLLM, SGLang, mlx_lm.server,
  ``python -m data.serve``). Conversations run ``concurrency`` at a time; failed requests are
  retried with exponential backoff; the thinking switch is sent as
  ``chat_template_kwargs.enable_thinking`` (what vLLM and SGLang read).
- :class:`LocalGenerator`: the target in this process, batched ``generate`` (small jobs, tests).

Output is an append-only JSONL file, one line per finished conversation, keyed by ``id``.
Restarting with the same ``--out`` skips ids already in the file; a line cut short by a kill is
removed first. So an interrupted run continues where it stopped, with no duplicate and no lost
row. Conversations that fail after all retries are not written (a rerun tries them again) and
are listed in ``<out>.failed.jsonl``.

    python -m data.regenerate --source chats.jsonl --out regen.jsonl --server http://127.0.0.1:8000/v1 \\
        --model Qwen/Qwen3-8B --concurrency 64 --thinking off --max-tokens 4096
    python -m data.regenerate --source chats.jsonl --out regen.jsonl --target ./tiny-target --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from data.readers import split_think


@dataclass
class Completion:
    content: str
    reasoning: str | None
    finish_reason: str  # "stop" | "length"
    tokens: int


@dataclass
class RegenReport:
    rows_total: int = 0
    already_done: int = 0
    done: int = 0
    failed: int = 0
    truncated: int = 0  # rows with at least one turn cut at max tokens
    turns: int = 0
    tokens_generated: int = 0
    seconds: float = 0.0
    out: str = ""
    errors: dict = field(default_factory=dict)

    def line(self) -> str:
        return json.dumps({"regenerate": asdict(self)})


def _assistant_message(c: Completion, thinking: bool | None) -> dict:
    msg = {"role": "assistant", "content": c.content}
    if c.reasoning and thinking is not False:
        msg["reasoning_content"] = c.reasoning
    return msg


def _result_row(conv: dict, messages: list[dict], completions: list[Completion]) -> dict:
    row = {"id": conv["id"], "messages": messages}
    if "source_id" in conv:
        row["source_id"] = conv["source_id"]
    row["regen"] = {"turns": len(completions), "tokens": sum(c.tokens for c in completions),
                    "finish_reasons": [c.finish_reason for c in completions]}
    return row


# ----------------------------------------------------------------------------- HTTP
class HTTPGenerator:
    """Client for an OpenAI-compatible ``/chat/completions`` endpoint."""

    def __init__(self, base_url: str, model: str, *, temperature: float = 0.0, max_tokens: int = 2048,
                 thinking: bool | None = None, concurrency: int = 8, retries: int = 5, backoff: float = 1.0,
                 timeout: float = 600.0, api_key: str | None = None):
        base = base_url.rstrip("/")
        self.url = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model, self.temperature, self.max_tokens, self.thinking = model, temperature, max_tokens, thinking
        self.concurrency, self.retries, self.backoff, self.timeout = concurrency, retries, backoff, timeout
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY")

    def _post(self, payload: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def complete(self, messages: list[dict]) -> Completion:
        """One answer, retried on connection errors, timeouts, 429 and 5xx with exponential backoff."""
        payload = {"model": self.model, "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                   "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.thinking is not None:
            payload["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        for attempt in range(self.retries + 1):
            try:
                body = self._post(payload)
                choice = body["choices"][0]
                msg = choice["message"]
                reasoning = msg.get("reasoning_content") or msg.get("reasoning")
                content = msg.get("content") or ""
                if reasoning is None:
                    reasoning, content = split_think(content)
                tokens = (body.get("usage") or {}).get("completion_tokens", 0)
                return Completion(content, reasoning, choice.get("finish_reason") or "stop", tokens)
            except urllib.error.HTTPError as e:
                if e.code != 429 and e.code < 500 or attempt == self.retries:
                    raise RuntimeError(f"HTTP {e.code} from {self.url}: {e.read()[:300]!r}") from e
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                if attempt == self.retries:
                    raise RuntimeError(f"{self.url} unreachable after {self.retries + 1} tries: {e}") from e
            time.sleep(self.backoff * 2 ** attempt * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def regenerate_one(self, conv: dict) -> dict:
        messages: list[dict] = []
        completions = []
        for m in conv["messages"]:
            if m["role"] != "assistant":
                messages.append(m)
                continue
            c = self.complete(messages)
            completions.append(c)
            messages.append(_assistant_message(c, self.thinking))
        return _result_row(conv, messages, completions)

    def run(self, convs: list[dict]) -> Iterator[tuple[dict, dict | Exception]]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = {pool.submit(self.regenerate_one, c): c for c in convs}
            for fut in as_completed(futures):
                try:
                    yield futures[fut], fut.result()
                except Exception as e:  # one bad conversation must not stop the run
                    yield futures[fut], e


# ----------------------------------------------------------------------------- in-process
def generate_batch(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   seed: int | None = None) -> list[tuple[list[int], bool]]:
    """Left-padded batched ``generate``; per prompt: (new tokens without EOS, stopped at EOS)."""
    import torch

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
        from data.chat import encode, render

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
            prompts = [encode(tok, render(tok, msgs[k], add_generation_prompt=True, thinking=self.thinking))
                       for k in waiting]
            outs = generate_batch(self.target, prompts, self.max_tokens, self.temperature)
            for k, (tokens, stopped) in zip(waiting, outs):
                reasoning, content = decode_answer(tok, tokens)
                c = Completion(content, reasoning, "stop" if stopped else "length", len(tokens) + int(stopped))
                comps[k].append(c)
                msgs[k].append(_assistant_message(c, self.thinking))
                pos[k] += 1
        return [_result_row(c, m, cs) for c, m, cs in zip(convs, msgs, comps)]

    def run(self, convs: list[dict]) -> Iterator[tuple[dict, dict | Exception]]:
        for i in range(0, len(convs), self.batch_size):
            batch = convs[i:i + self.batch_size]
            try:
                rows = self.regenerate_batch(batch)
            except Exception as e:  # report and continue with the next batch
                for c in batch:
                    yield c, e
                continue
            yield from zip(batch, rows)


# ----------------------------------------------------------------------------- resumable driver
def done_ids(path: Path) -> set[str]:
    """Ids already in ``path``; a trailing partial line (killed mid-write) is cut off first."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep != len(data):
        with path.open("r+b") as f:
            f.truncate(keep)
    ids = set()
    for line in data[:keep].splitlines():
        if line.strip():
            ids.add(json.loads(line)["id"])
    return ids


def read_rows(path: str | Path) -> list[dict]:
    """Regenerated rows sorted by id (numeric ids numerically): a deterministic order for tokenizing."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: (0, int(r["id"]), "") if str(r["id"]).isdigit() else (1, 0, str(r["id"])))


def regenerate(convs: Iterable[dict], out: str | Path, generator, *, progress: bool = True) -> RegenReport:
    """Regenerate ``convs`` into the JSONL file ``out``, skipping ids it already holds."""
    from tqdm import tqdm

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    convs = list(convs)
    have = done_ids(out)
    todo = [c for c in convs if c["id"] not in have]
    report = RegenReport(rows_total=len(convs), already_done=len(convs) - len(todo), out=str(out))
    failed_path = out.with_name(out.name + ".failed.jsonl")
    start = time.time()
    with out.open("a") as f, tqdm(total=len(convs), initial=report.already_done, desc="regenerate",
                                  unit="row", disable=not progress) as bar:
        failures = []
        for conv, result in generator.run(todo):
            if isinstance(result, Exception):
                report.failed += 1
                key = type(result).__name__
                report.errors[key] = report.errors.get(key, 0) + 1
                failures.append({"id": conv["id"], "error": f"{type(result).__name__}: {result}"})
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


def make_generator(spec: str, *, model: str | None = None, target=None, thinking: bool | None = None,
                   temperature: float = 0.0, max_tokens: int = 512, concurrency: int = 8, batch_size: int = 8,
                   retries: int = 5, backoff: float = 1.0):
    """``spec`` is ``local`` (uses ``target``) or a server base URL (uses ``model``)."""
    if spec == "local":
        if target is None:
            raise ValueError("--regenerate local needs a loaded target")
        return LocalGenerator(target, temperature=temperature, max_tokens=max_tokens, thinking=thinking,
                              batch_size=batch_size)
    if not spec.startswith(("http://", "https://")):
        raise ValueError(f"--regenerate {spec!r}: use 'local' or a server base URL like http://127.0.0.1:8000/v1")
    return HTTPGenerator(spec, model or "default", temperature=temperature, max_tokens=max_tokens, thinking=thinking,
                         concurrency=concurrency, retries=retries, backoff=backoff)


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


def main(argv: list[str] | None = None) -> None:
    from data.readers import load_conversations

    p = argparse.ArgumentParser(prog="python -m data.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="chat data: .jsonl/.json/.parquet, a datasets folder, or a Hub id")
    p.add_argument("--out", required=True, help="output JSONL; rerun with the same path to resume")
    p.add_argument("--server", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--target", help="target folder or Hub id: generate in-process (or the server's model name)")
    p.add_argument("--thinking", choices=["on", "off", "default"], default="default",
                   help="chat template thinking switch (enable_thinking); 'default' leaves the template's default")
    p.add_argument("--split", default="train")
    p.add_argument("--subset", default=None)
    p.add_argument("--limit", type=int, default=None, help="only the first N usable conversations")
    p.add_argument("--no-progress", action="store_true")
    add_generation_args(p)
    a = p.parse_args(argv)
    if not a.server and not a.target:
        p.error("give --server URL (OpenAI-compatible) or --target (in-process generation)")
    convs, stats = load_conversations(a.source, split=a.split, subset=a.subset, limit=a.limit)
    print(stats.summary(), file=sys.stderr)
    target = None
    if not a.server:
        from models.target import TargetModel
        target = TargetModel.from_pretrained(a.target)
    gen = make_generator(a.server or "local", model=a.model or a.target, target=target,
                         thinking=parse_thinking(a.thinking), temperature=a.temperature, max_tokens=a.max_tokens,
                         concurrency=a.concurrency, batch_size=a.batch_size, retries=a.retries, backoff=a.backoff)
    report = regenerate(convs, a.out, gen, progress=not a.no_progress)
    print(report.line())
    if report.failed:
        sys.exit(f"{report.failed} conversations failed (see {a.out}.failed.jsonl); rerun to retry them")


if __name__ == "__main__":
    from models.cli import run_cli

    run_cli(main)
