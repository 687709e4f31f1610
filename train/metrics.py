"""Where training metrics go: the console, ``metrics.jsonl`` and (optionally) Weights & Biases.

One object, :class:`MetricsLogger`, behind ``log(row)`` and ``close()``. The rows are JSON in ``metrics.jsonl``;
the console gets lines a person reads (``step_line``, ``eval_line``, and the run's header and closing summary,
``run_header`` and ``closing_summary``, through ``header``). Only the main process writes; the others hold a
logger that drops everything. wandb is optional: when ``logging.wandb=true`` and it is not installed, a no-op run
stands in and one warning says so.
The wandb run id is kept in the loop state (saved in every checkpoint), so ``resume=true``
continues the same wandb run instead of starting a new one.
"""

from __future__ import annotations

import json
import shlex
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


# ----------------------------------------------------------------------------- console lines
# Keys the step line spells out itself; every other number of a row (ce, kl, grad_norm, what a new objective
# adds) follows as `name value`, so a new metric shows up without touching the line. Lists and dicts (per-slot
# figures, histograms) stay in metrics.jsonl.
STEP_KEYS = {"step", "epoch", "loss", "tau", "lr", "tokens_per_s", "anchors_per_s", "mfu"}
EVAL_KEYS = {"step", "eval_loss", "eval_tau_sim", "eval_blocks", "eval_tau_true", "eval_true_cycles",
             "eval_tau_true_uncut"}
SIMULATED_TAU = "acceptance of blocks at uniform anchors on held-out rows"
TRUE_TAU = "the real DFlash loop on {n} held-out prompt(s), cut at {m} new tokens"


def number(v: float) -> str:
    """A metric for the eye: 4 significant digits, small values in exponent form (an lr of 6e-5 is not 0.0)."""
    if isinstance(v, bool) or not isinstance(v, float):
        return str(v)
    if v == 0 or abs(v) >= 1e4:
        return f"{v:.0f}"
    return f"{v:.4g}" if abs(v) >= 1e-3 else f"{v:.2e}"


def clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def per_second(v: float) -> str:
    return f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"


def extras(row: dict, known: set[str]) -> list[str]:
    return [f"{k} {number(v)}" for k, v in row.items()
            if k not in known and isinstance(v, (int, float)) and not isinstance(v, bool)]


def step_line(row: dict, total: int, elapsed: float, left: float | None = None) -> str:
    """``step  20/200  epoch 0.25  loss 4.2156  sim tau 1.87  lr 0.0006  5.1k tok/s  MFU 0.517  0:01:02 (~0:09:18
    left)  ce 4.3  grad_norm 1.2``: a logged step (``step_row``) for the console (MFU on CUDA); the row itself goes
    to metrics.jsonl."""
    width = len(str(total))
    left_s = f" (~{clock(left)} left)" if left and left >= 1 else ""
    return "  ".join([f"step  {row['step']:>{width}}/{total}", f"epoch {row['epoch']:.2f}",
                      f"loss {row['loss']:.4f}", f"sim tau {row['tau']:.2f}", f"lr {number(row['lr'])}",
                      f"{per_second(row['tokens_per_s'])} tok/s",
                      *([f"MFU {row['mfu']:.3f}"] if row.get("mfu") is not None else []),  # on CUDA (train.flops)
                      clock(elapsed) + left_s, *extras(row, STEP_KEYS)])


def eval_line(row: dict, total: int | None = None) -> str:
    """``eval  200/200  held-out loss 3.9  sim tau 2.31 (512 blocks)  true tau 2.05 (96 cycles; 2.12 ...)``."""
    at = f"{row['step']:>{len(str(total))}}/{total}" if total else str(row["step"])
    parts = [f"eval  {at}"]
    if "eval_loss" in row:
        parts.append(f"held-out loss {row['eval_loss']:.4f}")
    if "eval_tau_sim" in row:
        parts.append(f"sim tau {row['eval_tau_sim']:.2f} ({row.get('eval_blocks', 0)} blocks)")
    if "eval_tau_true" in row:
        parts.append(f"true tau {row['eval_tau_true']:.2f} ({row.get('eval_true_cycles', 0)} cycles; "
                     f"{row.get('eval_tau_true_uncut', 0.0):.2f} uncut: each prompt's last cycle in full)")
    if len(parts) == 1:
        parts.append("no held-out rows (data.eval_rows=0)")
    return "  ".join(parts + extras(row, EVAL_KEYS))


def header(title: str, rows: list[tuple[str, str]]) -> str:
    """A titled block of ``name  value`` lines (the run's header and closing summary)."""
    width = max(len(name) for name, _ in rows)
    return "\n".join([title] + [f"  {name:<{width}}  {value}" for name, value in rows])


def tau_trend(evals: list[dict], key: str) -> str | None:
    """``0.96 at step 0 -> 2.27 at step 200`` over the evals that measured ``key``; None when none did."""
    seen = [r for r in evals if key in r]
    if not seen:
        return None
    ends = [seen[0]] if len(seen) == 1 else [seen[0], seen[-1]]
    return " -> ".join(f"{r[key]:.2f} at step {r['step']}" for r in ends)


