"""The ablation's D-PACE and DFlash2 cells: their overrides as the training config reads them, the compute of the
DFlash2 cells, the two-stage cell's order and data, and true tau of a DFlash2 drafter. No training here."""

from __future__ import annotations

import json

import pytest
import torch

from lab.ablate import CELLS, V2_EQUAL_COMPUTE, drafter_forward_flops, run_argv, variant_folder, variant_rows
from train.config import load_config
from tests.lab.test_bad_inputs import stand_in_small_target


def config_of(cell, tmp_path, steps=1500):
    run_dir = tmp_path / "abl" / cell / "seed0"
    argv = run_argv(cell, 0, target=tmp_path, prepared=tmp_path, run_dir=run_dir, steps=steps, anchors=64)
    return load_config(argv), dict(a.split("=", 1) for a in argv)


@pytest.mark.parametrize("cell, alpha, normaliser, loss", [
    ("dpace", 0.5, "weights", "ce"), ("dpace:tokens", 0.5, "tokens", "ce"), ("dpace:rows", 0.5, "rows", "ce"),
    ("dpace:ce+kl", 0.5, "weights", "ce+kl"), ("dpace:alpha=0.25", 0.25, "weights", "ce"),
    ("dpace:alpha=0", 0.0, "weights", "ce")])
def test_dpace_cells_train_dpace_with_their_one_change(tmp_path, cell, alpha, normaliser, loss):
    cfg, args = config_of(cell, tmp_path)
    assert args["train.gamma"] == "null"  # a gamma (unset = None) would be refused with dpace
    assert cfg.loss_weighting() == {"gamma": None, "weighting": "dpace", "dpace_alpha": alpha,
                                    "normaliser": normaliser}
    assert cfg.train.loss == loss and cfg.train.max_steps == 1500 and cfg.drafter.variant == "dflash"


@pytest.mark.parametrize("cell, gamma", [("paper", 4.0), ("gamma=1", 1.0), ("dflash2", 4.0)])
def test_decay_cells_name_the_paper_objective(tmp_path, cell, gamma):
    """The baseline is the paper's decay whatever train/config.py's default weighting becomes."""
    cfg, args = config_of(cell, tmp_path)
    assert args["train.loss_weighting"] == "decay"
    assert cfg.loss_weighting() == {"gamma": gamma, "weighting": "decay", "normaliser": "weights"}


def test_dflash2_cells_compute(tmp_path):
    """dflash2 trains at the paper cell's drafter compute (steps x forward FLOPs), dflash2:same-steps at its steps;
    dflash2:from-v1 is v1 for half the steps, then v2 from that drafter for the rest of the compute."""
    v1, v2 = drafter_forward_flops("dflash"), drafter_forward_flops("dflash2")
    assert 1.0 < v2 / v1 < 1.22 and V2_EQUAL_COMPUTE == round(v1 / v2, 4)
    steps = {c: config_of(c, tmp_path)[0] for c in ("paper", "dflash2", "dflash2:same-steps", "paper:first-half",
                                                    "dflash2:from-v1")}
    paper = steps["paper"].train.max_steps * v1
    assert steps["paper"].drafter.variant == "dflash"
    assert abs(steps["dflash2"].train.max_steps * v2 - paper) <= v2  # within one step
    assert steps["dflash2:same-steps"].train.max_steps == 1500
    first, second = steps["paper:first-half"], steps["dflash2:from-v1"]
    assert first.drafter.variant == "dflash" and first.train.max_steps == 750
    assert second.drafter.variant == "dflash2" and abs(750 * v1 + second.train.max_steps * v2 - paper) <= v2
    for cfg in steps.values():
        assert cfg.train.selector_loss_alpha == (1.0 if cfg.drafter.variant == "dflash2" else None)
    # the second stage starts from the first stage's final drafter at the same seed
    assert second.drafter.init_from == str(tmp_path / "abl" / "paper:first-half" / "seed0" / "final" / "drafter")
    # ... and trains on the rows the first stage did not see: each half once
    assert (CELLS["paper:first-half"]["data"], CELLS["dflash2:from-v1"]["data"]) == ("half", "half2")
    assert variant_rows("half", 1500) + variant_rows("half2", 1500) == 1500
    assert variant_rows("half", 7) + variant_rows("half2", 7) == 7


