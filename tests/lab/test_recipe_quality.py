"""The small trained target talks (greedy output is varied code, not a loop), and one ablation cell runs.

The target here is ``lab.small_target`` at a test budget (hidden 64, 8 layers, BPE 512, 150 fit
steps on 300 kB of stdlib sources), built from a fresh clone. Two checks, because a loop and noise
are both degenerate: the greedy distinct-3-gram ratio on 8 held-out prompts x 64 tokens (measured
0.22 for this build, 0.73 for the full default build; threshold 0.1, which any loop of period <= 6
tokens stays under) and the held-out loss of the reference continuations (measured 4.70 nats;
threshold ln(vocab) - 1 = 5.25; the same model unfitted scores ~6.27, i.e. noise).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from lab.small_target import (
    DISTINCT_3GRAM_MIN,
    SmallTargetSpec,
    build_small_target,
    degenerate,
    distinct_ngram_ratio,
    greedy_samples,
    heldout_loss,
    make_model,
    sample_quality,
)

SETTINGS = dict(hidden=64, layers=8, heads=4, kv_heads=2, intermediate=128, vocab=512, steps=150, batch=8,
                seq_len=128, lr=1e-2, max_train_bytes=300_000, chats=24, prompts=8)


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    return build_small_target(tmp_path_factory.mktemp("small") / "target", seed=0, progress=False, device="cpu",
                              log=lambda m: None, **SETTINGS)


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio([1, 2, 3, 4, 5]) == 1.0
    assert distinct_ngram_ratio([7, 8] * 20) == pytest.approx(2 / 38)
    assert distinct_ngram_ratio([1, 2]) == 0.0  # shorter than one 3-gram


def test_small_target_greedy_output_is_not_degenerate(small_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.target import TargetModel

    info = json.loads((small_target / "small_target.json").read_text())
    tok = AutoTokenizer.from_pretrained(small_target)
    model = AutoModelForCausalLM.from_pretrained(small_target, dtype=torch.float32)
    prompts = [json.loads(line) for line in (small_target / "prompts.jsonl").open()]
    assert len(prompts) == 8 and all(p["messages"][0]["role"] == "user" and p["reference"] for p in prompts)
    q = {**sample_quality(greedy_samples(model, tok, prompts[:8])),
         "heldout_loss": round(heldout_loss(model, tok, prompts), 4)}
    assert q == info["greedy_check"]  # the folder's own record is what the saved weights do
    assert q["distinct_3gram"] > DISTINCT_3GRAM_MIN, q  # not a loop
    assert q["distinct_outputs"] >= 0.5, q  # different prompts, different continuations
    assert degenerate(q) is None and degenerate({**q, "distinct_3gram": 0.07}) is not None
    # Not noise either: noise is varied too, but scores ~ln(vocab) on the held-out continuations.
    uniform = math.log(model.config.vocab_size)
    assert q["heldout_loss"] < uniform - 1.0, (q, uniform)
    raw = make_model(SmallTargetSpec(**SETTINGS), model.config.vocab_size, tok)
    assert heldout_loss(raw, tok, prompts) > uniform - 1.0  # the same model unfitted fails the check
    target = TargetModel.from_pretrained(small_target, dtype=torch.float32)
    assert target.model_type == "qwen3" and target.vocab_size == len(target.tokenizer) + 8  # spare rows: mask token


def test_small_target_is_cached(small_target):
    messages = []
    again = build_small_target(small_target, seed=0, progress=False, device="cpu", log=messages.append, **SETTINGS)
    assert again == small_target and messages == []  # same settings and corpus: no rebuild
    stamp = json.loads((small_target / "small_target.json").read_text())
    assert stamp["corpus_hash"] and stamp["spec"]["steps"] == SETTINGS["steps"]


def test_one_ablation_cell_end_to_end(small_target, tmp_path, capsys):
    import shutil

    from lab.ablate import main

    target = tmp_path / "target"  # a copy: "rebuilt" below
    shutil.copytree(small_target, target)
    budget = ["--seeds", "1", "--steps", "8", "--anchors", "8", "--prompts", "2", "--max-new-tokens", "16",
              "--regen-tokens", "24", "--max-length", "160", "--target", str(target), "--out", str(tmp_path / "abl")]
    out = main(["--grid", "paper", *budget])
    (row,) = out["rows"]
    assert row["cell"] == "paper" and row["seeds"] == 1
    result = json.loads((tmp_path / "abl" / "paper" / "seed0" / "result.json").read_text())
    assert result["prompts"] == 2 and result["cycles"] >= 2 * 16 // 8  # at most 8 tokens per cycle
    assert 0.5 <= result["tau_pooled"] <= 8.0 and 0.5 <= result["tau_per_prompt"] <= 8.0
    from lab.ablate import code_key

    assert result["code_key"] == code_key()  # the run records the code that made it
    table = (tmp_path / "abl" / "table.md").read_text()
    assert "| paper |" in table and "(1 seed)" in table and "+/- 0.000" not in table  # no spread from one seed
    assert "other code" not in table
    # Resumable: a rerun skips the finished run and gives the same table.
    capsys.readouterr()
    again = main(["--grid", "paper", *budget])
    assert again["rows"][0]["tau_pooled"] == row["tau_pooled"] and "1 done, 0 to run" in capsys.readouterr().out
    # Data labelled by an older draftsmith (no labelling-rules version recorded): once reused as it was, with
    # its finished runs. Now it is relabelled (answers kept, nothing regenerated) and the run trains again.
    from data.reuse import META_FILE, PARTIAL_FILE

    data = tmp_path / "abl" / "data-regen-8"
    meta = json.loads((data / META_FILE).read_text())
    answers = (data / "regenerated.jsonl").read_text()
    (data / META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if k != "label_rules"}))
    for name in ("result.json", "trained.json"):  # nor did its runs record which preparation they trained on
        path = tmp_path / "abl" / "paper" / "seed0" / name
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "data_key"}))
    main(["--grid", "paper", *budget])
    assert "0 done, 1 to run" in capsys.readouterr().out
    assert json.loads((data / META_FILE).read_text())["label_rules"] == meta["label_rules"] == 2
    assert (data / "regenerated.jsonl").read_text() == answers
    result = json.loads((tmp_path / "abl" / "paper" / "seed0" / "result.json").read_text())
    # A finished run of another cell, run alone: the table keeps the paper row (a partial --grid once
    # replaced the whole table). Its result is the paper's, relabelled as that cell's run would write it.
    from lab.ablate import prepare_data, run_argv, variant_folder

    abl, cell = tmp_path / "abl", "lr=2e-3"
    (abl / cell / "seed0").mkdir(parents=True)
    argv = run_argv(cell, 0, target=target, prepared=variant_folder("regen", abl, 8), run_dir=abl / cell / "seed0",
                    steps=8, anchors=8)
    (abl / cell / "seed0" / "result.json").write_text(json.dumps({**result, "cell": cell, "argv": argv}))
    assert [r["cell"] for r in main(["--grid", cell, *budget])["rows"]] == ["paper", cell]
    assert f"| {cell} |" in (abl / "table.md").read_text() and "| paper |" in (abl / "table.md").read_text()
    # A rebuilt target (its stamp rewritten): the runs of the old build are not reused, nor its data.
    stamp = target / "small_target.json"
    stamp.write_text(stamp.read_text() + "\n")
    assert main(["--table-only", *budget])["rows"] == []
    assert "| paper |" in (abl / "table.md").read_text()  # left as it was
    said = []
    prepare_data("regen", target, abl, rows=8, max_length=160, regen_tokens=24, progress=False, log=said.append)
    assert any("prepared against another build" in m for m in said)
    # An interrupted preparation of the same build resumes (its answers kept), never deleted as "another build".
    folder = variant_folder("regen", abl, 8)
    (folder / META_FILE).rename(folder / PARTIAL_FILE)
    answers, said = (folder / "regenerated.jsonl").read_text(), []
    prepare_data("regen", target, abl, rows=8, max_length=160, regen_tokens=24, progress=False, log=said.append)
    assert not any("another build" in m for m in said) and (folder / META_FILE).is_file()
    assert (folder / "regenerated.jsonl").read_text() == answers


def test_small_recipe_is_the_paper_recipe_at_small_size_with_the_ablation_winner():
    """recipes/small.yaml = the paper recipe + size-specific settings + the one >= 10% winner (gamma 1);
    the real-target recipes keep the paper's gamma."""
    from lab.ablate import BASE, CELLS
    from train.config import TrainConfig, load_config

    cfg, paper = load_config(["recipe=small"]), TrainConfig()
    for key in ("lr", "schedule", "warmup_ratio", "clip", "loss", "betas", "weight_decay"):
        assert getattr(cfg.train, key) == getattr(paper, key), key
    assert cfg.train.gamma == CELLS["gamma=1"]["train.gamma"] == 1.0 and cfg.gamma == 1.0
    assert cfg.drafter.rope_theta is None  # the target's RoPE base
    for recipe in ("qwen3-8b", "qwen35-9b"):
        assert load_config([f"recipe={recipe}"]).gamma == 7.0  # the paper's gamma for block 16
    for key, value in BASE.items():  # the ablation's baseline shape
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == value, key
    assert cfg.train.anchors == 64


def test_batch_cell_has_the_paper_cells_compute(tmp_path):
    """batch=8:lr=3e-3 trains the same rows x anchors as the paper cell, in 8x fewer steps."""
    from lab.ablate import run_argv

    def args(cell):
        argv = run_argv(cell, 0, target=tmp_path, prepared=tmp_path, run_dir=tmp_path, steps=1500, anchors=64)
        return dict(a.split("=", 1) for a in argv)

    paper, batch = args("paper"), args("batch=8:lr=3e-3")
    rows = lambda a: int(a["train.max_steps"]) * int(a["train.batch_size"]) * int(a["train.anchors"])  # noqa: E731
    assert rows(paper) == 1500 * 64 and abs(rows(batch) - rows(paper)) <= 8 * 64
    assert batch["train.lr"] == "0.003" and batch["drafter.num_hidden_layers"] == paper["drafter.num_hidden_layers"]
