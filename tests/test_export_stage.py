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

ROOT = Path(__file__).resolve().parent.parent


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

    def in_process(cmd, env):
        """Run the command's real CLI here (a subprocess costs seconds of imports); record what was asked."""
        import importlib

        assert cmd[:2] == [sys.executable, "-m"]
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)  # `-m export.*` resolves from anywhere
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