def test_two_stage_cell_runs_after_its_first_stage(tmp_path, monkeypatch):
    """--grid dflash2:from-v1 adds its first stage and queues the second stage after every first stage, whose
    training it records (a first stage trained again trains the second again)."""
    import lab.ablate as ab

    target = stand_in_small_target(tmp_path / "target")
    batches = []

    def run_all(todo, *a):
        batches.append([f"{p.parent.name}/{p.name}" for p in todo])
        for p in todo:  # as if trained
            (p / "trained.json").write_text(json.dumps({"argv": p.name}))

    monkeypatch.setattr(ab, "prepare_data", lambda variant, t, out, **k: ab.variant_folder(variant, out, 3))
    monkeypatch.setattr(ab, "run_all", run_all)
    ab.main(["--grid", "dflash2:from-v1", "--steps", "3", "--seeds", "2", "--target", str(target),
             "--out", str(tmp_path / "abl")])
    assert batches == [["paper/seed0", "paper/seed1", "paper:first-half/seed0", "paper:first-half/seed1"],
                       ["dflash2:from-v1/seed0", "dflash2:from-v1/seed1"]]
    spec = json.loads((tmp_path / "abl" / "dflash2:from-v1" / "seed1" / "spec.json").read_text())
    assert spec["init_key"] == ab.init_key(tmp_path / "abl" / "dflash2:from-v1" / "seed1", "paper:first-half")
    assert spec["init_key"] is not None and f"drafter.init_from={tmp_path}/abl/paper:first-half/seed1/final/drafter" \
        in spec["argv"]
    finished = {**spec, "tau_pooled": 2.0}
    assert ab.finished(tmp_path / "abl" / "x", finished) is False  # (no result there)
    (tmp_path / "abl" / "dflash2:from-v1" / "seed1" / "result.json").write_text(json.dumps(finished))
    assert ab.finished(tmp_path / "abl" / "dflash2:from-v1" / "seed1", spec)
    assert not ab.finished(tmp_path / "abl" / "dflash2:from-v1" / "seed1", {**spec, "init_key": "retrained"})


def test_half2_variant_holds_the_second_half_of_the_conversations(tmp_path, monkeypatch):
    import data.prepare
    import lab.ablate as ab

    target = stand_in_small_target(tmp_path / "target", chats=0)
    (target / "chats.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": str(i)}]})
                                                + "\n" for i in range(8)))
    monkeypatch.setattr(ab, "target_key", lambda t: "build")
    calls = []

    def prepare(target, source, out, *, limit, **k):
        calls.append((source, limit))
        out.mkdir(parents=True, exist_ok=True)
        (out / "regenerated.jsonl").write_text("answers\n")
        return {"rows": limit}

    monkeypatch.setattr(data.prepare, "prepare", prepare)
    (tmp_path / "abl").mkdir()  # (main makes it)
    folder = ab.prepare_data("half2", target, tmp_path / "abl", rows=7, max_length=64, regen_tokens=8,
                             progress=False, log=lambda m: None)
    assert folder == variant_folder("half2", tmp_path / "abl", 7) and folder.name == "data-half2-4"
    (regen, n_all), (source, n) = calls
    assert (regen, n_all) == (str(target / "chats.jsonl"), 7) and n == 4
    assert [json.loads(line)["messages"][0]["content"] for line in open(source)] == ["3", "4", "5", "6"]
    assert (folder / "regenerated.jsonl").read_text() == "answers\n"  # the regenerated answers, copied


def test_true_tau_report_loads_a_dflash2_drafter(tmp_path):
    """lab.ablate evaluated every drafter folder as v1 (DFlashDraftModel): a DFlash2 one lost its convs and its
    selector. Now its true tau is the selector walk's, as the loops propose."""
    from inference.torch_loop import DrafterProposer, dflash_generate
    from lab.ablate import true_tau_report
    from lab.small_target import small_target_prompt_ids
    from models.drafter2 import DFlash2DraftModel, load_drafter
    from models.target import TargetModel
    from models.tiny import save_tiny_target
    from tests.helpers.dflash2 import random_dflash2, tiny_v2_config

    target_dir = save_tiny_target(tmp_path / "target")
    prompts = [{"messages": [{"role": "user", "content": text}]} for text in ("def f(x):", "import os")]
    (target_dir / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    target = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    random_dflash2(tiny_v2_config(target)).save_pretrained(tmp_path / "drafter")
    report = true_tau_report(tmp_path / "drafter", target_dir, prompts=2, max_new_tokens=12)
    drafter = load_drafter(tmp_path / "drafter", dtype=torch.float32).eval()
    assert isinstance(drafter, DFlash2DraftModel)
    proposer, lengths = DrafterProposer(drafter, target), []
    for ids in small_target_prompt_ids(target_dir, 2):
        lengths += dflash_generate(target, proposer, ids, max_new_tokens=12).acceptance_lengths
    assert report["prompts"] == 2 and report["cycles"] == len(lengths)
    assert report["tau_pooled"] == pytest.approx(sum(lengths) / len(lengths))
