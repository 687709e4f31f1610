"""`python -m inference.generate`: both backends, JSON output, baseline comparison, bad input."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import tiny_drafter_config
from inference.generate import main
from models.drafter import DFlashDraftModel
from models.target import TargetModel
from models.tiny import save_tiny_target


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target_dir = save_tiny_target(root / "target", "qwen3")
    target = TargetModel.from_pretrained(target_dir)
    torch.manual_seed(0)
    DFlashDraftModel(tiny_drafter_config(target)).save_pretrained(root / "draft")
    return str(target_dir), str(root / "draft")


def test_json_output_with_prompt_ids_and_baseline(folders, capsys):
    target, draft = folders
    report = main(["--backend", "torch", "--target", target, "--draft", draft, "--prompt-ids", "257,72,73,198",
                   "--max-new-tokens", "12", "--json", "--baseline"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(report))
    assert len(printed["tokens"]) == 12 or printed["stop_reason"] == "eos"
    assert printed["tau"] >= 1 and printed["acceptance_lengths"] and printed["decode_tokens_per_s"] > 0
    assert printed["matches_baseline"] is True and printed["first_divergence"] is None


def test_chat_prompt_text_and_smaller_block(folders, capsys):
    target, draft = folders
    report = main(["--backend", "torch", "--target", target, "--draft", draft, "--prompt", "hello", "--chat",
                   "--thinking", "off", "--max-new-tokens", "8", "--block-size", "4"])
    out = capsys.readouterr()
    assert "tau" in out.err and "tok/s" in out.err
    assert report["block_size"] == 4 and max(report["acceptance_lengths"] or [1]) <= 4


def test_mlx_backend_gives_the_torch_tokens(folders, capsys):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    target, draft = folders
    args = ["--target", target, "--draft", draft, "--prompt-ids", "257,72,73,198", "--max-new-tokens", "16", "--json"]
    torch_report = main(["--backend", "torch", *args])
    mlx_report = main(["--backend", "mlx", *args])
    capsys.readouterr()
    assert mlx_report["tokens"] == torch_report["tokens"]
    assert mlx_report["acceptance_lengths"] == torch_report["acceptance_lengths"]


def test_bad_input_is_explained(folders):
    target, draft = folders
    with pytest.raises(ValueError, match="comma-separated integers"):
        main(["--backend", "torch", "--target", target, "--draft", draft, "--prompt-ids", "1,x"])
    with pytest.raises(ValueError, match="trained block size 8"):
        main(["--backend", "torch", "--target", target, "--draft", draft, "--prompt-ids", "1", "--block-size", "32"])
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a Hub id"):
        main(["--backend", "torch", "--target", target, "--draft", "./nope/", "--prompt-ids", "1"])


def test_help_explains_the_flags():
    out = subprocess.run([sys.executable, "-m", "inference.generate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--block-size" in out.stdout and "auto" in out.stdout


def test_command_line_mistakes_print_one_line(folders):
    target, _ = folders
    out = subprocess.run([sys.executable, "-m", "inference.generate", "--target", target, "--draft", "/no/such/drafter",
                          "--prompt-ids", "1"], capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "error: drafter '/no/such/drafter' is neither a local folder nor a Hub id" in out.stderr


def test_baseline_comparison_is_timed_after_a_warm_up(folders, monkeypatch, capsys):
    # The speedup line compared a cold DFlash run (first kernels, first allocations) with a warm baseline.
    from inference.generate import Session

    calls = []
    real = Session.run

    def run(self, prompt, **kw):
        calls.append(kw)
        return real(self, prompt, **kw)

    monkeypatch.setattr(Session, "run", run)
    target, draft = folders
    argv = ["--backend", "torch", "--target", target, "--draft", draft, "--prompt-ids", "257,72,73,198",
            "--max-new-tokens", "40", "--json"]
    report = main(argv + ["--baseline"])
    assert [(c["baseline"], c["max_new_tokens"]) for c in calls] == [(True, 16), (True, 40)]
    assert len(report["tokens"]) == 40 or report["stop_reason"] == "eos"  # the reported run is the full one
    calls.clear()
    main(argv)  # no comparison asked: no warm-up spent
    assert [(c["baseline"], c["max_new_tokens"]) for c in calls] == [(False, 40)]
    calls.clear()
    main(argv + ["--loop", "static"])  # CUDA graphs are captured on first use: not in the timed run
    assert [(c["baseline"], c["max_new_tokens"]) for c in calls] == [(False, 16), (False, 40)]
