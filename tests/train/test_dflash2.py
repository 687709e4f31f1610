"""drafter.variant=dflash2 in the training config: the recipe key, the dry-run plan, warm starts and checkpoints."""

import pytest
import torch

from train.config import load_config


def test_the_dry_run_plans_a_dflash2_drafter_with_its_convs_and_selector(capsys):
    from train.plan import print_plan

    v1 = print_plan(load_config(["recipe=tiny"]))["drafter"]
    v2 = print_plan(load_config(["recipe=tiny", "drafter.variant=dflash2"]))["drafter"]
    printed = capsys.readouterr().out
    assert v1["variant"] == "dflash" and set(v1["params_m_by_part"]) == {"backbone", "total"}
    parts = v2["params_m_by_part"]
    assert v2["variant"] == "dflash2" and parts["backbone"] == v1["params_m_by_part"]["backbone"]
    assert parts["convs"] > 0 and parts["selector"] > 0 and v2["flops_per_token"] > v1["flops_per_token"]
    assert "drafter: dflash2, 2 layers" in printed and f"convs {parts['convs']}M, selector {parts['selector']}M" \
        in printed


def test_a_recipe_variant_that_is_no_generation_is_refused():
    with pytest.raises(ValueError, match=r"drafter.variant='dflash3': use one of \('dflash', 'dflash2'\)"):
        load_config(["recipe=tiny", "drafter.variant=dflash3"])


def test_warm_start_config_from_a_v1_folder_keeps_only_its_backbone_settings(tmp_path):
    from models.drafter import DFlashDraftModel
    from models.drafter2 import DFlash2DraftModel
    from tests.helpers.dflash2 import tiny_dflash2_config
    from train.setup import warm_start_config

    run = tiny_dflash2_config()
    v1 = run.as_variant("dflash").replace(layer_types=["full_attention"] * 2, sliding_window=None, rms_norm_eps=1e-5)
    DFlashDraftModel(v1).save_pretrained(tmp_path / "v1")
    resolved = warm_start_config(str(tmp_path / "v1"), run)
    assert resolved == run.replace(rms_norm_eps=1e-5)  # DFlash2's sliding layers, not the folder's full ones
    # a DFlash2 folder keeps its own conv and selector settings (no recipe key sets them)
    DFlash2DraftModel(run.replace(selector_rank=16, conv_kernel_size=3)).save_pretrained(tmp_path / "v2")
    resolved = warm_start_config(str(tmp_path / "v2"), run)
    assert (resolved.selector_rank, resolved.conv_kernel_size) == (16, 3)
    with pytest.raises(ValueError, match="is a DFlash2 drafter and this run trains variant dflash"):
        warm_start_config(str(tmp_path / "v2"), run.as_variant("dflash"))


def test_a_checkpoint_saves_a_dflash2_drafter_under_its_class(tmp_path):
    from accelerate import Accelerator

    from models.drafter2 import DFlash2DraftModel, load_drafter
    from tests.helpers.dflash2 import random_dflash2, tiny_dflash2_config
    from train.checkpoint import save_drafter

    model = random_dflash2(tiny_dflash2_config())
    save_drafter(Accelerator(cpu=True), model, tmp_path / "drafter")
    again = load_drafter(tmp_path / "drafter")
    assert isinstance(again, DFlash2DraftModel)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------ training runs (tests/helpers/tiny_run.py)
@pytest.fixture(scope="module")
def golden_inputs(tmp_path_factory):
    """The seeded tiny target and the tiny chats as written (no fitting, no regeneration): cheap to build."""
    from tests.helpers.tiny_run import golden_input_dirs

    return golden_input_dirs(tmp_path_factory.mktemp("dflash2_inputs"))


def _common(golden_inputs):
    from tests.helpers.tiny_run import FAST

    return [*golden_inputs, *FAST, "logging.every=1", "eval.batches=1", "train.anchors=8", "train.ce_chunk=16"]


