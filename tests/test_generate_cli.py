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


def test_a_sampled_run_does_not_report_a_mismatch_with_its_baseline(folders, capsys):
    """Sampled, DFlash and the baseline draw their tokens differently from one seed: "matches baseline: False"
    read as a lossless loop gone wrong. Not compared (None), as validate reports sampled runs."""
    target, draft = folders
    args = ["--backend", "torch", "--target", target, "--draft", draft, "--prompt-ids", "257,72,73,198",
            "--max-new-tokens", "12", "--baseline", "--temperature", "1.0", "--seed", "3"]
    report = main(args + ["--json"])
    assert report["matches_baseline"] is None and report["first_divergence"] is None
    assert report["speedup"] is not None and report["baseline_decode_tokens_per_s"] > 0
    capsys.readouterr()
    main(args)
    assert "matches baseline: - (sampled: not compared)" in capsys.readouterr().err


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


def _draft_variant(draft, out, edit):
    """A copy of the drafter's config.json (and a README when asked) edited by ``edit``: pre-flight reads no
    weights."""
    import shutil
    from pathlib import Path

    out = Path(out)
    shutil.copytree(draft, out)
    d = json.loads((out / "config.json").read_text())
    edit(d, out)
    (out / "config.json").write_text(json.dumps(d))
    return str(out)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_a_temperature_that_is_not_a_finite_number_is_refused(folders, temperature):
    """nan compares false with everything, so "not below 0" alone let it through to sampling."""
    from inference.checks import preflight

    target, draft = folders
    with pytest.raises(ValueError, match="--temperature (nan|inf): use 0 for greedy"):
        preflight(target, draft, temperature=temperature)


def test_a_multimodal_target_is_checked_by_its_text_config(folders, tmp_path):
    """Qwen3.5 / 3.6 checkpoints keep hidden size, vocabulary and depth under text_config: a drafter for
    another target is refused there too, a matching one passes with the text tower's facts."""
    from inference.checks import preflight
    from models.tiny import tiny_config

    target, draft = folders
    vl = tmp_path / "vl"
    vl.mkdir()
    tiny_config("qwen3_5_vl", 288, 8).to_json_file(vl / "config.json")
    pre = preflight(str(vl), draft)
    assert (pre.target.hidden_size, pre.target.vocab_size, pre.target.num_layers) == (64, 288, 8)
    wide = _draft_variant(draft, tmp_path / "wide", lambda d, _: d.update(hidden_size=96))
    with pytest.raises(ValueError, match="has hidden_size 96 but the target's is 64"):
        preflight(str(vl), wide)


def test_a_multimodal_targets_top_level_vocab_size_is_read_when_the_text_config_has_none(folders, tmp_path):
    """Some multimodal configs keep vocab_size beside text_config, not inside it: a drafter for another
    vocabulary must still be refused."""
    from inference.checks import preflight

    target, draft = folders
    vl = tmp_path / "vl"
    vl.mkdir()
    text = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 8}
    (vl / "config.json").write_text(json.dumps({"model_type": "vl", "vocab_size": 512, "text_config": text}))
    with pytest.raises(ValueError, match="has vocab_size 288 but the target's is 512"):
        preflight(str(vl), draft)


def test_a_drafter_config_named_by_its_dflash_block_alone_is_a_drafter(folders, tmp_path):
    """A drafter config.json without ``architectures`` (some exports drop it) is still recognised by its
    ``dflash_config`` block, so it is neither refused as "not a DFlash drafter" nor taken for a target."""
    from inference.checks import preflight

    target, draft = folders
    bare = _draft_variant(draft, tmp_path / "bare", lambda d, _: d.pop("architectures"))
    assert "dflash_config" in json.loads((tmp_path / "bare" / "config.json").read_text())
    assert preflight(target, bare).drafter.block_size == 8
    with pytest.raises(ValueError, match="is a DFlash drafter .* and --draft .* is not: swap them"):
        preflight(bare, target)


