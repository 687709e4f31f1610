"""The OpenAI-compatible HTTP client of :mod:`data.regenerate` (vLLM, SGLang, mlx_lm.server, data.serve).

Conversations run ``concurrency`` at a time with a bounded read-ahead (a streamed source is never
held whole); failed requests are retried with exponential backoff; the thinking switch is sent as
``chat_template_kwargs.enable_thinking``; generated ids are asked for with ``return_token_ids``.
:meth:`HTTPGenerator.preflight` checks once, before any row, that the server answers and serves
the target.
"""

from __future__ import annotations

import json
import os
import random
import threading
import urllib.error
import urllib.request
import warnings
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Iterable, Iterator
from urllib.parse import urlsplit

from data.readers import split_think
from data.regen_common import (Completion, RegenerationError, ServerUnavailable, _assistant_message, _for_template,
                               _result_row)


class _BadResponse(Exception):
    """An HTTP 200 whose body holds no answer (retried like a 5xx)."""


def _start(raw: bytes | str, n: int = 300) -> str:
    """The start of a body, for error messages."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return repr(text[:n] + ("..." if len(text) > n else ""))


def start_command(model: str, port: int = 8000) -> str:
    """The commands that serve ``model`` the way regeneration expects (for error messages)."""
    return (f"`vllm serve {model} --port {port}` or `python -m sglang.launch_server --model-path {model} "
            f"--port {port}`")


def _same_name_but_path(a: str, b: str) -> bool:
    """``./models/Qwen3-8B`` vs ``Qwen/Qwen3-8B``: the same last path component."""
    last = lambda x: x.rstrip("/").rsplit("/", 1)[-1]
    return bool(last(a)) and last(a) == last(b)


class HTTPGenerator:
    """Client for an OpenAI-compatible ``/chat/completions`` endpoint."""

    def __init__(self, base_url: str, model: str, *, temperature: float = 0.0, max_tokens: int = 2048,
                 thinking: bool | None = None, concurrency: int = 8, retries: int = 5, backoff: float = 1.0,
                 timeout: float = 600.0, api_key: str | None = None):
        base = base_url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.url = self.base + "/chat/completions"
        self.model, self.temperature, self.max_tokens, self.thinking = model, temperature, max_tokens, thinking
        self.concurrency, self.retries, self.backoff, self.timeout = concurrency, retries, backoff, timeout
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self.ask_token_ids = True  # vLLM's return_token_ids; dropped if the server refuses the field
        self._warned_no_ids = False
        self._stop = threading.Event()  # set when the run is interrupted: retries stop waiting and give up

    @property
    def port(self) -> int:
        """The port of ``base_url`` (the default of its scheme when it names none), for the start command."""
        url = urlsplit(self.base)
        return url.port or (443 if url.scheme == "https" else 80)

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _post(self, payload: dict) -> dict:
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode(), headers=self._headers(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            raw = resp.read()
        try:
            return json.loads(raw)
        except ValueError:  # a cut body, an HTML page from a proxy: retried, and quoted if it stays so
            raise _BadResponse(f"a body that is not JSON: {_start(raw)}") from None

    def served_models(self, timeout: float = 10.0) -> list[str]:
        """Model ids from ``GET /v1/models`` (one request, no retry)."""
        req = urllib.request.Request(self.base + "/models", headers=self._headers(), method="GET")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = json.loads(resp.read())
        return [str(m.get("id")) for m in body.get("data") or [] if isinstance(m, dict)]

    def preflight(self, timeout: float = 10.0) -> None:
        """One ``/v1/models`` request: the server answers and serves the target, else one clear error.

        Costs one request instead of retrying every row against a server that is not there. A name
        that differs only by its path (``./Qwen3-8B`` vs ``Qwen/Qwen3-8B``) is accepted with a
        warning, and the server's name is used from then on.
        """
        try:
            served = self.served_models(timeout)
        except urllib.error.HTTPError as e:
            raise ServerUnavailable(f"the regeneration server at {self.base} answers /models with HTTP {e.code}: "
                                    "is it an OpenAI-compatible server (vLLM, SGLang)?") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise ServerUnavailable(
                f"no regeneration server answers at {self.base} ({reason}). Start one with the target: "
                f"{start_command(self.model or 'TARGET', self.port)}; or let draftsmith start it "
                "(data.regenerate=vllm|sglang, --regenerate vllm|sglang), or regenerate in-process (local) or not "
                "at all (none)") from None
        if self.model in served:
            return
        if not self.model and len(served) == 1:  # no name given: the server's only model
            self.model = served[0]
            return
        close = [m for m in served if _same_name_but_path(m, self.model)]
        if len(close) == 1:
            warnings.warn(f"the server at {self.base} serves {close[0]!r}, taken to be the target {self.model!r} "
                          "(same name, other path)", stacklevel=2)
            self.model = close[0]
            return
        raise ServerUnavailable(f"the server at {self.base} serves {served}, not the target {self.model!r}: serve "
                                f"the target ({start_command(self.model, self.port)}), or pass --model NAME if it is "
                                "the same model under another name")

    def _token_ids(self, choice: dict) -> list[int] | None:
        ids = choice.get("token_ids")  # vLLM (return_token_ids)
        if ids is None:
            ids = choice.get("output_ids")  # SGLang's name
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            return ids
        if not self._warned_no_ids:
            self._warned_no_ids = True
            warnings.warn(f"the server at {self.base} does not return generated token ids (vLLM's "
                          "return_token_ids): answers will be re-tokenized from their text, which may not give "
                          "the target's own ids", stacklevel=2)
        return None

    def _parse(self, body) -> Completion:
        """One answer from a response body; :class:`_BadResponse` when it holds none (retried like a 5xx)."""
        if not isinstance(body, dict):
            raise _BadResponse(f"a body that is not a JSON object: {_start(json.dumps(body))}")
        if body.get("error"):
            raise _BadResponse(f"error {_start(json.dumps(body['error'], ensure_ascii=False))}")
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) \
                or not isinstance(choices[0].get("message"), dict):
            raise _BadResponse(f"no choices[0].message in {_start(json.dumps(body, ensure_ascii=False))}")
        choice = choices[0]
        msg = choice["message"]
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if msg.get("content") is None and not reasoning:  # not an empty answer: no answer at all
            raise _BadResponse(f"no answer (content null, no reasoning) in {_start(json.dumps(body))}")
        content = msg.get("content") or ""
        if not isinstance(content, str):
            raise _BadResponse(f"content that is not text in {_start(json.dumps(body))}")
        if reasoning is None:
            reasoning, content = split_think(content)
        tokens = (body.get("usage") or {}).get("completion_tokens", 0)
        return Completion(content, reasoning, choice.get("finish_reason") or "stop", tokens, self._token_ids(choice))

    def complete(self, messages: list[dict]) -> Completion:
        """One answer, retried on connection errors, timeouts, 429, 5xx and 200 responses that hold no
        answer (a cut or non-JSON body, no choices, an ``error`` object, null content) with exponential
        backoff; gives up at once when the run is interrupted (:meth:`stop`)."""
        payload = {"model": self.model or "default",
                   "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                   "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.thinking is not None:
            payload["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        for attempt in range(self.retries + 1):
            if self.ask_token_ids:
                payload["return_token_ids"] = True
            else:
                payload.pop("return_token_ids", None)
            if self._stop.is_set():
                raise RegenerationError("regeneration was interrupted")
            try:
                return self._parse(self._post(payload))
            except _BadResponse as e:
                if attempt == self.retries:
                    raise RegenerationError(f"{self.url} answered HTTP 200 without a usable answer "
                                            f"{self.retries + 1} times; last: {e}") from None
            except urllib.error.HTTPError as e:
                detail = e.read()[:300]
                if e.code == 400 and self.ask_token_ids and b"return_token_ids" in detail:
                    self.ask_token_ids = False  # a strict server: ask again without the field (not a retry)
                    return self.complete(messages)
                if e.code != 429 and e.code < 500 or attempt == self.retries:
                    raise RegenerationError(f"HTTP {e.code} from {self.url}: {detail!r}") from e
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                if attempt == self.retries:
                    raise RegenerationError(f"{self.url} unreachable after {self.retries + 1} tries: {e}") from e
            if self._stop.wait(self.backoff * 2 ** attempt * (0.5 + random.random())):
                raise RegenerationError("regeneration was interrupted")
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Interrupted: requests not started are not sent, and retries give up instead of waiting."""
        self._stop.set()

    def regenerate_one(self, conv: dict) -> dict:
        messages: list[dict] = []
        completions = []
        for m in conv["messages"]:
            if m["role"] != "assistant":
                messages.append(m)
                continue
            c = self.complete(_for_template(messages))
            completions.append(c)
            messages.append(_assistant_message(c, self.thinking))
        return _result_row(conv, messages, completions)

    def run(self, convs: Iterable[dict]) -> Iterator[tuple[dict, dict | Exception]]:
        """Results as they finish; at most ``2 x concurrency`` conversations read ahead (streamed sources)."""
        convs = iter(convs)
        self._stop.clear()
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        finished_normally = False
        try:
            futures: dict = {}
            exhausted = False
            while True:
                while not exhausted and len(futures) < 2 * self.concurrency:
                    conv = next(convs, None)
                    if conv is None:
                        exhausted = True
                    else:
                        futures[pool.submit(self.regenerate_one, conv)] = conv
                if not futures:
                    finished_normally = True
                    return
                finished, _ = wait(futures, return_when=FIRST_COMPLETED)
                for fut in finished:
                    conv = futures.pop(fut)
                    try:
                        yield conv, fut.result()
                    except Exception as e:  # one bad conversation must not stop the run
                        yield conv, e
        finally:
            if not finished_normally:  # Ctrl-C, or the consumer stopped: do not wait for queued or retrying rows
                self.stop()
            pool.shutdown(wait=finished_normally, cancel_futures=not finished_normally)