def run_header(run, target, target_path: str, train_ds, eval_ds, d, n_params: int, sched, step: int) -> str:
    """What is about to train, once everything has loaded: target, data, drafter, steps, devices, output."""
    cfg, tr = run.cfg, run.cfg.train
    quantized = "" if target.quantization in (None, "none") else f", quantization {target.quantization}"
    warm = f", from {cfg.drafter.init_from}" if cfg.drafter.init_from else ""
    processes = f"{run.world} process{'es' if run.world > 1 else ''}"
    resumed = f", resumed at step {step}" if step else ""
    prepared = cfg.data.prepared or run.out_dir / "data"
    return header("training", [
        ("target", f"{target_path}: {target.model_type}, {target.num_layers} layers, "
                   f"{str(target.dtype).removeprefix('torch.')}{quantized}"),
        ("data", f"{len(train_ds)} training rows, {len(eval_ds)} held out ({prepared})"),
        ("drafter", f"{d.num_hidden_layers} layers, block {d.block_size}, taps {list(d.target_layer_ids)}, "
                    f"{n_params / 1e6:.2f}M parameters{warm}"),
        ("steps", f"{sched.total_steps} ({sched.total_steps / sched.steps_per_epoch:.3g} epochs of "
                  f"{sched.steps_per_epoch}){resumed}; {tr.batch_size * tr.grad_accum * run.world} rows a step "
                  f"(batch {tr.batch_size} x accumulation {tr.grad_accum} x {processes}); lr {tr.lr:g}, {tr.schedule}"),
        ("devices", f"{processes} on {run.device.type}, {'flex' if run.use_flex else 'dense'} attention, mixed "
                    f"precision {run.mixed_precision}"),
        ("output", f"{run.out_dir}: metrics.jsonl, checkpoints/, final/drafter (every setting: config.yaml)"),
    ])


def closing_summary(run, steps: int, resumed_at: int, evals: list[dict], prompts: int, drafter: Path,
                    target_path: str) -> str:
    """Elapsed time, where tau went (and what each tau means), where the drafter is, and the commands that
    take it further, with this run's paths."""
    cfg = run.cfg
    this_run = f" ({steps - resumed_at} in this run, resumed at step {resumed_at})" if resumed_at else ""
    sim, true = tau_trend(evals, "eval_tau_sim"), tau_trend(evals, "eval_tau_true")
    no_rows = "not measured (no held-out rows: data.eval_rows=0)" if not evals else None
    no_prompts = "eval.true_tau_prompts=0" if not cfg.eval.true_tau_prompts else "the held-out rows gave no prompts"
    rows = [("simulated tau", f"{sim}: {SIMULATED_TAU}" if sim else no_rows or "not measured"),
            ("true tau", f"{true}: {TRUE_TAU.format(n=prompts, m=cfg.eval.true_tau_max_new_tokens)}" if true
             else no_rows or f"not measured ({no_prompts})")]
    rows.append(("drafter", str(drafter)))
    q = shlex.quote
    tiny = cfg.data.source == "tiny"  # the tiny target only talks its own chats: no shipped prompt set suits it
    thinking = "" if cfg.data.thinking is None else f" --thinking {'on' if cfg.data.thinking else 'off'}"
    prompt = "Spell the word river." if tiny else "Explain speculative decoding in two sentences."
    export = Path(cfg.export.dir) if cfg.export.dir else run.out_dir / "export"
    commands = [
        f"draftsmith generate --target {q(str(target_path))} --draft {q(str(drafter))} --prompt {q(prompt)} --chat"
        f"{thinking} --baseline",
        f"draftsmith validate --target {q(str(target_path))} --draft {q(str(drafter))}"
        + (f" --prompts {q(str(run.out_dir / 'tiny_chat.jsonl'))} --n 16 --max-new-tokens "
           f"{cfg.eval.true_tau_max_new_tokens}" if tiny else "")
        + f"{thinking} --out {q(str(run.out_dir / 'validate'))}",
    ]
    if not cfg.export.hf:
        commands.append(f"draftsmith export-hf --checkpoint {q(str(drafter))} --out {q(str(export / 'hf'))}")
    if not cfg.export.push_repo:
        commands.append(f"draftsmith push --folder {q(str(export / 'hf'))} --repo YOUR_NAME/REPO --dry-run")
    return (header(f"done: {steps} steps{this_run} in {clock(time.perf_counter() - run.started)}", rows)
            + "\nnext:\n" + "\n".join(f"  {c}" for c in commands))


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
    """``log(row)`` appends the row to ``metrics.jsonl``, sends its numbers to wandb and, when asked, prints its
    console line (``echo``: ``step_line`` / ``eval_line`` of the row). ``close()`` ends the wandb run."""

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
            self.console(echo)

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
