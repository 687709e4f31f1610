"""Where training metrics go: the console, ``metrics.jsonl`` and (optionally) Weights & Biases.

One object, :class:`MetricsLogger`, behind ``log(row)`` and ``close()``. Only the main process
writes; the others hold a logger that drops everything. wandb is optional: when
``logging.wandb=true`` and it is not installed, a no-op run stands in and one warning says so.
The wandb run id is kept in the loop state (saved in every checkpoint), so ``resume=true``
continues the same wandb run instead of starting a new one.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def rounded(row: dict) -> dict:
    """A row for the console: floats to 4 decimals (4 significant digits below 0.001, so an lr of 6e-5
    does not print as 0.0), lists and dicts (histograms, per-slot) left out."""
    def short(v: float) -> float:
        return round(v, 4) if abs(v) >= 1e-3 or v == 0 else float(f"{v:.4g}")

    return {k: (short(v) if isinstance(v, float) else v) for k, v in row.items() if not isinstance(v, (list, dict))}


class _NoWandb:
    """Stands in for a wandb run when wandb is not installed (one warning at start)."""

    id = None

    def log(self, *_: Any, **__: Any) -> None:
        pass

    def finish(self) -> None:
        pass


def start_wandb(project: str, config: dict, out_dir: Path, mode: str | None, run_id: str | None,
                log: Callable[[str], None]):
    """A wandb run (the same run again when ``run_id`` is given), or a no-op one if wandb is missing."""
    try:
        import wandb  # optional dependency
    except ImportError:
        msg = (f"logging.wandb=true but wandb is not importable (pip install wandb): logging to the console and "
               f"{out_dir / 'metrics.jsonl'} only")
        warnings.warn(msg, stacklevel=2)
        log(f"warning: {msg}")
        return _NoWandb()
    return wandb.init(project=project, config=config, dir=str(out_dir), mode=mode, id=run_id,
                      resume="allow" if run_id else None)


class MetricsLogger:
    """``log(row)`` appends the row to ``metrics.jsonl``, sends its numbers to wandb and, when asked,
    prints it on the console (``echo``: a prefix such as ``"eval"``). ``close()`` ends the wandb run."""

    def __init__(self, path: Path | None, console: Callable[[str], None] | None = None, wandb_run=None):
        self.path, self.console, self.wandb_run = path, console, wandb_run

    @property
    def wandb_run_id(self) -> str | None:
        return getattr(self.wandb_run, "id", None)

    def log(self, row: dict, echo: str | None = None) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.wandb_run.log(numbers, step=row["step"])
        if echo and self.console is not None:
            self.console(f"{echo} " + json.dumps(rounded(row)))

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def open_metrics(cfg, out_dir: Path, is_main: bool, resumed_step: int, wandb_run_id: str | None,
                 log: Callable[[str], None]) -> MetricsLogger:
    """The run's logger: a fresh ``metrics.jsonl`` for a new run; on resume from step N, the rows up to N
    (the steps after the checkpoint are trained, and logged, again: kept, they would appear twice)."""
    if not is_main:
        return MetricsLogger(None)
    path = out_dir / "metrics.jsonl"
    resuming = resumed_step > 0
    if not resuming:
        path.write_text("")
    elif path.is_file():
        kept = [line for line in path.read_text().splitlines() if _step_of(line) <= resumed_step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    run = None
    if cfg.logging.wandb:
        run = start_wandb(cfg.logging.wandb_project, cfg.to_dict(), out_dir, cfg.logging.wandb_mode,
                          wandb_run_id if resuming else None, log)
    return MetricsLogger(path, log, run)


def _step_of(line: str) -> float:
    """The step a metrics row belongs to; a line cut short by a kill sorts past every step (dropped)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")
