"""Console scripts (``draftsmith-distill``, ``draftsmith-generate``, ...): the same ``main`` as ``python -m <module>``.

A console script calls ``sys.exit(fn())``, so it cannot point at a ``main`` that returns a report
(a dict would be printed and exit 1); each one runs its module's ``main`` through
:func:`models.cli.run_cli`, as ``python -m`` does. The modules are imported on call: a script for a
CPU-only step never imports MLX, and this file imports nothing of ours at load time.
"""

from __future__ import annotations

import importlib

COMMANDS = {  # console script -> module whose main(argv=None) it runs
    "draftsmith-distill": "train.distill",
    "draftsmith-prepare": "data.prepare",
    "draftsmith-extract": "data.extract",
    "draftsmith-generate": "inference.generate",
    "draftsmith-validate": "inference.validate",
    "draftsmith-export-hf": "export.hf",
    "draftsmith-export-mlx": "export.mlx",
    "draftsmith-push": "export.push",
}


def run(module: str) -> None:
    """Run ``module.main()`` on ``sys.argv[1:]``; user errors end with one ``error:`` line."""
    from models.cli import run_cli

    run_cli(importlib.import_module(module).main)


def distill() -> None:
    run(COMMANDS["draftsmith-distill"])


def prepare() -> None:
    run(COMMANDS["draftsmith-prepare"])


def extract() -> None:
    run(COMMANDS["draftsmith-extract"])


def generate() -> None:
    run(COMMANDS["draftsmith-generate"])


def validate() -> None:
    run(COMMANDS["draftsmith-validate"])


def export_hf() -> None:
    run(COMMANDS["draftsmith-export-hf"])


def export_mlx() -> None:
    run(COMMANDS["draftsmith-export-mlx"])


def push() -> None:
    run(COMMANDS["draftsmith-push"])
