"""`python -m inference.validate`: report numbers checked against the loops' own stats, both backends, --compare.

Tiny Qwen3 target (fp32, CPU) with a random drafter (tau ~ 1) and a perfect stand-in drafter that
proposes the target's own continuation (tau = block size). Three short prompts, a few tokens each.
"""

import json
import subprocess
import sys

import pytest
import torch

from inference.session import Session
from inference.prompt_sets import BUILTIN, load_prompts, prompt_set_hash, render_prompts
from inference.report import build_report
from inference.validate import main, measure, run_compare
from models.drafter import DFlashDraftModel
from models.target import TargetModel
from models.tiny import save_tiny_target
from tests.helpers import ReferenceProposer, tiny_drafter_config

NEW = 12
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPTS = [
    {"id": "a", "category": "code", "messages": [{"role": "user", "content": "def f(x):"}]},
    {"id": "b", "category": "code", "messages": [{"role": "user", "content": "print(1)"}]},
    {"id": "c", "category": "chat", "messages": [{"role": "user", "content": "hello there"}]},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    target_dir = save_tiny_target(root / "target", "qwen3")
    target = TargetModel.from_pretrained(target_dir)
    torch.manual_seed(0)
    DFlashDraftModel(tiny_drafter_config(target)).save_pretrained(root / "draft")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {"root": root, "target": str(target_dir), "draft": str(root / "draft"), "prompts": str(prompts)}


def run_validate(setup, backend: str, out: str) -> dict:
    return main(["--backend", backend, "--target", setup["target"], "--draft", setup["draft"], "--prompts",
                 setup["prompts"], "--max-new-tokens", str(NEW), "--out", out, "--no-progress"])


@pytest.fixture(scope="module")
def torch_report(setup):
    return run_validate(setup, "torch", str(setup["root"] / "torch"))


def check_consistent(report: dict, block: int) -> None:
    """What must hold in every report, whatever the drafter."""
    groups = [report, *report["per_category"].values()]
    for g in groups:
        assert sum(g["acceptance_histogram"].values()) == g["num_cycles"]
        rates = g["position_acceptance"]
        assert len(rates) == block - 1 and all(0.0 <= x <= 1.0 for x in rates)
        assert all(a >= b for a, b in zip(rates, rates[1:])), rates
        assert 0.0 < g["tau"] <= block
    for p in report["per_prompt"]:
        assert sum(p["acceptance_histogram"].values()) == p["num_cycles"] == len(p["acceptance_lengths"])
        assert p["committed"] == sum(p["acceptance_lengths"]) == p["decode_tokens"]  # tau x cycles = tokens
    assert report["num_cycles"] == sum(p["num_cycles"] for p in report["per_prompt"])
    pooled = sum(sum(p["acceptance_lengths"]) for p in report["per_prompt"]) / report["num_cycles"]
    assert report["tau"] == pytest.approx(pooled)
    mean = sum(p["tau"] for p in report["per_prompt"]) / len(report["per_prompt"])
    assert report["tau_per_prompt_mean"] == pytest.approx(mean)


def test_torch_report_matches_the_loop_and_is_lossless(setup, torch_report):
    report = torch_report
    check_consistent(report, block=8)
    assert report["num_prompts"] == 3 and set(report["per_category"]) == {"code", "chat"}
    assert report["identical_share"] == 1.0 and report["first_divergence_min"] is None  # fp32 greedy
    assert report["tau"] < 1.5  # a random drafter almost never guesses the target's token
    assert report["dflash_tok_s"] > 0 and report["baseline_tok_s"] > 0 and report["speedup"] > 0
    assert report["truncated"] == sum(p["new_tokens"] == NEW for p in report["per_prompt"])
    assert report["backend"] == "torch" and report["dtype"] == "float32" and report["block_size"] == 8
    from pathlib import Path

    from models.weights import norm_signature

    signature = report["draft_signature"]  # what export.push matches the report to its folder by
    assert signature == norm_signature(Path(setup["draft"])) and len(signature) == 2 * 4 + 2  # 2 layers
    assert json.loads((Path(setup["root"]) / "torch" / "report.json").read_text())["draft_signature"] == signature
    assert report["thinking"] == "off" and len(report["prompt_set_hash"]) == 16 and report["torch_version"]
    assert report["draft_quantization"] is None  # a full-precision drafter (export.push matches it to the folder)
    # The report's per-prompt numbers are the loop's own: rerun the same prompt ids through the loop.
    session = Session("torch", setup["target"], setup["draft"])
    ids = render_prompts(session.tokenizer, load_prompts(setup["prompts"]), "off")
    for p, p_ids in zip(report["per_prompt"], ids):
        result, base = session.run(p_ids, baseline=True, max_new_tokens=NEW)
        assert p["prompt_tokens"] == len(p_ids) and p["acceptance_lengths"] == result.acceptance_lengths
        assert p["position_accepts"] == result.position_accepts and p["tau"] == pytest.approx(result.tau)
        assert p["new_tokens"] == len(result.tokens) and p["baseline_new_tokens"] == len(base.tokens)
    out = setup["root"] / "torch"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    md = (out / "report.md").read_text()
    assert "tau pooled" in md and "tau per-prompt mean" in md and "Losslessness" in md
    assert (out / "acceptance.png").read_bytes()[:8] == PNG_MAGIC


def test_an_interrupted_validate_measures_only_the_missing_prompts(setup, torch_report, monkeypatch, tmp_path):
    """Ctrl-C during the second prompt: partial.jsonl holds the first; the same command then measures
    prompts 2 and 3 only and gives the uninterrupted run's acceptance and outputs, and removes the file."""
    from inference.session import Session

    real, calls = Session.run, []

    def stop_in_the_second_prompt(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:  # 1: warm-up, 2: prompt 1, 3: prompt 2
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    out = str(tmp_path / "val")
    monkeypatch.setattr(Session, "run", stop_in_the_second_prompt)
    with pytest.raises(KeyboardInterrupt):
        run_validate(setup, "torch", out)
    lines = (tmp_path / "val" / "partial.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["index"] == 0
    monkeypatch.setattr(Session, "run", real)
    calls.clear()
    monkeypatch.setattr(Session, "run", lambda self, *a, **kw: (calls.append(1), real(self, *a, **kw))[1])
    report = run_validate(setup, "torch", out)
    assert report["resumed_prompts"] == 1 and len(calls) == 1 + 2  # warm-up + the two missing prompts
    for got, ref in zip(report["per_prompt"], torch_report["per_prompt"], strict=True):
        assert got["id"] == ref["id"] and got["acceptance_lengths"] == ref["acceptance_lengths"]
        assert got["new_tokens"] == ref["new_tokens"] and got["identical"] == ref["identical"]
    assert not (tmp_path / "val" / "partial.jsonl").exists() and torch_report["resumed_prompts"] == 0


def test_perfect_drafter_tau_is_the_block_size(setup):
    """A stand-in that proposes the target's own continuation: every cycle accepts the whole block."""
    session = Session("torch", setup["target"], setup["draft"])
    prompts = load_prompts(setup["prompts"])
    ids = render_prompts(session.tokenizer, prompts, "off")
    B = 8
    sequences = {}
    eos = session.target.eos_token_ids()
    for p_ids in ids:
        ref = session.baseline(p_ids, max_new_tokens=NEW + B)
        tail = [eos[0]] if ref.stop_reason == "eos" else []
        sequences[tuple(p_ids)] = p_ids + ref.tokens + tail + [0] * 2 * B
    proposer = ReferenceProposer([], session.proposer.layer_ids, B, session.target.vocab_size)
    run = session.run

    def run_perfect(prompt, **kw):
        proposer.sequence = sequences[tuple(prompt)]
        return run(prompt, **kw)

    session.proposer, session.run = proposer, run_perfect
    runs, _ = measure(session, ids, prompts, max_new_tokens=NEW, warmup=False, progress=False)
    report = build_report(runs, B, greedy=True, environment={"temperature": 0.0})
    check_consistent(report, block=B)
    lasts = []
    for p in report["per_prompt"]:  # whole blocks, but a prompt's last cycle (EOS, budget) counts what it emitted
        *full, last = p["acceptance_lengths"]
        assert full == [B] * len(full) and 0 <= last <= B
        assert p["position_accepts"] == [len(full) + (k < min(last, B - 1)) for k in range(B - 1)]
        lasts.append(last)
    assert report["num_cycles"] > len(lasts) and any(last < B for last in lasts)  # the cut cycle is seen
    assert report["tau"] == pytest.approx((B * (report["num_cycles"] - len(lasts)) + sum(lasts)) / report["num_cycles"])
    assert report["identical_share"] == 1.0


def test_tau_uncut_counts_the_last_cycles_full_acceptance(setup, tmp_path, capsys):
    """Planted acceptance lengths (a reference proposer's mistakes): the token budget cuts each prompt's last
    cycle, so tau (budget-cut) and tau_uncut (that cycle's full acceptance) are known exactly, per prompt and
    pooled; report.md names which published numbers use which, and --compare shows both."""
    from inference.report import TAU_NAMES
    from inference.validate import write_outputs
    from tests.helpers import expected_acceptance

    session = Session("torch", setup["target"], setup["draft"])
    prompts = load_prompts(setup["prompts"])[:2]
    ids = render_prompts(session.tokenizer, prompts, "off")
    B, plans = 8, {}
    for p_ids, planted in zip(ids, ({3, 5}, {2})):
        ref = session.baseline(p_ids, max_new_tokens=NEW + 2 * B, eos_token_ids=[])
        plans[tuple(p_ids)] = (p_ids + ref.tokens, {len(p_ids) + k for k in planted})
    proposer = ReferenceProposer([], session.proposer.layer_ids, B, session.target.vocab_size)
    run, baseline = session.run, session.baseline

    def run_planted(prompt, **kw):
        proposer.sequence, proposer.mistakes = plans[tuple(prompt)]
        return run(prompt, **kw, eos_token_ids=[])

    session.proposer, session.run = proposer, run_planted
    session.baseline = lambda prompt, **kw: baseline(prompt, **kw, eos_token_ids=[])
    runs, _ = measure(session, ids, prompts, max_new_tokens=NEW, warmup=False, progress=False)
    report = build_report(runs, B, greedy=True, environment={"temperature": 0.0})
    cut = [expected_acceptance(len(p), NEW, B, plans[tuple(p)][1]) for p in ids]
    full = [expected_acceptance(len(p), NEW, B, plans[tuple(p)][1], uncut=True) for p in ids]
    assert (cut, full) == ([[3, 2, 6], [2, 8, 1]], [[3, 2, 8], [2, 8, 8]])  # 12 new tokens: the 3rd cycle is cut
    for p, c, f in zip(report["per_prompt"], cut, full, strict=True):
        assert p["acceptance_lengths"] == c and p["tau"] == pytest.approx(sum(c) / 3)
        assert p["tau_uncut"] == pytest.approx(sum(f) / 3) and p["committed_uncut"] == sum(f)
    assert report["tau"] == pytest.approx(22 / 6) and report["tau_uncut"] == pytest.approx(31 / 6)
    assert report["tau_uncut_per_prompt_mean"] == pytest.approx((13 / 3 + 18 / 3) / 2)
    assert report["identical_share"] == 1.0
    paths = write_outputs({**report, **{k: None for k in ("truncated", "baseline_truncated")}, "truncated": 2,
                           "baseline_truncated": 2}, tmp_path / "a")
    md = paths["md"].read_text()
    assert all(line in md for line in TAU_NAMES) and "tau uncut pooled" in md
    assert "z-lab's current loop (at 07ebd93)" in TAU_NAMES[0] and "z-lab's earlier loop" in TAU_NAMES[1]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text(json.dumps({**report, "schema": "draftsmith.validate/1",
                                                            "tau_uncut": None}))  # a report of an earlier version
    capsys.readouterr()
    run_compare([str(tmp_path / "a"), str(tmp_path / "b")], tmp_path / "cmp")
    shown = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert shown["tau_uncut"][:2] == [f"{31 / 6:.4g}", "-"] and shown["tau"][:2] == [f"{22 / 6:.4g}"] * 2


def test_mlx_backend_and_compare(setup, torch_report, capsys):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    mlx_report = run_validate(setup, "mlx", str(setup["root"] / "mlx"))
    check_consistent(mlx_report, block=8)
    assert mlx_report["backend"] == "mlx" and mlx_report["identical_share"] == 1.0
    assert mlx_report["peak_memory_bytes"] > 0 and mlx_report["baseline_peak_memory_bytes"] > 0
    for a, b in zip(mlx_report["per_prompt"], torch_report["per_prompt"]):
        assert a["acceptance_lengths"] == b["acceptance_lengths"]  # same target, same drafter, fp32
    table = capsys.readouterr().out  # the table at the end of a run
    assert "tau pooled" in table and "tau per-prompt mean" in table and table.splitlines()[-1].startswith("all")
    out = run_compare([str(setup["root"] / "torch" / "report.json"), str(setup["root"] / "mlx" / "report.json")],
                      str(setup["root"] / "cmp"))
    captured = capsys.readouterr()
    printed = captured.out
    assert f"wrote {setup['root'] / 'cmp' / 'compare.png'}" in captured.err  # where the plot went
    header = printed.splitlines()[0].split()
    assert header == ["metric", "torch", "mlx", "mlx/torch"]
    tau_row = next(line.split() for line in printed.splitlines() if line.startswith("tau "))
    assert float(tau_row[1]) == pytest.approx(torch_report["tau"], rel=1e-3)
    assert float(tau_row[3]) == pytest.approx(mlx_report["tau"] / torch_report["tau"], rel=1e-3)
    assert any(line.startswith("backend") and "torch" in line and "mlx" in line for line in printed.splitlines())
    assert out["png"] and (setup["root"] / "cmp" / "compare.png").read_bytes()[:8] == PNG_MAGIC


def test_shipped_prompt_sets():
    for name in BUILTIN:
        prompts = load_prompts(name)
        assert len(prompts) >= 24 and len({p.id for p in prompts}) == len(prompts)
        assert all(p.category == name and p.messages[-1]["role"] == "user" for p in prompts)
    two = load_prompts("all", n=2)
    assert [p.category for p in two] == [c for c in BUILTIN for _ in range(2)]


def test_prompts_from_a_saved_data_set(tmp_path):
    """A Hub-shaped data set (``save_to_disk``): gsm8k-like ``question`` rows and mt-bench-like ``turns``."""
    from datasets import Dataset, DatasetDict

    rows = {"question": ["What is 2+3?", "Name a prime above 10."], "answer": ["5", "11"]}
    DatasetDict({"test": Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "gsm"))
    prompts = load_prompts(str(tmp_path / "gsm"), split="test")
    assert [p.messages for p in prompts] == [[{"role": "user", "content": q}] for q in rows["question"]]
    assert {p.category for p in prompts} == {"gsm"}
    mt = {"turns": [["Write a haiku.", "Now another."], ["Explain tides.", "Shorter."]],
          "category": ["writing", "stem"]}
    Dataset.from_dict(mt).save_to_disk(str(tmp_path / "mt"))
    prompts = load_prompts(str(tmp_path / "mt"), n=1)
    assert [(p.category, p.messages[0]["content"]) for p in prompts] == [("writing", "Write a haiku."),
                                                                        ("stem", "Explain tides.")]


def test_help_explains_the_flags_and_the_schema():
    out = subprocess.run([sys.executable, "-m", "inference.validate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--prompts", "--repeats", "--thinking", "--compare", "tau_per_prompt_mean", "per_category"):
        assert flag in out.stdout


def test_pooled_and_per_prompt_tau_differ_and_drift_is_per_quarter():
    """Hand-made loop results: the numbers follow from the definitions alone."""
    from inference.report import PromptRun, markdown, table_rows, text_table
    from inference.stats import GenerationResult

    def result(lengths, n_tokens, decode_s, stop="max_new_tokens"):
        pos = [sum(1 for a in lengths if a - 1 > k) for k in range(3)]
        return GenerationResult(tokens=list(range(n_tokens)), acceptance_lengths=lengths, position_accepts=pos,
                                block_size=4, prefill_s=0.1, decode_s=decode_s, stop_reason=stop)

    long = PromptRun("long", "x", 10, [result([4, 4, 1, 1, 1, 1, 2, 2], 17, 1.6)],
                     [result([1] * 16, 17, 3.2)])
    short = PromptRun("short", "y", 10, [result([4, 4], 9, 0.4, "eos")], [result([1] * 8, 9, 1.6, "eos")])
    # the first token was EOS: no cycle, no tau (not a 0 in the per-prompt mean), nothing else moves
    instant = PromptRun("instant", "z", 10, [result([], 0, 0.0, "eos")], [result([], 0, 0.0, "eos")])
    report = build_report([long, short, instant], 4, greedy=False, environment={"temperature": 0.7})
    assert report["tau"] == pytest.approx(24 / 10)  # pooled: committed / cycles
    assert report["tau_per_prompt_mean"] == pytest.approx((16 / 8 + 4) / 2)
    assert report["num_prompts"] == 3 and report["num_cycles"] == 10
    x = report["per_category"]["x"]
    assert x["tau_first_quarter"] == 4 and x["tau_last_quarter"] == 2
    assert report["acceptance_histogram"] == {"1": 4, "2": 2, "4": 4}
    assert report["position_acceptance"] == [pytest.approx(0.6), pytest.approx(0.4), pytest.approx(0.4)]
    assert report["dflash_tok_s"] == pytest.approx(24 / 2.0) and report["baseline_tok_s"] == pytest.approx(24 / 4.8)
    assert report["speedup"] == pytest.approx(2.4)
    assert report["cycle_cost"] == pytest.approx((2.0 / 10) / (4.8 / 24))
    assert report["truncated"] == 1 and report["identical_share"] is None  # sampling: not compared
    md = markdown(report)
    assert "Sampling (temperature > 0)" in md
    assert "draft slot k was accepted, k = 1..B-1): 0.60, 0.40, 0.40\n" in md
    assert "first quarter of each prompt's cycles 4.00, over the last quarter 2.67." in md  # (2 + 2 + 4) / 3
    lines = text_table(table_rows(report)).splitlines()  # what validate prints: columns as wide as their header
    assert len({len(line) for line in lines}) == 1 and lines[0].startswith("category  prompts  tau pooled")
    assert lines[-1].startswith("all     " + "  " + "      3" + "  " + "      2.40")  # names left, numbers right
    header, *rows = table_rows(report)
    assert [row[header.index("tau pooled")] for row in rows] == ["2.00", "4.00", "0.00", "2.40"]  # x, y, z, all
    assert rows[-1][header.index("cycle cost")] == "1.00" and rows[-1][header.index("speedup")] == "2.40x"


def test_repeats_are_reduced_by_their_median_and_a_cut_output_is_not_identical():
    """--repeats 3: decode time and time to first token are each prompt's median (one slow outlier
    moves nothing); an output that stops early differs from the baseline at the first missing index."""
    from dataclasses import replace

    from inference.report import PromptRun, first_divergence, prompt_numbers
    from inference.stats import GenerationResult

    def result(decode_s, prefill_s, tokens=9):
        return GenerationResult(tokens=list(range(tokens)), acceptance_lengths=[4, 4], position_accepts=[2, 2, 2],
                                block_size=4, prefill_s=prefill_s, decode_s=decode_s, stop_reason="max_new_tokens")

    run = PromptRun("p", "x", 10, [result(1.0, 0.1), result(10.0, 1.0), result(2.0, 0.2)],
                    [result(4.0, 0.1), result(4.0, 0.1), result(40.0, 3.0)])
    numbers = prompt_numbers(run, greedy=True)
    assert numbers["dflash_decode_s"] == 2.0 and numbers["ttft_s"] == pytest.approx(0.2)
    assert numbers["baseline_decode_s"] == 4.0 and numbers["baseline_ttft_s"] == pytest.approx(0.1)
    assert numbers["speedup"] == pytest.approx(2.0) and numbers["identical"] is True
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([1, 2], [1, 2]) is None and first_divergence([1, 5, 3], [1, 2, 3]) == 1
    cut = PromptRun("p", "x", 10, [result(1.0, 0.1, tokens=5)], [result(1.0, 0.1)])
    assert prompt_numbers(cut, greedy=True)["identical"] is False
    at_once = PromptRun("p", "x", 10, [replace(result(1.0, 0.1), tokens=[7, 1, 2])], [result(1.0, 0.1)])
    assert build_report([at_once], 4, greedy=True, environment={})["first_divergence_min"] == 0  # not "none"


def test_a_prompts_tokens_and_cycles_come_from_its_first_repeat():
    """Sampled repeats differ: a prompt's tokens, cycles and stop reason are its first repeat's (each side's
    first), not the last one's; only the timings are medians."""
    from inference.report import PromptRun, prompt_numbers
    from inference.stats import GenerationResult

    def result(n_tokens, lengths, stop):
        pos = [sum(1 for a in lengths if a - 1 > k) for k in range(3)]
        return GenerationResult(tokens=list(range(n_tokens)), acceptance_lengths=lengths, position_accepts=pos,
                                block_size=4, decode_s=1.0, stop_reason=stop)

    run = PromptRun("p", "x", 10, [result(7, [4, 2], "eos"), result(9, [2, 2, 2, 2], "max_new_tokens")],
                    [result(5, [1] * 4, "eos"), result(9, [1] * 8, "max_new_tokens")])
    numbers = prompt_numbers(run, greedy=False)
    assert numbers["acceptance_lengths"] == [4, 2] and numbers["tau"] == 3.0 and numbers["stop_reason"] == "eos"
    assert numbers["new_tokens"] == 7 and numbers["baseline_new_tokens"] == 5
    assert numbers["baseline_stop_reason"] == "eos" and numbers["position_accepts"] == [2, 1, 1]


def test_target_quantization_is_described():
    from inference.validate import describe_quantization

    assert describe_quantization({"bits": 4, "group_size": 64}) == "4-bit affine, group 64"
    assert describe_quantization({"quant_method": "fp8"}) == "fp8"
    assert describe_quantization(None) is None


def test_thinking_switch_changes_the_rendered_prompt(setup):
    from inference.prompt_sets import prompt_set_hash
    from models.tiny import tiny_tokenizer

    prompts = load_prompts(setup["prompts"])
    tok = tiny_tokenizer("chatml")
    on, off = render_prompts(tok, prompts, "on"), render_prompts(tok, prompts, "off")
    assert on != off and prompt_set_hash(prompts, "on") != prompt_set_hash(prompts, "off")


def test_report_numbers_each_side_and_each_prompt_on_its_own():
    """Hand-made results where DFlash and the baseline differ: per-prompt drift quarters (a quarter rounded
    down, at least one cycle), the baseline's own token count and truncation, the median TTFT over prompts,
    the earliest divergence, histograms in length order, and the markdown shares and compare ratios."""
    from inference.report import PromptRun, compare_rows, markdown
    from inference.stats import GenerationResult

    def result(tokens, lengths, prefill_s, stop="max_new_tokens"):
        pos = [sum(1 for a in lengths if a - 1 > k) for k in range(3)]
        return GenerationResult(tokens=list(tokens), acceptance_lengths=list(lengths), position_accepts=pos,
                                block_size=4, prefill_s=prefill_s, decode_s=1.0, stop_reason=stop)

    cut = PromptRun("cut", "x", 10, [result(range(9), [2, 1, 1, 1, 1, 1, 1], 0.1, "eos")],  # 7 cycles
                    [result(range(12), [1] * 11, 0.1)])
    wrong = PromptRun("wrong", "x", 10, [result([0, 1, 2, 7, 4, 5, 6, 7, 8], [4, 4], 0.3)],
                      [result(range(9), [1] * 8, 0.3)])
    same = PromptRun("same", "y", 10, [result(range(9), [4, 4], 1.0)], [result(range(9), [1] * 8, 1.0)])
    report = build_report([cut, wrong, same], 4, greedy=True, environment={"temperature": 0.0})
    p = report["per_prompt"][0]
    assert p["tau_first_quarter"] == 2 and p["tau_last_quarter"] == 1  # 7 // 4 = 1 cycle each
    assert list(p["acceptance_histogram"]) == ["1", "2"]  # sorted by length, not by first occurrence
    assert p["decode_tokens"] == 8 and p["baseline_decode_tokens"] == 11
    assert p["truncated"] is False and p["baseline_truncated"] is True and p["first_divergence"] == 9
    assert report["baseline_tok_s"] == pytest.approx((11 + 8 + 8) / 3.0)
    assert report["truncated"] == 2 and report["baseline_truncated"] == 3
    assert report["ttft_s"] == pytest.approx(0.3) and report["baseline_ttft_s"] == pytest.approx(0.3)  # medians
    assert report["first_divergence_min"] == 3 and report["identical_share"] == pytest.approx(1 / 3)
    assert report["acceptance_histogram"] == {"1": 6, "2": 1, "4": 4}
    assert "| 4 | 4 | 36.4% |" in markdown(report)  # share of the 11 cycles
    assert "Outputs that hit --max-new-tokens: DFlash 2, baseline 3." in markdown(report)
    assert "| 1 | 6 | 54.5% |\n| 2 | 1 | 9.1% |\n| 4 | 4 | 36.4% |\n" in markdown(report)  # in length order
    later_short = build_report([same, cut], 4, greedy=True, environment={"temperature": 0.0})
    assert list(later_short["acceptance_histogram"]) == ["1", "2", "4"]  # pooled, still in length order
    assert list(GenerationResult([], acceptance_lengths=[3, 1, 3, 2]).histogram().items()) == [(1, 1), (2, 1), (3, 2)]
    rows = compare_rows([report, {**report, "tau": 2 * report["tau"]}], ["a", "b"])
    assert next(r for r in rows if r[0] == "tau")[-1] == "2.000"  # later report / first one


def test_target_quantization_is_read_from_either_config_key(tmp_path):
    """MLX folders say ``quantization``, transformers-quantized ones ``quantization_config``: the report's
    target_quantization comes from whichever is there."""
    from inference.checks import read_target_facts
    from inference.validate import describe_quantization

    for key, value, said in (("quantization", {"bits": 4, "group_size": 64}, "4-bit affine, group 64"),
                             ("quantization_config", {"quant_method": "fp8"}, "fp8"), (None, None, None)):
        folder = tmp_path / str(key)
        folder.mkdir()
        config = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 288, "num_hidden_layers": 8}
        (folder / "config.json").write_text(json.dumps({**config, **({key: value} if key else {})}))
        facts = read_target_facts(folder)
        assert facts.quantization == value and describe_quantization(facts.quantization) == said


def test_a_cycles_numbers_from_hand_made_drafts():
    """record_cycle on known drafts: the accepted prefix stops at the first mismatch, a cycle cut by the budget
    counts what it emitted but still reports the block positions it verified; tau and tok/s of a generation
    with no cycle, or only the prefill's token, are 0 (not 1, not negative); to_json carries the stop reason."""
    from inference.stats import GenerationResult, leading_matches

    assert leading_matches([1, 9, 3], [1, 2, 3, 4]) == 1  # a later match after a miss is not accepted
    r = GenerationResult(tokens=[1], position_accepts=[0, 0, 0], block_size=4)
    assert r.record_cycle([7, 8, 9], [7, 8, 5, 6], set(), 10) == (3, None)
    assert r.tokens == [1, 7, 8, 5] and r.acceptance_lengths == [3] and r.position_accepts == [1, 1, 0]
    assert r.record_cycle([2, 3, 4], [2, 3, 4, 6], set(), 6) == (4, "max_new_tokens")
    assert r.tokens == [1, 7, 8, 5, 2, 3] and r.acceptance_lengths == [3, 2] and r.position_accepts == [2, 2, 0]
    assert r.last_cycle_uncut == 4 and r.tau_uncut == 3.5  # the cut cycle accepted all 3 drafts + the bonus
    r.decode_s, r.stop_reason = 2.0, "max_new_tokens"
    assert r.tau == 2.5 and r.decode_tokens_per_s == 2.5  # 5 tokens after the prefill's one, in 2 s
    assert r.to_json()["stop_reason"] == "max_new_tokens" and r.to_json()["decode_tokens_per_s"] == 2.5
    empty = GenerationResult(tokens=[], decode_s=1.0, stop_reason="eos")
    assert empty.tau == 0.0 and empty.decode_tokens_per_s == 0.0 and empty.to_json()["stop_reason"] == "eos"
    assert GenerationResult(tokens=[5], decode_s=0.5).decode_tokens_per_s == 0.0



def test_a_cycle_cut_by_eos_commits_what_came_before_it():
    """The first EOS is never emitted: an EOS among the accepted drafts ends the cycle at the tokens before
    it (acceptance length and per-slot counts only for those), an EOS as the target's own token keeps every
    accepted draft; ``keep`` still counts the verified block positions. A commit that fills the budget
    says so even with no token left over. A result made without a stop reason or block size says
    max_new_tokens and 0."""
    from inference.stats import GenerationResult, commit_tokens

    r = GenerationResult(tokens=[1], position_accepts=[0, 0, 0], block_size=4)
    assert r.record_cycle([7, 2, 9], [7, 2, 5, 6], {2}, 10) == (3, "eos")
    assert r.tokens == [1, 7] and r.acceptance_lengths == [1] and r.position_accepts == [1, 0, 0]
    r = GenerationResult(tokens=[1], position_accepts=[0, 0, 0], block_size=4)
    assert r.record_cycle([7, 8, 9], [7, 8, 9, 2], {2, 3}, 10) == (4, "eos")
    assert r.tokens == [1, 7, 8, 9] and r.acceptance_lengths == [3] and r.position_accepts == [1, 1, 1]
    assert r.record_cycle([3, 4, 5], [3, 4, 5, 6], {2, 3}, 10) == (4, "eos")  # EOS as the first token: nothing
    assert r.tokens == [1, 7, 8, 9] and r.acceptance_lengths == [3, 0] and r.position_accepts == [1, 1, 1]
    assert commit_tokens([5], out := [1], set(), 2) == "max_new_tokens" and out == [1, 5]  # the budget, reached
    assert commit_tokens([5, 2], out := [1], {2}, 2) == "max_new_tokens" and out == [1, 5]  # before the EOS
    assert commit_tokens([5, 6], out := [1], {2}, 4) is None and out == [1, 5, 6]
    bare = GenerationResult(tokens=[4]).to_json()
    assert bare["stop_reason"] == "max_new_tokens" and bare["block_size"] == 0
    assert bare["acceptance_lengths"] == [] and bare["position_accepts"] == [] and bare["acceptance_histogram"] == {}


def test_a_generations_json_carries_each_number_under_its_own_name():
    """What ``generate --json`` prints: tokens/s is not tau, the histogram counts cycles per length, every draft
    slot's count from slot 1 on; a decode of a few milliseconds still has its tokens/s (not 0)."""
    from inference.stats import GenerationResult

    r = GenerationResult(tokens=list(range(10, 18)), acceptance_lengths=[3, 1, 3], position_accepts=[2, 2, 0],
                         block_size=4, prefill_s=0.25, decode_s=2.0, stop_reason="eos")
    assert r.to_json() == {
        "tokens": list(range(10, 18)), "num_tokens": 8, "acceptance_lengths": [3, 1, 3], "tau": 7 / 3,
        "tau_uncut": 7 / 3, "acceptance_histogram": {"1": 1, "3": 2}, "position_accepts": [2, 2, 0], "block_size": 4,
        "prefill_s": 0.25, "decode_s": 2.0, "decode_tokens_per_s": 3.5, "stop_reason": "eos"}
    assert GenerationResult(tokens=[1, 2, 3], decode_s=0.004).decode_tokens_per_s == pytest.approx(500.0)


def test_even_repeats_sampled_divergence_and_a_report_without_cycles():
    """Two repeats: the median is the mean of the middle two (not the lower one); a sampled run names no
    divergence even where its tokens differ; the baseline's own stop reason; num_tokens counts every output
    token (the prefill's too); a report where every output stopped at its first token has tau 0."""
    from inference.report import PromptRun, compare_rows, prompt_numbers
    from inference.stats import GenerationResult

    def result(tokens, lengths, decode_s, prefill_s, stop):
        pos = [sum(1 for a in lengths if a - 1 > k) for k in range(3)]
        return GenerationResult(tokens=list(tokens), acceptance_lengths=list(lengths), position_accepts=pos,
                                block_size=4, prefill_s=prefill_s, decode_s=decode_s, stop_reason=stop)

    run = PromptRun("p", "x", 10, [result(range(9), [4, 4], d, f, "max_new_tokens") for d, f in ((1.0, 0.1),
                                                                                                   (2.0, 0.3))],
                    [result([0, 5, 6], [1, 1], d, f, "eos") for d, f in ((4.0, 0.2), (6.0, 0.4))])
    numbers = prompt_numbers(run, greedy=True)
    assert numbers["dflash_decode_s"] == pytest.approx(1.5) and numbers["baseline_decode_s"] == pytest.approx(5.0)
    assert numbers["ttft_s"] == pytest.approx(0.2) and numbers["baseline_ttft_s"] == pytest.approx(0.3)
    assert numbers["stop_reason"] == "max_new_tokens" and numbers["baseline_stop_reason"] == "eos"
    assert numbers["first_divergence"] == 1 and numbers["identical"] is False
    assert numbers["new_tokens"] == 9 and numbers["baseline_new_tokens"] == 3
    assert numbers["dflash_tok_s"] == pytest.approx(8 / 1.5) and numbers["baseline_tok_s"] == pytest.approx(2 / 5.0)
    sampled = build_report([run], 4, greedy=False, environment={"temperature": 0.7})
    assert sampled["per_prompt"][0]["first_divergence"] is None and sampled["first_divergence_min"] is None
    assert sampled["num_tokens"] == 9 and sampled["per_category"]["x"]["num_tokens"] == 9
    assert sampled["ttft_s"] == pytest.approx(0.2) and sampled["baseline_ttft_s"] == pytest.approx(0.3)
    assert sampled["cycle_cost"] == pytest.approx((1.5 / 2) / (5.0 / 2))  # s per cycle / s per baseline token
    instant = PromptRun("i", "x", 10, [result([], [], 0.0, 0.1, "eos")], [result([], [], 0.0, 0.1, "eos")])
    nothing = build_report([instant], 4, greedy=True, environment={"temperature": 0.0})
    assert nothing["tau"] == 0.0 and nothing["num_cycles"] == 0 and nothing["per_category"]["x"]["tau"] == 0.0
    assert nothing["cycle_s"] is None and nothing["speedup"] is None and nothing["cycle_cost"] is None  # "-", not 0
    assert [nothing["per_prompt"][0][k] for k in ("cycle_s", "cycle_cost", "tau_first_quarter", "tau_last_quarter")
            ] == [None] * 4
    assert nothing["per_prompt"][0]["dflash_tok_s"] == 0.0 == nothing["per_prompt"][0]["baseline_tok_s"]  # no decode
    rows = compare_rows([nothing, sampled], ["none", "some"])
    assert next(r for r in rows if r[0] == "dflash_tok_s")[1:] == ["0", "5.333", "-"]  # no ratio to a 0

def test_a_short_prompts_own_costs_and_the_tables_wording():
    """A prompt of 3 cycles (a quarter rounds up to one cycle, never to none); its own cycle seconds,
    baseline seconds per decoded token and their ratio; categories in prompt-set order; "-" for a number that
    does not apply, "none" when nothing diverged; compare keeps each category's speedup."""
    from inference.report import PromptRun, _fmt, compare_rows, markdown, markdown_table, table_rows
    from inference.stats import GenerationResult

    def result(n_tokens, lengths, decode_s):
        pos = [sum(1 for a in lengths if a - 1 > k) for k in range(3)]
        return GenerationResult(tokens=list(range(n_tokens)), acceptance_lengths=lengths, position_accepts=pos,
                                block_size=4, prefill_s=0.1, decode_s=decode_s)

    short = PromptRun("short", "math", 10, [result(7, [3, 1, 2], 0.6)], [result(7, [1] * 6, 0.9)])
    other = PromptRun("other", "code", 10, [result(5, [4], 0.4)], [result(5, [1] * 4, 0.8)])
    report = build_report([short, other], 4, greedy=True, environment={"temperature": 0.0})
    p = report["per_prompt"][0]
    assert p["tau_first_quarter"] == 3 and p["tau_last_quarter"] == 2
    assert p["cycle_s"] == pytest.approx(0.6 / 3) and p["baseline_token_s"] == pytest.approx(0.9 / 6)
    assert p["cycle_cost"] == pytest.approx((0.6 / 3) / (0.9 / 6))
    assert list(report["per_category"]) == ["math", "code"]
    assert [row[0] for row in table_rows(report)[1:]] == ["math", "code", "all"]
    assert "earliest divergence at token none." in markdown(report)
    sampled = build_report([short, other], 4, greedy=False, environment={"temperature": 0.7})
    header, *_, total = table_rows(sampled)
    assert total[header.index("identical")] == "-" and table_rows(report)[-1][header.index("identical")] == "100%"
    names = [row[0] for row in compare_rows([report, sampled], ["a", "b"])]
    assert "math: speedup" in names and "code: tau" in names
    names = [row[0] for row in compare_rows([{**report, "per_category": {}}, report], ["a", "b"])]
    assert "math: tau" in names  # a category only a later report has
    assert _fmt([1, 2], "{:.4g}") == "[1, 2]"  # a value of another shape (an older report.json): as it is
    assert markdown_table([["a", "b"], ["1", "2"], ["3", "4"]]) == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |"
    assert next(r for r in compare_rows([report, sampled], ["a", "b"]) if r[0] == "math: tau")[1:] == ["2", "2",
                                                                                                      "1.000"]


class StubSession:
    """Session.run / baseline / peak memory without a model: each generation uses the next planted peak."""

    def __init__(self, baseline_peaks, dflash_peaks):
        from inference.stats import GenerationResult

        self.result = lambda: GenerationResult(tokens=[1, 2, 3], acceptance_lengths=[2], position_accepts=[1],
                                               block_size=2, decode_s=1.0)
        self.baseline_peaks, self.dflash_peaks = list(baseline_peaks), list(dflash_peaks)
        self.peak, self.calls, self.settings = 0, [], []

    def reset_peak_memory(self):
        self.peak = 0

    def peak_memory_bytes(self):
        return self.peak

    def baseline(self, ids, **kw):
        self.calls.append(("baseline", ids[0], kw["max_new_tokens"]))
        self.settings.append(kw)
        self.peak = max(self.peak, self.baseline_peaks.pop(0))
        return self.result()

    def run(self, ids, baseline=False, **kw):
        self.settings.append(kw)
        if baseline:  # the warm-up
            self.calls.append(("warm-up", ids[0], kw["max_new_tokens"]))
            return self.result(), self.result()
        self.calls.append(("dflash", ids[0], kw["max_new_tokens"]))
        self.peak = max(self.peak, self.dflash_peaks.pop(0))
        return self.result(), None


def test_measure_takes_the_largest_peak_of_each_mode_and_warms_up_on_the_first_missing_prompt(monkeypatch):
    """Peak memory is the largest over prompts and repeats, each mode from its own reset (the baseline's is not
    the previous DFlash run's); the warm-up is short and runs the first prompt not measured yet; a run that
    finds every prompt measured generates nothing."""
    from types import SimpleNamespace

    import tqdm

    from inference.session import WARMUP_TOKENS

    prompts = [SimpleNamespace(id=f"p{i}", category="x") for i in range(3)]
    ids = [[10], [11], [12]]
    session = StubSession([10, 30, 20, 5], [100, 300, 4, 3])  # the third prompt: DFlash below the baseline
    earlier = measure(StubSession([7], [70]), ids[:1], prompts[:1], progress=False)[0][0]
    done = {0: (earlier, {"peak_memory_bytes": 70, "baseline_peak_memory_bytes": 7})}
    recorded, bars = [], []
    real_bar = tqdm.tqdm
    monkeypatch.setattr(tqdm, "tqdm", lambda **kw: bars.append(kw) or real_bar(**kw))
    runs, peaks = measure(session, ids, prompts, repeats=2, max_new_tokens=WARMUP_TOKENS + 8, progress=False,
                          done=done, record=lambda i, run, its: recorded.append((i, its)), block_size=2,
                          temperature=0.5, seed=9)
    assert [(b["total"], b["initial"]) for b in bars] == [(6, 2)]  # the resumed prompt's runs count as done
    # the warm-up, then baseline and DFlash twice for each of the two prompts: DFlash with the block size asked
    assert [(kw.get("block_size"), kw["temperature"], kw["seed"]) for kw in session.settings] == (
        [(2, 0.5, 9)] + [(None, 0.5, 9), (2, 0.5, 9)] * 4)
    assert peaks == {"peak_memory_bytes": 300, "baseline_peak_memory_bytes": 30}
    assert recorded == [(1, {"peak_memory_bytes": 300, "baseline_peak_memory_bytes": 30}),
                        (2, {"peak_memory_bytes": 4, "baseline_peak_memory_bytes": 20})]
    assert session.calls[0] == ("warm-up", 11, WARMUP_TOKENS)
    assert [c[0] for c in session.calls[1:]] == ["baseline", "dflash"] * 4 and runs[0] is earlier
    idle = StubSession([], [])
    runs, peaks = measure(idle, ids[:1], prompts[:1], progress=False, done=done)
    assert idle.calls == [] and runs == [earlier] and peaks == done[0][1]


def test_compare_labels_reports_of_same_named_folders_and_notes_other_prompt_sets(tmp_path, capsys):
    """Two runs/*/val/report.json: the columns are told apart (val#1, val#2); reports of different prompt sets
    get a note, reports of the same set none."""
    reports = []
    for name, prompt_hash in (("a", "h1"), ("b", "h2")):
        (tmp_path / name / "val").mkdir(parents=True)
        report = {"schema": "draftsmith.validate/1", "tau": 2.0, "prompt_set_hash": prompt_hash,
                  "acceptance_histogram": {"2": 1}, "position_acceptance": [1.0], "block_size": 2}
        (tmp_path / name / "val" / "report.json").write_text(json.dumps(report))
        reports.append(str(tmp_path / name / "val"))
    out = run_compare(reports, str(tmp_path / "cmp"))
    assert out["rows"][0] == ["metric", "val#1", "val#2", "val#2/val#1"]
    assert "different prompt sets" in capsys.readouterr().err
    run_compare([reports[0], reports[0]], str(tmp_path / "cmp"))
    assert "different prompt sets" not in capsys.readouterr().err


def test_flags_left_out_take_the_documented_defaults():
    from inference.validate import parse_args

    args = parse_args(["--target", "t", "--draft", "d"])
    assert (args.prompts, args.split, args.subset, args.n, args.max_new_tokens, args.block_size, args.temperature,
            args.thinking, args.repeats, args.seed, args.loop, args.out) == (
        "all", "test", None, None, 256, None, 0.0, None, 1, 0, "auto", "validate-report")  # thinking: the drafter's


def test_versions_name_every_package_and_none_for_one_not_installed(monkeypatch):
    from importlib import metadata

    from inference.validate import _versions

    real = metadata.version

    def version(dist):
        if dist == "mlx":
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(metadata, "version", version)
    found = _versions()
    assert set(found) == {"python_version", "torch_version", "transformers_version", "mlx_version",
                          "mlx_lm_version", "draftsmith_version"}
    assert found["mlx_version"] is None and found["torch_version"] == real("torch")


def test_the_plot_is_labelled_with_the_drafters_folder(torch_report, tmp_path, monkeypatch):
    import inference.validate
    from inference.validate import write_outputs

    labels = []
    monkeypatch.setattr(inference.validate, "write_plot", lambda reports, names, path: labels.append(names))
    write_outputs({**torch_report, "draft": "runs/a/my-drafter"}, tmp_path / "out")
    assert labels == [["my-drafter"]]


def test_a_run_reports_the_settings_it_measured_with(setup, tmp_path, monkeypatch):
    """--block-size, --thinking, --seed and a sampling temperature reach every generation and the report; the
    facts read from the two config files (quantization, recorded target) are the report's; the creation time
    is UTC; the resume key is taken from the resolved paths."""
    import dataclasses
    from types import SimpleNamespace

    import inference.validate
    from inference import partial
    from inference.checks import preflight

    def quantized(*a, **kw):  # as read from an MLX-quantized target and a 4-bit drafter export
        pre = preflight(*a, **kw)
        pre.target.quantization = {"bits": 4, "group_size": 64}
        return dataclasses.replace(pre, recorded_target="Qwen/Qwen3-8B",
                                   drafter=SimpleNamespace(**{**vars(pre.drafter),
                                                              "quantization": {"bits": 8, "group_size": 32}}))

    generations, keyed, warned, sources = [], [], [], []
    real_run, real_base, real_key, real_warn = Session.run, Session.baseline, partial.settings_key, \
        inference.validate.skip_too_long
    monkeypatch.setattr(inference.validate, "load_prompts",
                        lambda spec, **kw: sources.append(kw) or load_prompts(spec, n=kw["n"]))  # (Hub-only flags)
    monkeypatch.setattr(Session, "run", lambda self, *a, **kw: generations.append(kw) or real_run(self, *a, **kw))
    monkeypatch.setattr(Session, "baseline",
                        lambda self, *a, **kw: generations.append(kw) or real_base(self, *a, **kw))
    monkeypatch.setattr(partial, "settings_key", lambda settings: keyed.append(settings) or real_key(settings))
    monkeypatch.setattr(inference.validate, "skip_too_long", lambda *a: warned.append(a) or real_warn(*a))
    monkeypatch.setattr(inference.validate, "preflight", quantized)
    monkeypatch.setattr(inference.validate, "check_drafter_backend", lambda *a: None)  # the stand-in 8-bit drafter
    monkeypatch.setattr(inference.validate, "time", SimpleNamespace(
        strftime=__import__("time").strftime, gmtime=lambda: (2025, 1, 2, 3, 4, 5, 3, 2, 0),
        localtime=lambda: (2025, 1, 2, 12, 4, 5, 3, 2, 0)))
    monkeypatch.chdir(setup["root"])
    report = main(["--backend", "torch", "--target", "target/", "--draft", setup["draft"], "--prompts",
                   setup["prompts"], "--n", "1", "--max-new-tokens", "6", "--block-size", "4", "--thinking", "on",
                   "--temperature", "0.5", "--seed", "7", "--out", str(tmp_path / "val"), "--no-progress",
                   "--split", "validation", "--subset", "main"])
    assert sources == [{"n": 1, "split": "validation", "subset": "main"}]
    assert {(kw.get("block_size", 4), kw["temperature"], kw["seed"]) for kw in generations} == {(4, 0.5, 7)}
    assert sum("block_size" in kw for kw in generations) == 1 + 2  # the warm-up and DFlash on the two prompts
    assert (report["block_size"], report["trained_block_size"], report["seed"], report["thinking"]) == (4, 8, 7, "on")
    assert all(max(p["acceptance_lengths"] or [0]) <= 4 for p in report["per_prompt"])
    assert report["identical_share"] is None and report["first_divergence_min"] is None  # sampled: not compared
    prompts = load_prompts(setup["prompts"], n=1)
    session = Session("torch", setup["target"], setup["draft"])
    ids = render_prompts(session.tokenizer, prompts, "on")
    assert report["prompt_set_hash"] == prompt_set_hash(prompts, "on")
    assert report["prompt_tokens_total"] == sum(map(len, ids)) and [len(w[0]) for w in warned] == [2]
    assert warned[0][2:] == (6, 4096) and [p["prompt_tokens"] for p in report["per_prompt"]] == list(map(len, ids))
    assert report["mask_token_id"] == session.proposer.drafter.config.mask_token_id is not None
    assert (report["target_model_type"], report["recorded_target"]) == ("qwen3", "Qwen/Qwen3-8B")
    assert (report["target_quantization"], report["draft_quantization"]) == ("4-bit affine, group 64",
                                                                             "8-bit affine, group 32")
    assert report["created"] == "2025-01-02T03:04:05Z" and report["peak_memory_bytes"] is None  # CPU: no peak
    assert "baseline_peak_memory_bytes" in report and report["resumed_prompts"] == 0
    assert keyed[0]["target"] == setup["target"] and report["target"] == "target/"  # as given, keyed resolved
