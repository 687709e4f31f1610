"""The tiny recipe end to end: pinned 2-step loss, learning (simulated and true tau), exact resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_close
from tests.helpers.tiny_run import FAST, golden_input_dirs, losses, metrics, run

GOLDEN = Path(__file__).parents[1] / "golden" / "train_tiny_2step.json"
def test_two_step_loss_matches_golden(tmp_path, pyarrow_pickled_by_value):
    """The tiny recipe's objective on inputs every CPU computes alike (``golden_input_dirs``). Also where datasets
    cannot pickle an Arrow table: loading, splitting and reading the prepared rows never hash one, nor fall back
    to a random hash."""
    inputs = golden_input_dirs(tmp_path / "inputs")
    run(tmp_path / "run", *inputs, *FAST, "train.max_steps=2", "logging.every=1")
    tmp_path = tmp_path / "run"
    got = losses(tmp_path)
    golden = json.loads(GOLDEN.read_text())
    assert_close([got[1], got[2]], golden["losses"], atol=1e-4,
                 what="tiny 2-step loss (regenerate with python tests/golden/make_train_golden.py)")
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "final" / "drafter" / "config.json").is_file()
    # data.prepared is read where it is: nothing is prepared again under out_dir
    assert not (tmp_path / "data").exists()


def test_resume_reproduces_uninterrupted_losses(tiny_inputs, tmp_path):
    full = tmp_path / "full"
    run(full, *tiny_inputs, *FAST, "train.max_steps=6", "checkpoint.every=3", "logging.every=1")
    ref = losses(full)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]
    # "Kill after step 3": the run dir as it was when step 3's checkpoint had been written.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_6")
    shutil.rmtree(cut / "final")
    # metrics.jsonl keeps the rows of steps 4-6 logged after the checkpoint and a row cut short by the kill:
    # resume drops them (they once stayed, so steps 4-6 appeared twice).
    with (cut / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')
    run(cut, *tiny_inputs, *FAST, "train.max_steps=6", "checkpoint.every=3", "logging.every=1", "resume=true")
    resumed = losses(cut)
    assert_close([resumed[k] for k in (4, 5, 6)], [ref[k] for k in (4, 5, 6)], atol=1e-6, what="resumed losses")
    assert [r["step"] for r in metrics(cut) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # each step once
    ckpt = full / "checkpoints" / "step_6"
    assert {p.name for p in ckpt.iterdir()} >= {"drafter", "state", "config.yaml", "trainer_state.json"}


def test_tiny_recipe_learns(tiny_inputs, tmp_path):
    """Held-out simulated tau >= 1.5x the untrained drafter's; true tau (torch loop) >= 2 and within 25% of it."""
    import torch

    from inference.torch_loop import DrafterProposer, dflash_generate
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel

    result = run(tmp_path, *tiny_inputs, "logging.progress=false", "checkpoint.every=0")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    before, after = result["first_eval"], [json.loads(line) for line in lines if "eval_tau_sim" in line][-1]
    print(f"tau before {before['eval_tau_sim']:.3f} after {after['eval_tau_sim']:.3f} "
          f"true {after['eval_tau_true']:.3f} uncut {after['eval_tau_true_uncut']:.3f}")
    assert after["eval_tau_sim"] >= 1.5 * before["eval_tau_sim"]
    # The simulation scores whole blocks at uniform anchors: the loop's cycles that no EOS or budget cut
    # come close, a little below (the loop dwells where the drafter is weak). Measured 2.26 vs 2.67 with the
    # decay weighting (0.85x); 2.65 vs 3.32 with D-PACE (0.80x: it lifts the later slots the loop rarely reaches).
    assert 0.75 * after["eval_tau_sim"] <= after["eval_tau_true_uncut"] <= 1.05 * after["eval_tau_sim"]
    assert after["eval_tau_true"] >= 2.0  # measured 2.54 (from ~1.0 untrained)
    assert after["eval_tau_true"] < after["eval_tau_true_uncut"]  # the short answers' last cycles are cut
    # the anchor count stays on the device through a step; the logged rate is still a plain number
    steps = [r for r in metrics(tmp_path) if "loss" in r]
    assert steps and all(type(r["anchors_per_s"]) is float and r["anchors_per_s"] > 0 for r in steps)
    # The final folder is what the inference loop loads.
    target = TargetModel.from_pretrained(tiny_inputs[0].split("=", 1)[1], dtype=torch.float32)
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "final" / "drafter", dtype=torch.float32)
    res = dflash_generate(target, DrafterProposer(drafter, target), [257, 85, 82, 68, 81, 198], max_new_tokens=16)
    # every cycle commits the target's own token at least: >= 1 per cycle uncut (the budget-cut tau can dip
    # below 1 when the answer's end-of-turn opens the last cycle and the drafter gets nothing accepted)
    assert res.tokens and res.tau_uncut >= 1.0
    # The README's next step: the bf16 MLX export of this drafter passes its parity gate (a trained D-PACE drafter
    # once measured 4.35e-2 against the gate's old 4e-2: bf16 rounding, its fp32 export agreed to 3.5e-6).
    pytest.importorskip("mlx.core")
    from export.mlx import export_mlx

    exported = export_mlx(tmp_path, tmp_path / "mlx", log=lambda *_: None)
    assert exported["parity"]["rel"] < 8e-2
