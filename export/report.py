"""Read an ``inference.validate`` report (report.json) and render its numbers for the model card.

export never imports ``inference/``: the report is read as JSON and checked against the fields the
card shows, as ``inference/validate.py`` documents them (schema ``draftsmith.validate/1``, flat at
the top level, ``per_category`` beside). Two means of tau are kept apart, as every draftsmith
report names them: ``tau`` (pooled over all verify cycles: committed tokens / cycles, what
throughput follows; the headline) and ``tau_per_prompt_mean`` (the mean of per-prompt taus).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA = "draftsmith.validate/"
REQUIRED = ("backend", "device", "dtype", "target", "num_prompts")
NUMBERS = ("tau", "tau_per_prompt_mean")


class ReportError(ValueError):
    """The --report file is missing, not JSON, or not an inference.validate report."""


def load_report(path: str | Path) -> dict[str, Any]:
    """A validate report: its report.json, or the ``--out`` folder that holds one."""
    p = Path(path)
    if p.is_dir() and (p / "report.json").is_file():
        p = p / "report.json"
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
                          ". Re-run `python -m inference.validate ... --out DIR`, which writes DIR/report.json")
    return report


def report_problems(report: Any) -> list[str]:
    if not isinstance(report, dict):
        return ["the top level is not a JSON object"]
    if not str(report.get("schema", "")).startswith(SCHEMA):
        return [f"'schema' is {report.get('schema')!r}, expected {SCHEMA}1"]
    problems = [f"missing {k!r}" for k in REQUIRED if k not in report]
    problems += [f"{k!r} is not a number" for k in NUMBERS if not _num(report.get(k))]
    cats = report.get("per_category", {})
    if not isinstance(cats, dict) or not all(isinstance(c, dict) for c in cats.values()):
        problems.append("'per_category' must map a category name to its numbers")
    return problems


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any, digits: int = 2) -> str:
    return f"{v:.{digits}f}" if _num(v) else ("-" if v is None else str(v))


def _quantized(report: dict[str, Any]) -> str:
    q = report.get("draft_quantization")
    return f", {q}" if q else ""


def render_report(report: dict[str, Any]) -> list[str]:
    """Markdown lines: headline tau (both means), speedup, losslessness, per-category table, hardware."""
    quant = report.get("target_quantization") or "not quantized"
    out = ["## Validation (`python -m inference.validate`)", "",
           f"- acceptance length tau, pooled over all {report.get('num_cycles', '')} verify cycles: "
           f"**{_fmt(report['tau'])}** (mean of per-prompt taus: {_fmt(report['tau_per_prompt_mean'])}; "
           f"{report['num_prompts']} prompts, block size {report.get('block_size', '-')})"]
    if _num(report.get("speedup")):
        out.append(f"- decode speedup over the target alone: **{_fmt(report['speedup'])}x** "
                   f"({_fmt(report.get('dflash_tok_s'), 1)} vs {_fmt(report.get('baseline_tok_s'), 1)} tokens/s)")
    if _num(report.get("identical_share")):
        out.append(f"- prompts whose output equals the target's own, token for token: "
                   f"{report['identical_share']:.0%} (temperature {report.get('temperature', '-')})")
    if isinstance(report.get("position_acceptance"), list) and report["position_acceptance"]:
        out.append("- acceptance by draft position: " + ", ".join(_fmt(v) for v in report["position_acceptance"]))
    out.append(f"- backend `{report['backend']}`, device `{report['device']}`, dtype `{report['dtype']}` "
               f"(draft `{report.get('draft_dtype', '-')}`{_quantized(report)}), target `{report['target']}` ({quant})")
    cats = report.get("per_category") or {}
    if cats:
        out += ["", "| category | prompts | tau (pooled) | tau (per-prompt mean) | speedup |", "|---|---|---|---|---|"]
        for name, c in cats.items():
            out.append(f"| {name} | {_fmt(c.get('num_prompts'), 0)} | {_fmt(c.get('tau'))} | "
                       f"{_fmt(c.get('tau_per_prompt_mean'))} | {_fmt(c.get('speedup'))} |")
    return out + [""]
