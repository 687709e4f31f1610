"""Helpers shared by the stages' bad-input cases (``tests/<stage>/test_bad_inputs.py``)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

# data re-use and preparation (data/reuse.py, data/prepare.py, data/regenerate.py, models/support.py)
_DATA_FIX = Path(__file__).parents[1] / "fixtures" / "data"


def _export_error(module: str, argv: list[str]) -> str:
    """The one line an export command ends with on a user mistake."""
    import importlib

    from models.support import run_cli

    main = importlib.import_module(f"export.{module}").main
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(argv))
    message = str(e.value.code)
    assert message.startswith("error: ") and "Traceback" not in message
    return message


def _generate(infer_dirs, *extra, target=None, draft=None):
    from inference.generate import main

    return main(["--backend", "torch", "--target", target or infer_dirs["target"], "--draft",
                 draft or infer_dirs["draft"], *extra])


def _validate(infer_dirs, *extra, target=None, draft=None):
    from inference.validate import main

    return main(["--backend", "torch", "--target", target or infer_dirs["target"], "--draft",
                 draft or infer_dirs["draft"], "--no-progress", "--out", str(infer_dirs["root"] / "out"), *extra])


def bench(module: str):
    return importlib.import_module(f"{module}.bench").main


def argparse_error(capsys, module: str, argv: list[str]) -> str:
    """The argparse error line (exit status 2) of ``python -m MODULE.bench ARGV``."""
    with pytest.raises(SystemExit) as e:
        bench(module)(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]