def test_the_recorded_target_is_the_config_provenance_before_the_card(folders, tmp_path):
    """export.hf writes the trained target into config.json's draftsmith block first: neither an older
    dflash_config.target_model nor a hand-edited card's base_model overrides it."""
    from inference.checks import preflight

    target, draft = folders

    def edit(d, out):
        d["draftsmith"] = {"target": "Qwen/Qwen3-8B"}
        d["dflash_config"]["target_model"] = "Qwen/Qwen3-0.6B"
        (out / "README.md").write_text("---\nbase_model: 'meta-llama/Llama-3.1-8B'\n---\n# card\n")

    assert preflight(target, _draft_variant(draft, tmp_path / "prov", edit)).recorded_target == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("given, warns", [("mlx-community/Qwen3-8B-4bit", False), ("Qwen/Qwen3-8B", False),
                                          ("meta-llama/Llama-3.1-8B-Instruct", True)])
def test_a_quantized_copy_of_the_recorded_target_gives_no_warning(folders, tmp_path, caplog, given, warns):
    """A drafter trained for Qwen/Qwen3-8B run against mlx-community/Qwen3-8B-4bit is the same model: no
    "records its target as" warning; another model warns. Only config files are read (a config-only target)."""
    import shutil

    from inference.checks import preflight

    target, draft = folders
    named = tmp_path / given
    named.mkdir(parents=True)
    shutil.copy(f"{target}/config.json", named / "config.json")
    recorded = _draft_variant(draft, tmp_path / "rec", lambda d, _: d.update(draftsmith={"target": "Qwen/Qwen3-8B"}))
    with caplog.at_level("WARNING", logger="inference"):
        preflight(str(named), recorded)
    assert ("records its target as Qwen/Qwen3-8B" in caplog.text) == warns, caplog.text


def test_static_loop_buffers_stop_at_the_targets_positions(folders, tmp_path, caplog):
    """--loop static --max-new-tokens 1000000000 preallocated K/V buffers for a billion positions ("DefaultCPUAllocator:
    can't allocate memory: you tried to allocate 128000065536 bytes"; a CUDA OOM on a GPU): it generates up to the
    target's max_position_embeddings, says so, and sizes the buffers for that."""
    import logging
    import shutil
    from pathlib import Path

    from inference.generate import Session

    target, draft = folders
    short = shutil.copytree(target, tmp_path / "target")
    config = json.loads((Path(short) / "config.json").read_text())
    (Path(short) / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    sizes = []
    real = Session._static_loop

    def spy(self, *a):
        loop = real(self, *a)
        sizes.append(loop[0].max_len)
        return loop

    with caplog.at_level(logging.WARNING, logger="inference"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(Session, "_static_loop", spy)
        report = main(["--backend", "torch", "--target", str(short), "--draft", draft, "--prompt-ids", "257,72,73,198",
                       "--max-new-tokens", "1000000000", "--json", "--loop", "static", "--device", "cpu"])
    assert len(report["tokens"]) == 36 or report["stop_reason"] == "eos"
    assert max(sizes) <= 4096
    assert ("--max-new-tokens 1000000000 with a 4-token prompt runs past the target's 40 positions "
            "(max_position_embeddings): the static loop preallocates its caches, so it generates at most 36 new "
            "tokens (about ") in caplog.text and "--loop eager generates past" in caplog.text


def test_static_buffer_estimate_counts_only_the_layers_with_a_kv_cache():
    """The estimate in the positions warning counted Qwen3.5's GatedDeltaNet layers (fixed-size state) as
    attention layers: 4x the K/V bytes of a 3:1 hybrid."""
    from types import SimpleNamespace

    import torch

    from inference.generate import Session

    target_cfg = SimpleNamespace(num_hidden_layers=8, num_key_value_heads=2, head_dim=64, hidden_size=256,
                                 num_attention_heads=4)
    drafter_cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, head_dim=64, hidden_size=256,
                                  num_attention_heads=4)
    session = SimpleNamespace(
        target=SimpleNamespace(config=target_cfg, dtype=torch.bfloat16,
                               layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                               + ["full_attention"]),
        proposer=SimpleNamespace(drafter=SimpleNamespace(config=drafter_cfg)))
    # K and V, (2 target attention layers + 1 drafter layer) x 2 heads x 64 dims, 2 bytes, 1000 positions
    assert Session._static_bytes(session, 1000) == 2 * (2 + 1) * 2 * 64 * 2 * 1000
    session.target.layer_types = ["full_attention"] * 8
    assert Session._static_bytes(session, 1000) == 2 * (8 + 1) * 2 * 64 * 2 * 1000
