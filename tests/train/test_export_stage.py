"""distill.py's export stage: the ``export.*`` keys become ``python -m export.*`` subprocesses."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from train.export_stage import ExportStageError, export_commands, run_export_stage

ROOT = Path(__file__).resolve().parents[2]


def settings(**kw):
    base = dict(hf=False, hf_dtype="bf16", mlx=False, mlx_quantize=None, mlx_group_size=64, push_repo=None,
                push_mlx_repo=None, push_private=False, dir=None)
    return SimpleNamespace(**{**base, **kw})


def test_commands_follow_the_keys(tmp_path):
    final = tmp_path / "final" / "drafter"
    py = [sys.executable, "-m"]
    assert export_commands(settings(), final, tmp_path) == []
    cmds = export_commands(settings(hf=True, mlx=True, mlx_quantize=4, push_repo="me/d", push_mlx_repo="me/d-mlx",
                                    push_private=True), final, tmp_path)
    root = tmp_path / "export"
    assert cmds == [
        py + ["export.hf", "--checkpoint", str(final), "--out", str(root / "hf"), "--dtype", "bf16", "--overwrite"],
        py + ["export.mlx", "--checkpoint", str(final), "--out", str(root / "mlx"), "--overwrite", "--quantize", "4",
              "--group-size", "64"],
        py + ["export.push", "--folder", str(root / "hf"), "--repo", "me/d", "--private"],
        py + ["export.push", "--folder", str(root / "mlx"), "--repo", "me/d-mlx", "--private"],
    ]
    other = export_commands(settings(mlx=True, dir=str(tmp_path / "x")), final, tmp_path)
    assert other == [py + ["export.mlx", "--checkpoint", str(final), "--out", str(tmp_path / "x" / "mlx"),
                           "--overwrite"]]


def test_stage_runs_the_export_and_names_the_command_when_it_fails(tmp_path, monkeypatch):
    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel

    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=300, num_target_layers=8,
                       target_layer_ids=[1, 3, 5], mask_token_id=290, block_size=4, torch_dtype="float32")
    torch.manual_seed(0)
    final = DFlashDraftModel(cfg).save_pretrained(tmp_path / "final" / "drafter")
    monkeypatch.chdir(tmp_path)  # the stage must not depend on the working directory
    ran = []

    def in_process(cmd, env, cwd):
        """Run the command's real CLI here (a subprocess costs seconds of imports); record what was asked."""
        import importlib

        assert cmd[:2] == [sys.executable, "-m"]
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)  # `-m export.*` resolves from anywhere
        assert cwd == str(ROOT)  # not the user's folder, whose models.py or export/ would run instead
        ran.append(cmd)
        importlib.import_module(cmd[2]).main(cmd[3:] + ["--no-remote-code-check"])
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr("subprocess.run", in_process)
    lines = run_export_stage(settings(hf=True, hf_dtype="fp32"), final, tmp_path, log=lambda *_: None)
    assert len(ran) == 1
    assert lines == [f"python -m export.hf --checkpoint {final} --out {tmp_path / 'export' / 'hf'} --dtype fp32 "
                     "--overwrite"]
    written = json.loads((tmp_path / "export" / "hf" / "config.json").read_text())
    assert written["torch_dtype"] == "float32" and written["dflash_config"]["target_layer_ids"] == [1, 3, 5]

    monkeypatch.setattr("subprocess.run", lambda *a, **k: SimpleNamespace(returncode=1))
    with pytest.raises(ExportStageError, match=r"re-run: python -m export.hf --checkpoint .* --dtype fp32"):
        run_export_stage(settings(hf=True, hf_dtype="fp32"), final, tmp_path, log=lambda *_: None)


def test_config_keys_become_commands():  # mistakes: tests/test_bad_inputs.py
    from train.config import load_config

    cfg = load_config(["recipe=tiny", "export.hf=true", "export.mlx=true", "export.mlx_quantize=4",
                       "export.push_repo=me/d"])
    assert [c[2] for c in export_commands(cfg.export, Path("f"), Path("o"))] == ["export.hf", "export.mlx",
                                                                                 "export.push"]


def test_a_training_run_exports_its_final_drafter(tmp_path_factory, tmp_path, monkeypatch):
    """One optimizer step of the tiny recipe with export.hf + a 4-bit export.mlx: the folders carry the run's
    provenance (recipe, steps, target, data)."""
    pytest.importorskip("mlx.core")
    import importlib

    from tests.helpers.tiny_run import FAST, tiny_input_dirs
    from train.config import load_config
    from train.distill import train

    def in_process(cmd, env, **kw):  # cwd: the package folder (train.export_stage)
        args = cmd[3:] + (["--no-remote-code-check"] if cmd[2] == "export.hf" else [])
        importlib.import_module(cmd[2]).main(args)
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr("subprocess.run", in_process)
    d = tiny_input_dirs(tmp_path_factory)
    train(load_config(["recipe=tiny", f"out_dir={tmp_path}", f"target.path={d['target']}",
                       f"data.prepared={d['data']}", *FAST, "train.max_steps=1", "export.hf=true", "export.mlx=true",
                       "export.mlx_quantize=4", "export.mlx_group_size=32"]))
    hf = json.loads((tmp_path / "export" / "hf" / "config.json").read_text())
    mlx = json.loads((tmp_path / "export" / "mlx" / "config.json").read_text())
    assert hf["draftsmith"] == mlx["draftsmith"]
    prov = hf["draftsmith"]
    assert prov["recipe"] == "tiny" and prov["steps"] == 1 and prov["target"] == str(d["target"])
    assert prov["target_quantization"] == "none (unquantized weights)"
    # the prepared folder it trained on (data.prepared), not the recipe's data.source=tiny
    assert prov["data"]["source"] == json.loads((d["data"] / "draftsmith_data.json").read_text())["source"]
    assert mlx["quantization"] == {"bits": 4, "group_size": 32, "mode": "affine"}
    assert hf["dflash_config"] == {k: v for k, v in mlx["dflash_config"].items()}
