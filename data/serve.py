"""A minimal OpenAI-compatible chat server over a target, stdlib only (for tests and debugging).

Not a production server: one request generates at a time (a lock), no streaming. It speaks
enough of the API for :class:`data.regenerate.HTTPGenerator` and other clients: ``POST
/v1/chat/completions`` (messages, max_tokens, temperature, ``chat_template_kwargs``) and
``GET /v1/models``; with ``return_token_ids`` (as vLLM) the choice carries the generated
``token_ids``, end-of-turn token included when the answer stopped. Requests are bounded: body
size, ``max_tokens`` capped, socket timeout. ``fail_first=N`` answers the first N requests with
503 and ``delay`` sleeps before each answer, to exercise client retries and interruption.
``--exit-after S`` stops the server after S seconds whatever happens (a stand-in engine in tests
can never outlive them).

    python -m data.serve --target ./tiny-target --port 8000
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from data.chat import encode, render
from data.regenerate import decode_answer, generate_batch

MAX_BODY = 4 << 20


def make_handler(target, model_name: str, max_tokens_cap: int, state: dict, delay: float = 0.0):
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        timeout = 60

        def log_message(self, *args):  # quiet: tests run many requests
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > MAX_BODY:
                return self._send(413, {"error": {"message": f"body must be 1..{MAX_BODY} bytes"}})
            with lock:
                state["requests"] += 1
                if state["requests"] <= state["fail_first"]:
                    return self._send(503, {"error": {"message": "injected failure"}})
            try:
                req = json.loads(self.rfile.read(length))
                messages = req["messages"]
                max_new = min(int(req.get("max_tokens") or max_tokens_cap), max_tokens_cap)
                temperature = float(req.get("temperature") or 0.0)
                thinking = (req.get("chat_template_kwargs") or {}).get("enable_thinking")
                want_ids = bool(req.get("return_token_ids"))
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": {"message": f"bad request: {e}"}})
            tok = target.tokenizer
            prompt = encode(tok, render(tok, messages, add_generation_prompt=True, thinking=thinking))
            with lock:
                time.sleep(delay)
                (tokens, stopped), = generate_batch(target, [prompt], max_new, temperature)
            reasoning, content = decode_answer(tok, tokens)
            message = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            n = len(tokens) + int(stopped)
            choice = {"index": 0, "message": message, "finish_reason": "stop" if stopped else "length"}
            if want_ids:  # as vLLM: the stop token is part of the output ids
                choice["token_ids"] = list(tokens) + ([target.eos_token_ids()[0]] if stopped else [])
            self._send(200, {"id": f"chatcmpl-{state['requests']}", "object": "chat.completion", "model": model_name,
                             "choices": [choice],
                             "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                       "total_tokens": len(prompt) + n}})

    return Handler


def start_server(target, host: str = "127.0.0.1", port: int = 0, model_name: str = "target",
                 max_tokens_cap: int = 4096, fail_first: int = 0, delay: float = 0.0):
    """Serve ``target`` in a daemon thread; returns (server, base_url). ``server.shutdown()`` stops it."""
    state = {"requests": 0, "fail_first": fail_first}
    server = ThreadingHTTPServer((host, port), make_handler(target, model_name, max_tokens_cap, state, delay))
    server.daemon_threads = True
    server.state = state
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}/v1"


def main(argv: list[str] | None = None) -> None:
    from models.target import TargetModel  # start-up time (data.serve --help)

    p = argparse.ArgumentParser(prog="python -m data.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target folder or Hub id")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    p.add_argument("--max-tokens-cap", type=int, default=4096, help="upper bound on max_tokens per request")
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: --target)")
    p.add_argument("--exit-after", type=float, default=None, metavar="S", help="stop after S seconds (tests)")
    a = p.parse_args(argv)
    target = TargetModel.from_pretrained(a.target)
    name = a.served_model_name or a.target
    server, url = start_server(target, a.host, a.port, model_name=name, max_tokens_cap=a.max_tokens_cap)
    print(f"serving {name} at {url}", flush=True)
    try:
        threading.Event().wait(a.exit_after)
    except KeyboardInterrupt:
        pass
    server.shutdown()


if __name__ == "__main__":
    main()
