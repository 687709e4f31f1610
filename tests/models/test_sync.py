"""A failure on the main process while the others wait for it reaches every process (2 CPU processes, gloo)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import torch.distributed as dist
from models.support import run_on_main

dist.init_process_group("gloo")
def prepare():
    if sys.argv[1] == "fail":
        raise ValueError("data.source=missing.jsonl does not exist")
    if sys.argv[1] == "interrupt":
        raise KeyboardInterrupt("ctrl-c")
    return "prepared"
try:
    print("result", run_on_main(prepare, what="data preparation"), flush=True)
except BaseException as e:
    print(f"raised {type(e).__name__}: {e}", flush=True)
    sys.exit(1)
finally:
    dist.destroy_process_group()
"""


def _run_two(mode: str) -> list[subprocess.CompletedProcess]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env={**base, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=120)  # before run_on_main, rank 1 waited here forever
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a process is still waiting for the main process") from None
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return out


@pytest.mark.parametrize("mode, error", [("fail", "ValueError: data.source=missing.jsonl does not exist"),
                                         # not an Exception: the main process must still reach the collective
                                         ("interrupt", "KeyboardInterrupt: ctrl-c")])
def test_main_process_failure_or_ctrl_c_reaches_every_process(mode, error):
    main, other = _run_two(mode)
    assert main.returncode == other.returncode == 1
    assert f"raised {error}" in main.stdout
    assert f"raised MainProcessFailed: data preparation failed on the main process ({error})" in other.stdout
