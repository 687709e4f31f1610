"""Read an ``inference.validate`` report (report.json) and render its numbers for the model card.

export never imports ``inference/``: the report is read as JSON and checked against the fields the
card shows. Two means of tau are kept apart, as every draftsmith report names them: ``pooled``
(committed tokens / verify cycles over all prompts, what throughput follows; the headline) and
``per_prompt_mean`` (the mean of per-prompt taus).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REQUIRED = ("tau", "backend", "device", "dtype", "target")


class ReportError(ValueError):
    """The --report file is missing, not JSON, or not an inference.validate report."""


def load_report(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ReportError(f"--report {p} not found: pass the report.json written by `python -m inference.validate`")
    try:
        report = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"--report {p} is not valid JSON ({e}): pass the report.json written by "
                          "`python -m inference.validate`") from None
    problems = report_problems(report)
    if problems:
        raise ReportError(f"--report {p} is not an inference.validate report: " + "; ".join(problems) +
                          ". Re-run `python -m inference.validate ... --report report.json`")
    return report


def report_problems(report: Any) -> list[str]:
    if not isinstance(report, dict):
        return ["the top level is not a JSON object"]
    problems = [f"missing {k!r}" for k in REQUIRED if k not in report]
    tau = report.get("tau")
    if "tau" in report and not (isinstance(tau, dict) and _num(tau.get("pooled")) and _num(tau.get("per_prompt_mean"))):
        problems.append("'tau' must hold numbers 'pooled' and 'per_prompt_mean'")
    cats = report.get("categories", {})
    if not isinstance(cats, dict):
        problems.append("'categories' must map a category name to its figures")
    return problems


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any, digits: int = 2) -> str:
    return f"{v:.{digits}f}" if _num(v) else ("-" if v is None else str(v))


def render_report(report: dict[str, Any]) -> list[str]:
    """Markdown lines: headline tau (both means), speedup, per-category table, hardware."""
    tau = report["tau"]
    out = ["## Validation (`python -m inference.validate`)", "",
           f"- acceptance length tau, pooled over all verify cycles: **{_fmt(tau['pooled'])}** "
           f"(mean of per-prompt taus: {_fmt(tau['per_prompt_mean'])})"]
    if _num(report.get("speedup")):
        out.append(f"- speedup over the target alone: **{_fmt(report['speedup'])}x**")
    if "lossless" in report:
        out.append(f"- greedy output equals the target's: {report['lossless']}")
    out.append(f"- backend `{report['backend']}`, device `{report['device']}`, dtype `{report['dtype']}`, "
               f"target `{report['target']}`")
    cats = report.get("categories") or {}
    if cats:
        out += ["", "| category | prompts | tau (pooled) | tau (per-prompt mean) | speedup |", "|---|---|---|---|---|"]
        for name, c in cats.items():
            t = c.get("tau") or {}
            out.append(f"| {name} | {_fmt(c.get('prompts'), 0)} | {_fmt(t.get('pooled'))} | "
                       f"{_fmt(t.get('per_prompt_mean'))} | {_fmt(c.get('speedup'))} |")
    return out + [""]
