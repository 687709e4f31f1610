"""Start an inference engine (vLLM or SGLang) for regeneration, and always stop it again.

``data.regenerate=vllm`` (or ``--regenerate vllm``) makes one command do the whole job on one
node: the engine is started as a subprocess on a free local port with the target, draftsmith
waits until ``/v1/models`` lists the target, regenerates through it, and stops it (also on an
error or Ctrl-C) before training starts, so its GPU memory is free again. The engine's output
goes to a log file (``out_dir/regenerate-server.log``); when it dies or does not come up in time
the error shows the log's last lines.

A training run already holds the target on its GPU when it prepares data; ``make_room`` (see
:func:`offloaded`) moves it to the CPU while the engine runs, so the engine finds the memory it
asks for (vLLM takes 90% of a GPU by default). Engines spread over several GPUs
(``--tensor-parallel-size``) need the other processes' GPUs too: prepare the data first with
``python -m data.prepare ... --regenerate vllm``, then train on it.

The command is a template with ``{target}``, ``{host}``, ``{port}`` and ``{python}`` fields.
``DRAFTSMITH_ENGINE_COMMAND`` replaces the built-in one (extra engine flags such as
``--tensor-parallel-size 8``, or a stand-in server in tests)::

    DRAFTSMITH_ENGINE_COMMAND='vllm serve {target} --host {host} --port {port} --tensor-parallel-size 8'
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import torch

from data.regenerate import RegenerationError

ENGINES = {
    "vllm": ("vllm", "vllm serve {target} --host {host} --port {port} --served-model-name {target}"),
    "sglang": ("sglang", "{python} -m sglang.launch_server --model-path {target} --host {host} --port {port} "
                         "--served-model-name {target}"),
}
ENV_COMMAND = "DRAFTSMITH_ENGINE_COMMAND"


class EngineError(RegenerationError):
    """The engine is not installed, died, or did not become healthy in time."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_command(engine: str, target: str, host: str, port: int, template: str | None = None) -> list[str]:
    """The argv that starts ``engine`` for ``target``; refuses an engine that is not installed."""
    if engine not in ENGINES:
        raise EngineError(f"unknown engine {engine!r}: use one of {sorted(ENGINES)}")
    template = template or os.environ.get(ENV_COMMAND)
    if not template:
        module, template = ENGINES[engine]
        if importlib.util.find_spec(module) is None:
            raise EngineError(f"data.regenerate={engine} starts {engine} itself, but {engine} is not installed here "
                              f"(pip install {module}); or start a server elsewhere and set data.regenerate to its "
                              "URL (http://HOST:PORT/v1), or use data.regenerate=local|none")
    fields = {"target": shlex.quote(str(target)), "host": host, "port": str(port),
              "python": shlex.quote(sys.executable)}
    return shlex.split(template.format(**fields))


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the engine gets SIGTERM if draftsmith dies without cleaning up (kill -9)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _healthy(base: str, target: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/models", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the engine's process group, SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def offloaded(module) -> Iterator[None]:
    """``module`` on the CPU for the ``with`` block (GPU memory released), then back where it was."""
    device = next(module.parameters()).device
    if device.type != "cuda":
        yield
        return
    module.to("cpu")
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        module.to(device)


@contextlib.contextmanager
def running_engine(engine: str, target: str, log_path: str | Path, *, timeout: float = 1800.0,
                   command: str | None = None, host: str = "127.0.0.1", log=print,
                   make_room=None) -> Iterator[str]:
    """Run ``engine`` serving ``target`` for the ``with`` block; yields its base URL (``.../v1``).

    Bound to ``host`` (local only by default). Stopped on leaving the block, whatever the reason.
    ``make_room``: a context manager factory entered while the engine runs (:func:`offloaded`).
    """
    with make_room() if make_room is not None else contextlib.nullcontext():
        yield from _run(engine, target, log_path, timeout=timeout, command=command, host=host, log=log)


def _run(engine: str, target: str, log_path: str | Path, *, timeout: float, command: str | None, host: str,
         log) -> Iterator[str]:
    port = free_port(host)
    argv = engine_command(engine, target, host, port, command)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    base = f"http://{host}:{port}/v1"
    log(f"starting {engine} for regeneration: {shlex.join(argv)} (log: {log_path})")
    with log_path.open("ab") as log_file:
        try:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as e:
            raise EngineError(f"could not start {engine} ({shlex.join(argv)}): {e}") from None
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(base, target):
            if proc.poll() is not None:
                raise EngineError(f"{engine} exited with code {proc.returncode} before it served {target}; last "
                                  f"lines of {log_path}:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise EngineError(f"{engine} did not answer at {base} within {timeout:.0f} s; last lines of "
                                  f"{log_path}:\n{log_tail(log_path)}")
            time.sleep(0.5)
        log(f"{engine} is up at {base}")
        yield base
    finally:
        stop(proc)
        log(f"{engine} stopped")
