"""The numbers of ``python -m inference.validate``: from the loops' own results to report.json / report.md.

Pure functions over ``inference.stats.GenerationResult``: nothing here runs a model. A prompt's
acceptance numbers come from its first DFlash repeat (greedy repeats are identical); its timings
are the median over ``--repeats``. Groups (a category, or all prompts) pool cycles and times:

- ``tau`` (headline) = committed tokens per verify cycle pooled over all cycles of the group
  (total committed / total cycles; a cycle commits accepted + 1, or what it emitted before the first
  EOS or the token budget, 0 when that was its first token): what throughput follows. ``tau_per_prompt_mean`` = the mean
  of the prompts' own taus, beside it; the two differ when prompts have different lengths.
- ``tau_uncut`` / ``tau_uncut_per_prompt_mean``: the same with each prompt's last cycle counted in full
  (its accepted drafts + 1, before the token budget or an EOS cut it), as earlier DFlash loops counted
  (``TAU_NAMES`` says which published numbers use which).
- ``acceptance_histogram`` {length: cycles}: sums to ``num_cycles``.
- ``position_acceptance[k-1]`` = share of cycles whose draft slot k was accepted: in [0, 1] and
  non-increasing in k (a slot is only accepted after every earlier one).
- ``tau_first_quarter`` / ``tau_last_quarter``: pooled over the first and last quarter of each
  prompt's cycles (drift as the context grows).
- ``dflash_tok_s`` / ``baseline_tok_s``: post-prefill decode tokens per second (tokens after the
  first one / decode seconds, summed over prompts); ``speedup`` = their ratio.
- ``cycle_s`` = DFlash decode seconds per cycle; ``baseline_token_s`` = target-alone seconds per
  token; ``cycle_cost`` = their ratio (what one draft + verify costs in target decode steps).
- ``ttft_s`` / ``baseline_ttft_s``: median time to first token (prefill + first sample).
- ``identical_share``: prompts whose DFlash output equals the baseline's token for token (greedy
  only; None when sampling); ``first_divergence_min``: the earliest index where one differs.
- ``truncated`` / ``baseline_truncated``: prompts whose output hit ``--max-new-tokens``.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from dataclasses import dataclass, field

from inference.stats import GenerationResult


@dataclass
class PromptRun:
    """Everything measured on one prompt: DFlash and baseline results, one per repeat."""

    id: str
    category: str
    prompt_tokens: int
    dflash: list[GenerationResult] = field(default_factory=list)
    baseline: list[GenerationResult] = field(default_factory=list)


# One line each in report.md: which published numbers count tau which way.
TAU_NAMES = (
    "tau (budget-cut): the cycle that ends a generation counts only the tokens it emitted before the token budget "
    "or the first EOS; how draftsmith and z-lab's current loop (at 07ebd93) count, what throughput follows.",
    "tau uncut: that last cycle counted with its full acceptance (accepted drafts + 1), as z-lab's earlier loop "
    "counted; many published figures use it, and it reads higher on short generations.",
)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where two outputs differ (None: identical)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def report_of(backend: str, result: GenerationResult, baseline: GenerationResult | None,
              greedy: bool = True) -> dict:
    """One generation against its baseline, as ``generate --json`` and ``bench`` report it. Sampled (``greedy``
    False), DFlash and the baseline draw their tokens differently from one seed, so their outputs differ by
    design: ``matches_baseline`` / ``first_divergence`` are None, as validate reports them, not a ``False``
    that reads as a lossless loop gone wrong."""
    report = {"backend": backend, **result.to_json()}
    if baseline is not None:
        report["baseline_decode_tokens_per_s"] = baseline.decode_tokens_per_s
        report["speedup"] = (result.decode_tokens_per_s / baseline.decode_tokens_per_s
                             if baseline.decode_tokens_per_s else None)
        first_diff = first_divergence(result.tokens, baseline.tokens) if greedy else None
        report["matches_baseline"] = first_diff is None if greedy else None
        report["first_divergence"] = first_diff
    return report


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _quarters(lengths: list[int]) -> tuple[list[int], list[int]]:
    q = max(1, len(lengths) // 4)
    return lengths[:q], lengths[-q:]


def prompt_numbers(run: PromptRun, greedy: bool) -> dict:
    d, b = run.dflash[0], run.baseline[0]
    lengths = d.acceptance_lengths
    first, last = _quarters(lengths) if lengths else ([], [])
    d_decode = _median([r.decode_s for r in run.dflash])
    b_decode = _median([r.decode_s for r in run.baseline])
    d_tokens, b_tokens = max(len(d.tokens) - 1, 0), max(len(b.tokens) - 1, 0)
    cycle_s = d_decode / len(lengths) if lengths else None
    base_token_s = b_decode / b_tokens if b_tokens else None
    div = first_divergence(d.tokens, b.tokens) if greedy else None
    return {
        "id": run.id, "category": run.category, "prompt_tokens": run.prompt_tokens,
        "new_tokens": len(d.tokens), "baseline_new_tokens": len(b.tokens),
        "num_cycles": len(lengths), "committed": sum(lengths), "tau": d.tau,
        "committed_uncut": d.committed_uncut, "tau_uncut": d.tau_uncut,
        "acceptance_lengths": list(lengths),
        "acceptance_histogram": {str(k): v for k, v in d.histogram().items()},
        "position_accepts": list(d.position_accepts),
        "tau_first_quarter": sum(first) / len(first) if first else None,
        "tau_last_quarter": sum(last) / len(last) if last else None,
        "decode_tokens": d_tokens, "baseline_decode_tokens": b_tokens,
        "dflash_decode_s": d_decode, "baseline_decode_s": b_decode,
        "dflash_tok_s": _ratio(d_tokens, d_decode) or 0.0, "baseline_tok_s": _ratio(b_tokens, b_decode) or 0.0,
        "speedup": _ratio(_ratio(d_tokens, d_decode) or 0.0, _ratio(b_tokens, b_decode) or 0.0),
        "ttft_s": _median([r.prefill_s for r in run.dflash]),
        "baseline_ttft_s": _median([r.prefill_s for r in run.baseline]),
        "cycle_s": cycle_s, "baseline_token_s": base_token_s,
        "cycle_cost": _ratio(cycle_s, base_token_s) if cycle_s is not None and base_token_s else None,
        "truncated": d.stop_reason == "max_new_tokens", "baseline_truncated": b.stop_reason == "max_new_tokens",
        "identical": (div is None) if greedy else None, "first_divergence": div,
        "stop_reason": d.stop_reason, "baseline_stop_reason": b.stop_reason,
    }


def group_numbers(rows: list[dict], block_size: int) -> dict:
    """Pool a group of per-prompt numbers (see the module docstring for every key)."""
    cycles = sum(r["num_cycles"] for r in rows)
    committed = sum(r["committed"] for r in rows)
    hist: Counter = Counter()
    pos = [0] * (block_size - 1)
    first: list[int] = []
    last: list[int] = []
    for r in rows:
        hist.update({int(k): v for k, v in r["acceptance_histogram"].items()})
        for k, v in enumerate(r["position_accepts"][:block_size - 1]):
            pos[k] += v
        f, la = _quarters(r["acceptance_lengths"]) if r["acceptance_lengths"] else ([], [])
        first += f
        last += la
    d_tokens = sum(r["decode_tokens"] for r in rows)
    b_tokens = sum(r["baseline_decode_tokens"] for r in rows)
    d_time = sum(r["dflash_decode_s"] for r in rows)
    b_time = sum(r["baseline_decode_s"] for r in rows)
    dflash_tok_s, baseline_tok_s = _ratio(d_tokens, d_time) or 0.0, _ratio(b_tokens, b_time) or 0.0
    cycle_s, base_token_s = _ratio(d_time, cycles), _ratio(b_time, b_tokens)
    identical = [r["identical"] for r in rows if r["identical"] is not None]
    divergences = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    return {
        "num_prompts": len(rows), "num_cycles": cycles, "num_tokens": sum(r["new_tokens"] for r in rows),
        "tau": _ratio(committed, cycles) or 0.0,
        "tau_per_prompt_mean": statistics.fmean([r["tau"] for r in rows if r["num_cycles"]] or [0.0]),
        "tau_uncut": _ratio(sum(r.get("committed_uncut", r["committed"]) for r in rows), cycles) or 0.0,
        "tau_uncut_per_prompt_mean": statistics.fmean([r.get("tau_uncut", r["tau"]) for r in rows if r["num_cycles"]]
                                                      or [0.0]),
        "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
        "position_acceptance": [v / cycles if cycles else 0.0 for v in pos],
        "tau_first_quarter": _ratio(sum(first), len(first)), "tau_last_quarter": _ratio(sum(last), len(last)),
        "dflash_tok_s": dflash_tok_s, "baseline_tok_s": baseline_tok_s, "speedup": _ratio(dflash_tok_s, baseline_tok_s),
        "cycle_s": cycle_s, "baseline_token_s": base_token_s,
        "cycle_cost": _ratio(cycle_s, base_token_s) if cycle_s is not None and base_token_s else None,
        "ttft_s": _median([r["ttft_s"] for r in rows]),
        "baseline_ttft_s": _median([r["baseline_ttft_s"] for r in rows]),
        "identical_share": (sum(identical) / len(identical)) if identical else None,
        "first_divergence_min": min(divergences) if divergences else None,
        "truncated": sum(r["truncated"] for r in rows),
        "baseline_truncated": sum(r["baseline_truncated"] for r in rows),
    }


def build_report(runs: list[PromptRun], block_size: int, greedy: bool, environment: dict) -> dict:
    """report.json: the environment, the overall numbers at top level, per category, per prompt."""
    rows = [prompt_numbers(r, greedy) for r in runs]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    report = {"schema": "draftsmith.validate/1", **environment, **group_numbers(rows, block_size)}
    report["per_category"] = {c: group_numbers([r for r in rows if r["category"] == c], block_size) for c in categories}
    report["per_prompt"] = rows
    return report


# ------------------------------------------------------------------ text
TABLE_COLUMNS = [  # (header, key, format)
    ("prompts", "num_prompts", "{}"), ("tau pooled", "tau", "{:.2f}"), ("tau per-prompt mean", "tau_per_prompt_mean",
                                                                        "{:.2f}"),
    ("tau uncut pooled", "tau_uncut", "{:.2f}"),
    ("DFlash tok/s", "dflash_tok_s", "{:.1f}"), ("baseline tok/s", "baseline_tok_s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"), ("cycle cost", "cycle_cost", "{:.2f}"), ("TTFT s", "ttft_s", "{:.3f}"),
    ("identical", "identical_share", "{:.0%}"), ("truncated", "truncated", "{}"),
]


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def table_rows(report: dict) -> list[list[str]]:
    rows = [["category"] + [h for h, _, _ in TABLE_COLUMNS]]
    groups = list(report["per_category"].items()) + [("all", report)]
    for name, g in groups:
        rows.append([name] + [_fmt(g.get(k), f) for _, k, f in TABLE_COLUMNS])
    return rows


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def markdown_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def markdown(report: dict) -> str:
    env_keys = ["backend", "loop", "device", "dtype", "draft_dtype", "draft_quantization", "target", "draft",
                "target_quantization", "block_size",
                "trained_block_size", "temperature", "thinking", "max_new_tokens", "repeats", "prompts",
                "prompt_set_hash", "prompt_tokens_total", "skipped_too_long", "peak_memory_bytes",
                "baseline_peak_memory_bytes",
                "platform", "python_version", "torch_version", "transformers_version", "mlx_version", "mlx_lm_version",
                "created"]
    hist = report["acceptance_histogram"]
    total = sum(hist.values()) or 1
    lines = [
        "# DFlash validation report", "",
        markdown_table(table_rows(report)), "",
        "tau pooled = committed tokens per verify cycle over all cycles (bonus token included): the headline, what "
        "throughput follows. tau per-prompt mean = the mean of each prompt's own tau. speedup = DFlash / baseline "
        "post-prefill decode tokens/s (baseline: the target alone through the same loop code, dtype and prompt ids). "
        "cycle cost = seconds per DFlash cycle / seconds per baseline token.", "",
        *(f"- {line}" for line in TAU_NAMES), "",
        f"Loop: {report.get('loop') or 'not recorded'} (DFlash and the baseline both ran it).", "",
        "## Acceptance", "",
        "| committed per cycle | cycles | share |", "|---|---|---|",
        *[f"| {k} | {v} | {v / total:.1%} |" for k, v in hist.items()], "",
        "Per-position acceptance (share of cycles whose draft slot k was accepted, k = 1..B-1): "
        + ", ".join(f"{x:.2f}" for x in report["position_acceptance"]), "",
        f"Drift: tau over the first quarter of each prompt's cycles {_fmt(report['tau_first_quarter'], '{:.2f}')}, "
        f"over the last quarter {_fmt(report['tau_last_quarter'], '{:.2f}')}.", "",
        "## Losslessness", "",
        (f"Identical to the baseline: {_fmt(report['identical_share'], '{:.1%}')} of prompts; earliest divergence at "
         f"token {_fmt(report['first_divergence_min'], '{}').replace('-', 'none')}." if report["temperature"] == 0 else
         "Sampling (temperature > 0): outputs are samples from the target's distribution, not compared token "
         "by token."),
        f"Outputs that hit --max-new-tokens: DFlash {report['truncated']}, baseline {report['baseline_truncated']}.",
        "",
        "## Environment", "",
        *[f"- {k}: {report.get(k)}" for k in env_keys], "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ compare
COMPARE_KEYS = ["tau", "tau_uncut", "tau_per_prompt_mean", "tau_uncut_per_prompt_mean", "speedup", "dflash_tok_s",
                "baseline_tok_s", "cycle_cost", "cycle_s", "ttft_s", "identical_share", "tau_first_quarter",
                "tau_last_quarter", "peak_memory_bytes", "baseline_peak_memory_bytes", "num_prompts", "truncated"]
COMPARE_INFO = ["backend", "device", "dtype", "target", "draft", "target_quantization", "block_size", "temperature",
                "thinking", "prompts", "prompt_set_hash", "max_new_tokens"]


def compare_rows(reports: list[dict], labels: list[str]) -> list[list[str]]:
    """Metric | one column per report | ratio of each later report to the first."""
    header = ["metric", *labels] + [f"{lb}/{labels[0]}" for lb in labels[1:]]
    rows = [header]
    for k in COMPARE_INFO:
        rows.append([k, *[str(r.get(k)) for r in reports]] + [""] * (len(reports) - 1))
    categories = list(dict.fromkeys(c for r in reports for c in r.get("per_category", {})))
    keyed = [(k, [r.get(k) for r in reports]) for k in COMPARE_KEYS]
    for c in categories:
        for k in ("tau", "tau_uncut", "speedup"):
            keyed.append((f"{c}: {k}", [r.get("per_category", {}).get(c, {}).get(k) for r in reports]))
    for name, values in keyed:
        ratios = [_fmt(_ratio(v, values[0]) if isinstance(v, (int, float)) and isinstance(values[0], (int, float))
                       else None, "{:.3f}") for v in values[1:]]
        rows.append([name, *[_fmt(v, "{:.4g}") for v in values], *ratios])
    return rows


# ------------------------------------------------------------------ plot
def write_plot(reports: list[dict], labels: list[str], path: str) -> str | None:
    """Acceptance-length histogram (share of cycles) + per-position acceptance, one series per report.

    matplotlib is an optional extra (``pip install 'draftsmith[plot]'``): without it, one warning and
    no file (returns None).
    """
    try:  # optional dependency: the plot extra
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger("inference").warning("matplotlib is not installed: skipping %s "
                                               "(pip install 'draftsmith[plot]')", path)
        return None
    fig, (ax_h, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(reports)
    block = max(int(r.get("block_size") or len(r["position_acceptance"]) + 1) for r in reports)
    for i, (r, label) in enumerate(zip(reports, labels)):
        hist = {int(k): v for k, v in r["acceptance_histogram"].items()}
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        ax_h.bar([x + (i - (len(reports) - 1) / 2) * width for x in xs], [hist[x] / total for x in xs], width=width,
                 label=f"{label} (tau {r['tau']:.2f})")
        rates = r["position_acceptance"]
        ax_p.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    low = min([int(k) for r in reports for k in r["acceptance_histogram"]] or [1])  # 0: a cycle cut at once
    ax_h.set_xticks(range(low, block + 1))
    ax_h.set_xlim(low - 0.6, block + 0.6)
    ax_p.set_xticks(range(1, block))
    ax_h.set_xlabel("committed tokens per cycle (bonus included)")
    ax_h.set_ylabel("share of cycles")
    ax_h.set_title("Acceptance length")
    ax_p.set_xlabel("draft position k")
    ax_p.set_ylabel("share of cycles with slot k accepted")
    ax_p.set_ylim(0, 1.02)
    ax_p.set_title("Per-position acceptance")
    for ax in (ax_h, ax_p):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
