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