def test_a_two_step_dflash2_run_drops_its_loss_and_resume_refuses_another_selector_alpha(golden_inputs, tmp_path):
    """drafter.variant=dflash2 trains: finite losses that drop, the selector CE logged beside the unary CE, the
    held-out walk's tau and the unary argmax's, and a true tau from the torch loop (through its proposal step,
    inference.cycle.propose_block); the run records its selector alpha, and a resume that changes it is refused
    (it changes the objective)."""
    import json

    from tests.helpers.tiny_run import losses, run
    from train.checkpoint import ResumeConfigError

    out = tmp_path / "v2"
    result = run(out, *_common(golden_inputs), "drafter.variant=dflash2", "train.max_steps=2", "train.batch_size=4",
                 "eval.true_tau_prompts=2", "eval.true_tau_max_new_tokens=8")
    loss, sel = losses(out), losses(out, "selector_ce")
    assert set(loss) == set(sel) == {1, 2}
    assert all(torch.isfinite(torch.tensor(v)) for v in (*loss.values(), *sel.values()))
    assert loss[2] < loss[1] and sel[2] < sel[1]
    last = result["last_eval"]
    assert {"eval_tau_sim", "eval_tau_sim_unary", "eval_selector_ce"} <= set(last)
    assert 1.0 <= last["eval_tau_sim"] <= 8.0 and last["eval_selector_ce"] > 0
    assert last["eval_true_cycles"] > 0 and last["eval_tau_true"] >= 0
    prov = json.loads((out / "final" / "drafter" / "config.json").read_text())["draftsmith"]
    assert prov["objective"] == {"weighting": "dpace", "alpha": 0.5, "normaliser": "weights",
                                 "selector_loss_alpha": 1.0}
    with pytest.raises(ResumeConfigError, match=r"train.selector_loss_alpha: 1.0 -> 0.5"):
        run(out, *_common(golden_inputs), "drafter.variant=dflash2", "train.max_steps=3", "train.batch_size=4",
            "train.selector_loss_alpha=0.5", "resume=true")


def test_init_from_a_v1_drafter_starts_dflash2_at_v1s_loss_and_tau(golden_inputs, tmp_path):
    """A DFlash2 run warm-started from a v1 drafter (backbone copied, identity convs, zero hidden_projection) starts
    where the v1 drafter is: with the selector term off, its held-out loss at step 0 is v1's on the same rows, and
    its walk's tau and its unary tau are v1's (the edge term is exactly 0)."""
    from tests.helpers.tiny_run import run

    v1 = run(tmp_path / "v1", *_common(golden_inputs), "train.max_steps=1", "train.batch_size=4")
    v2 = run(tmp_path / "v2", *_common(golden_inputs), "drafter.variant=dflash2", "train.max_steps=1",
             "train.batch_size=4", "train.selector_loss_alpha=0", "eval.at_start=true",
             f"drafter.init_from={tmp_path / 'v1' / 'final' / 'drafter'}")
    before, after = v2["first_eval"], v1["last_eval"]  # v2 untrained from v1's final weights; v1's eval of them
    assert before["step"] == 0
    assert abs(before["eval_loss"] - after["eval_loss"]) < 1e-5
    assert before["eval_tau_sim"] == before["eval_tau_sim_unary"] == after["eval_tau_sim"]
    assert before["eval_pos_acc"] == after["eval_pos_acc"]


@pytest.fixture(scope="module")
def one_process_v2(golden_inputs, tmp_path_factory):
    """The reference for the scale-out runs: 2 steps of DFlash2 with D-PACE over 2 rows in one process."""
    from tests.helpers.tiny_run import run

    out = tmp_path_factory.mktemp("v2_one") / "one"
    run(out, *_common(golden_inputs), "drafter.variant=dflash2", "train.max_steps=2", "train.loss_weighting=dpace",
        "train.batch_size=2")
    return out


@pytest.mark.parametrize("launcher", ["ddp", "fsdp"])
def test_dflash2_on_two_processes_takes_the_one_process_steps(launcher, golden_inputs, one_process_v2, tmp_path):
    """DDP (the selector is used outside the wrapper's forward: every one of its parameters still gets its gradient
    reduced, none is unused) and FSDP2 (each DFlash2DecoderLayer a unit, named by the drafter's _no_split_modules;
    the selector in the root unit, gathered through the backward), 1 row on each of 2 CPU processes: the losses,
    the selector CE and the weights after 2 steps are the one process's with 2 rows."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from tests.helpers import assert_close
    from tests.helpers.tiny_run import losses

    root = Path(__file__).resolve().parents[2]
    args = ["recipe=tiny", f"out_dir={tmp_path / launcher}", *_common(golden_inputs), "drafter.variant=dflash2",
            "train.max_steps=2", "train.loss_weighting=dpace", "train.batch_size=1"]
    if launcher == "ddp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(root / "train" / "distill.py"), *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(root / "recipes" / "accelerate" / "fsdp.yaml"), "--mixed_precision", "no", "--num_processes", "2",
               str(root / "tests" / "helpers" / "fsdp_on_cpu.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert launcher == "ddp" or "fsdp on cpu: version 2" in proc.stdout + proc.stderr
    one, two = one_process_v2, tmp_path / launcher
    for key in ("loss", "selector_ce"):
        a, b = losses(one, key), losses(two, key)
        assert_close([b[1], b[2]], [a[1], a[2]], atol=1e-5, rtol=1e-6, what=f"{key}, {launcher} 2 x 1 row vs 1 x 2")
    wa, wb = (load_file(str(r / "final" / "drafter" / "model.safetensors")) for r in (one, two))
    assert set(wa) == set(wb) and any(k.startswith("candidate_selector.") for k in wa)
    for k in wa:
        assert_close(wb[k].float(), wa[k].float(), atol=5e-5, what=f"drafter weight {k} after 2 steps ({launcher})")
