"""`python -m inference.generate`: both backends, JSON output, baseline comparison, bad input."""

import json
import subprocess
import sys

import pytest
import torch

from inference.generate import main
from models.drafter import DFlashDraftModel
from models.target import TargetModel, load_tokenizer
from models.tiny import save_tiny_target
from tests.helpers import tiny_drafter_config


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
    assert out.out == load_tokenizer(target).decode(report["tokens"]) + "\n"  # the text, not the token ids


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
    from inference.session import Session

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
    calls.clear()
    main(argv + ["--baseline", "--max-new-tokens", "8", "--block-size", "4", "--temperature", "1", "--seed", "5"])
    # a budget under the warm-up's is not exceeded; both runs take the block size and the seed asked for
    assert [(c["max_new_tokens"], c["block_size"], c["temperature"], c["seed"]) for c in calls] == [(8, 4, 1.0, 5)] * 2


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


def test_static_loop_buffers_stop_at_the_targets_positions(folders, tmp_path, caplog, capsys):
    """--loop static --max-new-tokens 1000000000 preallocated K/V buffers for a billion positions ("DefaultCPUAllocator:
    can't allocate memory: you tried to allocate 128000065536 bytes"; a CUDA OOM on a GPU): it generates up to the
    target's max_position_embeddings, says so, and sizes the buffers for that."""
    import logging
    import shutil
    from pathlib import Path

    from inference.session import Session

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
                       "--max-new-tokens", "1000000000", "--json", "--loop", "static", "--device", "cpu",
                       "--baseline"])
    assert len(report["tokens"]) == 36 or report["stop_reason"] == "eos"
    assert report["matches_baseline"] is True  # the baseline stops at the positions too
    assert "warning: the 4-token prompt" not in capsys.readouterr().err  # the eager loop's note: not this loop's
    assert max(sizes) <= 4096
    assert ("--max-new-tokens 1000000000 with a 4-token prompt runs past the target's 40 positions "
            "(max_position_embeddings): the static loop preallocates its caches, so it generates at most 36 new "
            "tokens (about ") in caplog.text and "--loop eager generates past" in caplog.text


def test_static_buffer_estimate_counts_only_the_layers_with_a_kv_cache():
    """The estimate in the positions warning counted Qwen3.5's GatedDeltaNet layers (fixed-size state) as
    attention layers: 4x the K/V bytes of a 3:1 hybrid."""
    from types import SimpleNamespace

    import torch

    from inference.session import Session

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
    target_cfg.hidden_size = 512  # head_dim 64 as the config says, not hidden_size / heads = 128
    session.target.dtype = torch.float32  # 4 bytes an entry
    assert Session._static_bytes(session, 1000) == 2 * (8 + 1) * 2 * 64 * 4 * 1000
    target_cfg.head_dim = None  # a config without head_dim: hidden_size / heads
    assert Session._static_bytes(session, 1000) == 2 * (8 * 128 + 64) * 2 * 4 * 1000


def test_flags_left_out_take_the_documented_defaults():
    from inference.generate import parse_args

    args = parse_args(["--target", "t", "--draft", "d", "--prompt-ids", "1"])
    assert (args.backend, args.loop, args.max_new_tokens, args.temperature, args.seed, args.block_size) == (
        "auto", "auto", 256, 0.0, 0, None)
    edge = parse_args(["--target", "t", "--draft", "d", "--prompt-ids", "1", "--max-new-tokens", "1", "--seed",
                       str(2**64 - 1)])
    assert (edge.max_new_tokens, edge.seed) == (1, 2**64 - 1)  # the smallest budget and the largest seed pass


@pytest.mark.parametrize("system, machine, mlx_installed, picked", [
    ("Darwin", "arm64", True, "mlx"), ("Darwin", "arm64", False, "torch"), ("Darwin", "x86_64", True, "torch"),
    ("Linux", "arm64", True, "torch"), ("Linux", "x86_64", True, "torch")])
def test_auto_backend_is_mlx_only_on_apple_silicon_with_mlx_installed(monkeypatch, system, machine, mlx_installed,
                                                                       picked):
    import platform
    import types

    from inference.session import pick_backend

    monkeypatch.setattr(platform, "system", lambda: system)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    mlx = types.ModuleType("mlx")
    mlx.core = types.ModuleType("mlx.core")
    monkeypatch.setitem(sys.modules, "mlx", mlx)
    monkeypatch.setitem(sys.modules, "mlx.core", mlx.core if mlx_installed else None)  # None: import fails
    assert pick_backend("auto") == picked
    assert pick_backend("torch") == "torch" and pick_backend("mlx") == "mlx"  # asked for: as given


def test_prompt_ids_take_spaces_and_a_trailing_comma():
    from inference.generate import parse_prompt_ids

    assert parse_prompt_ids(" 1, 2,3, ", 288) == [1, 2, 3]
    for nothing in ("", " , "):  # nothing between the commas: empty, not "not integers"
        with pytest.raises(ValueError, match="--prompt-ids is empty"):
            parse_prompt_ids(nothing, 288)


def test_chat_prompt_follows_the_thinking_switch_and_a_plain_one_gets_the_special_tokens():
    """--thinking on / off set the template's enable_thinking; left out, the template's own default (here:
    thinking, no empty think block). A plain --prompt is tokenized with the tokenizer's special tokens."""
    from argparse import Namespace

    from inference.generate import encode_prompt
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    turn = [{"role": "user", "content": "hi"}]

    def chat(thinking):
        return encode_prompt(Namespace(prompt_ids=None, prompt="hi", chat=True, thinking=thinking, target="t"), tok)

    rendered = {flag: list(tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=True,
                                                   enable_thinking=flag)["input_ids"]) for flag in (True, False)}
    assert rendered[True] != rendered[False]
    assert chat("on") == chat(None) == rendered[True] and chat("off") == rendered[False]

    def bos_tokenizer(text, add_special_tokens):  # a Llama-style tokenizer that starts a text with BOS 261
        return {"input_ids": [261] * add_special_tokens + list(text.encode())}

    plain = encode_prompt(Namespace(prompt_ids=None, prompt="hi", chat=False, thinking=None), bos_tokenizer)
    assert plain == [261, ord("h"), ord("i")]
    with pytest.raises(SystemExit, match="the target folder has no tokenizer: pass --prompt-ids"):
        encode_prompt(Namespace(prompt_ids=None, prompt="hi", chat=False, thinking=None), None)


def _static_session(loop_kind="static"):
    """What Session's static-loop helpers read (block size 8, a 40-position target), without loading a model."""
    from types import SimpleNamespace

    return SimpleNamespace(loop_kind=loop_kind, _static=None, _static_bytes=lambda positions: 0,
                           proposer=SimpleNamespace(drafter=SimpleNamespace(config=SimpleNamespace(block_size=8))),
                           target=SimpleNamespace(max_position_embeddings=40))


def test_static_budget_caps_new_tokens_at_the_targets_positions_only_on_the_static_loop(caplog):
    import logging

    from inference.session import Session

    session = _static_session()

    def budget(prompt_len, asked):
        kw = Session._static_budget(session, [1] * prompt_len, {"max_new_tokens": asked, "seed": 3})
        assert kw["seed"] == 3
        return kw["max_new_tokens"]

    with caplog.at_level(logging.WARNING, logger="inference"):
        assert budget(4, 36) == 36 and caplog.text == ""  # fills the positions exactly: no note
        assert budget(4, 37) == 36 and "so it generates at most 36 new tokens" in caplog.text
        assert budget(45, 10) == 1  # a prompt past them already: one token, as the eager loop runs on
        session.loop_kind = "eager"  # what another block shape runs (chosen when the session is built)
        assert budget(4, 37) == 37


def test_a_baseline_run_on_its_own_is_capped_at_the_targets_positions_too():
    """validate calls Session.baseline directly (not through run, which caps the budget first)."""
    from types import SimpleNamespace

    from inference.session import Session

    session, sized = _static_session(), []
    session._static_budget = lambda *a: Session._static_budget(session, *a)
    session._static_loop = lambda prompt, max_new_tokens: sized.append(max_new_tokens)  # None: eager
    session.loop = SimpleNamespace(target_generate=lambda target, prompt, **kw: kw)
    assert Session.baseline(session, [1] * 4, max_new_tokens=10**9, seed=3) == {"max_new_tokens": 36, "seed": 3}
    assert sized == [36]


def test_static_loop_is_sized_for_the_call_and_rebuilt_only_when_a_call_needs_more(monkeypatch):
    """Buffers for prompt + new tokens + two blocks of slack, in steps of 1024 from 4096; a call that fits
    reuses them (a rebuild captures the CUDA graphs again); the compiled loop is built compiled."""
    from types import SimpleNamespace

    import inference.static_loop
    from inference.session import Session

    built = []

    def build(target, drafter, max_len, compile):
        built.append((max_len, compile))
        return SimpleNamespace(max_len=max_len), "proposer"

    monkeypatch.setattr(inference.static_loop, "build_static_loop", build)
    session = _static_session("compiled")
    loop = Session._static_loop(session, [1] * 4000, 80)  # 4000 + 80 + 2 x 8 = 4096
    assert built == [(4096, True)] and Session._static_loop(session, [1] * 4000, 80) is loop
    Session._static_loop(session, [1] * 4000, 81)  # one position more: the next step
    Session._static_loop(session, [1] * 4000, 1000)  # fits in that one
    Session._static_loop(session, [1] * 5100, 10)
    assert built == [(4096, True), (5120, True), (6144, True)]
    assert Session._static_loop(_static_session("eager"), [1], 8) is None


def test_loop_choice_for_sliding_window_drafters_compiled_and_hybrid_targets_off_the_gpu(caplog):
    import logging
    from types import SimpleNamespace

    from inference.session import choose_loop
    from inference.static_target import StaticLoopUnsupported

    def target(device, hybrid=False):
        return SimpleNamespace(device=torch.device(device), is_hybrid=hybrid, family="qwen3_5" if hybrid else "qwen3",
                               layer_types=["linear_attention", "full_attention"] if hybrid else ["full_attention"],
                               model_type="qwen3", model=SimpleNamespace(config=SimpleNamespace()))

    def drafter(sliding):
        return SimpleNamespace(config=SimpleNamespace(use_sliding_window=sliding))

    assert choose_loop("auto", target("cuda"), drafter(False)) == "static"
    assert choose_loop("compiled", target("cuda"), drafter(False)) == "compiled"
    assert choose_loop("static", target("cuda", hybrid=True), drafter(False)) == "static"  # asked for: runs
    # sliding-window drafters (every DFlash2 one) run the static loop: its pass masks the window
    assert choose_loop("auto", target("cuda"), drafter(True)) == choose_loop("static", target("cuda"), drafter(True))
    assert choose_loop("auto", target("cuda"), drafter(True)) == "static"
    with pytest.raises(StaticLoopUnsupported, match="supports full-attention and Qwen3.5 GatedDeltaNet"):
        choose_loop("static", SimpleNamespace(**{**vars(target("cuda")), "layer_types": ["sliding_attention"]}),
                    drafter(False))
    with caplog.at_level(logging.WARNING):
        assert choose_loop("auto", target("cpu", hybrid=True), drafter(False)) == "eager"
    assert caplog.text == ""  # the note about CUDA graphs is for a GPU run


def test_auto_loop_is_a_table_by_family_and_admitting_one_is_a_change_of_it(caplog, monkeypatch):
    """--loop auto on CUDA runs the loop AUTO_LOOP_ON_CUDA names for the target's family: every supported family
    has a rule with its reason, a faster loop than eager only with the measurement that admitted it; Qwen3.5 stays
    eager (saying why) until its entry changes, and then runs the admitted loop."""
    import logging
    from types import SimpleNamespace

    import inference.session
    from inference.session import AUTO_LOOP_ON_CUDA, AutoLoop, choose_loop
    from models.target import SUPPORTED

    for family in set(SUPPORTED.values()):
        rule = AUTO_LOOP_ON_CUDA[family]
        assert rule.loop in ("eager", "static", "compiled") and rule.why, family
        assert rule.loop == "eager" or rule.measured, f"{family}: {rule.loop} admitted without a measurement"
    hybrid = SimpleNamespace(device=torch.device("cuda"), is_hybrid=True, family="qwen3_5", model_type="qwen3_5",
                             layer_types=["linear_attention", "full_attention"],
                             model=SimpleNamespace(config=SimpleNamespace()))
    drafter = SimpleNamespace(config=SimpleNamespace(use_sliding_window=False, block_size=8))
    with caplog.at_level(logging.WARNING, logger="inference"):
        assert choose_loop("auto", hybrid, drafter) == "eager"
    assert "qwen3_5 target on CUDA: --loop auto runs the eager loop" in caplog.text
    assert AUTO_LOOP_ON_CUDA["qwen3_5"].why in caplog.text
    monkeypatch.setitem(inference.session.AUTO_LOOP_ON_CUDA, "qwen3_5",
                        AutoLoop("compiled", "measured", "H100, COMMIT, inference.bench ...: cycle cost 1.2"))
    monkeypatch.setattr(inference.session, "check_static_target", lambda target: None)  # a stand-in target
    assert choose_loop("auto", hybrid, drafter) == "compiled"
    assert choose_loop("auto", SimpleNamespace(**{**vars(hybrid), "family": "mamba"}), drafter) == "eager"


def test_a_block_size_other_than_the_drafters_is_decided_when_the_session_is_built(caplog):
    """The static loops are captured for the drafter's block: another block size picks the eager loop for DFlash and
    the baseline when the session is built (one warning); a static session asked for another one by a single call
    refuses it instead of falling back mid-session."""
    import logging
    from types import SimpleNamespace

    from inference.session import Session, choose_loop

    gpu = SimpleNamespace(device=torch.device("cuda"), is_hybrid=False, family="qwen3", layer_types=["full_attention"],
                          model_type="qwen3", model=SimpleNamespace(config=SimpleNamespace()))
    drafter = SimpleNamespace(config=SimpleNamespace(use_sliding_window=False, block_size=8))
    with caplog.at_level(logging.WARNING, logger="inference"):
        assert choose_loop("auto", gpu, drafter, 8) == "static" and caplog.text == ""
        assert choose_loop("compiled", gpu, drafter, 4) == "eager"
    assert ("--block-size 4 is not the drafter's 8: the compiled loop is captured for one block shape, so DFlash and "
            "the baseline both run the eager loop") in caplog.text
    session = SimpleNamespace(loop_kind="static", block_size=None, proposer=SimpleNamespace(block_size=8))
    assert Session._block_size(session, None) is None and Session._block_size(session, 8) == 8
    with pytest.raises(ValueError, match="this session runs the static loop, captured for blocks of 8; build the "
                                         "Session with block_size=4"):
        Session._block_size(session, 4)
    session.loop_kind = "eager"  # any block up to the trained one
    assert Session._block_size(session, 4) == 4


def test_report_of_gives_each_sides_speed_and_no_speedup_without_a_baseline_speed():
    from inference.report import report_of
    from inference.stats import GenerationResult

    dflash = GenerationResult(tokens=[1, 2, 3, 4, 5], acceptance_lengths=[2, 2], block_size=2, decode_s=1.0)
    base = GenerationResult(tokens=[1, 2, 3, 9], decode_s=1.5)  # 3 decoded tokens in 1.5 s
    report = report_of("torch", dflash, base)
    assert report["backend"] == "torch" and report["tokens"] == [1, 2, 3, 4, 5]
    assert report["baseline_decode_tokens_per_s"] == 2.0 and report["speedup"] == 2.0
    assert report["matches_baseline"] is False and report["first_divergence"] == 3
    assert report_of("torch", dflash, GenerationResult(tokens=[1], decode_s=0.0))["speedup"] is None  # not 0
    assert "speedup" not in report_of("torch", dflash, None)


def test_a_target_without_a_tokenizer_prints_the_token_ids(folders, tmp_path, capsys):
    """--prompt-ids on a target folder without tokenizer files: the output is the ids, not a decode error."""
    import shutil
    from pathlib import Path

    target, draft = folders
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in Path(target).iterdir():
        if not f.name.startswith("tokenizer") and f.is_file():
            shutil.copy(f, bare / f.name)
    report = main(["--backend", "torch", "--target", str(bare), "--draft", draft, "--prompt-ids", "257,72,73,198",
                   "--max-new-tokens", "4"])
    assert capsys.readouterr().out.splitlines()[0] == " ".join(map(str, report["tokens"]))


@pytest.mark.parametrize("device, dtype, expected", [(None, None, torch.bfloat16), ("cuda:0", None, torch.bfloat16),
                                                     ("cpu", None, torch.float32), ("cpu", "bf16", torch.bfloat16)])
def test_session_loads_both_models_in_bfloat16_on_cuda_float32_on_cpu_or_the_dtype_asked(monkeypatch, device, dtype,
                                                                                          expected):
    """Only what the loads are asked for: no weights load and no GPU is used."""
    from types import SimpleNamespace

    import inference.session
    import inference.torch_loop
    from inference.session import Session

    loaded = []

    def from_pretrained(path, dtype=None, device=None):
        loaded.append((path, dtype, device))
        return SimpleNamespace(tokenizer=None)

    monkeypatch.setattr(TargetModel, "from_pretrained", from_pretrained)
    monkeypatch.setattr(inference.session, "load_drafter", from_pretrained)  # either drafter generation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(inference.session, "check_device", lambda device: None)  # there is no GPU to check
    monkeypatch.setattr(inference.session, "choose_loop", lambda *a: "eager")
    monkeypatch.setattr(inference.torch_loop, "DrafterProposer", lambda drafter, target: None)
    Session("torch", "t", "d", device=device, dtype=dtype)
    on = device or "cuda"
    assert loaded == [("t", expected, on), ("d", expected, on)]


def test_no_speed_is_printed_for_a_run_that_decoded_no_token(folders, monkeypatch, capsys):
    """The first cycle drew EOS: a decode step ran (its seconds count) but gave no token, so the speed is "-",
    not 0.0 tok/s."""
    from inference.session import Session
    from inference.stats import GenerationResult

    eos_first = GenerationResult(tokens=[72], acceptance_lengths=[0], position_accepts=[0] * 7, block_size=8,
                                 decode_s=0.01, stop_reason="eos")
    monkeypatch.setattr(Session, "run", lambda self, prompt, **kw: (eos_first, None))
    target, draft = folders
    main(["--backend", "torch", "--target", target, "--draft", draft, "--prompt-ids", "257,72"])
    assert "1 tokens | tau 0.00 | decode - tok/s" in capsys.readouterr().err


# ------------------------------------------------------------------ gpt-oss and Gemma 4 (issue 46)
def published_drafter(folder, target, family: str):
    """A drafter folder shaped like z-lab's published one for the family (its config keys, tiny sizes): gpt-oss's
    carries the target's YaRN block (``rope_scaling`` beside ``rope_theta``), q/k/v/o biases (``attention_bias``),
    ``model_type: gpt_oss`` and block 8; Gemma 4's has 4 sliding
    layers + 1 full (no is_causal: causal inside the block, z-lab's convention), ``block_size`` at the top only,
    the tokenizer's own ``<mask>`` and logits soft-capped at 30. Weights: a seeded drafter of that shape."""
    from safetensors.torch import save_file

    from models.config import DFlashConfig
    from models.mask_token import resolve_mask_token

    mask = resolve_mask_token(target.vocab_size, target.tokenizer).id
    common = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "head_dim": 16,
              "hidden_act": "silu", "hidden_size": target.hidden_size, "initializer_range": 0.02,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "num_target_layers": target.num_layers, "tie_word_embeddings": False, "torch_dtype": "float32",
              "transformers_version": "4.57.1", "use_cache": True, "vocab_size": target.vocab_size}
    if family == "gpt_oss":  # model_type, biases, eps and dtype key as gpt-oss-20b-DFlash's config has them
        config = {**common, "model_type": "gpt_oss", "attention_bias": True, "block_size": 8, "num_hidden_layers": 2,
                  "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5,
                  "rope_theta": 150000, "dtype": "float32", "bos_token_id": 256, "eos_token_id": 258,
                  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                   "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
                  "dflash_config": {"mask_token_id": mask, "target_layer_ids": [1, 3, 5]}}
        del config["torch_dtype"]
    else:
        config = {**common, "block_size": 8, "num_hidden_layers": 5, "final_logit_softcapping": 30.0,
                  "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 6,
                  "max_position_embeddings": 4096, "rope_theta": 1000000.0,
                  "dflash_config": {"mask_token_id": mask, "target_layer_ids": [1, 2, 3, 4, 5, 6]}}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(5)
    state = DFlashDraftModel(DFlashConfig.load(folder)).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in ("gpt_oss", "gemma4"):
        target_dir = save_tiny_target(root / family, family)
        out[family] = (str(target_dir), str(published_drafter(root / f"{family}-DFlash",
                                                                TargetModel.from_pretrained(target_dir), family)))
    return out


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_a_drafter_shaped_like_z_labs_published_one_runs_in_generate(family_folders, family, capsys):
    """gpt-oss-20b-DFlash's and gemma-4-31B-it-DFlash's config layouts load as published: the YaRN block and the
    logit cap are read (not dropped) and applied by both drafters, the sliding layers causal inside the block;
    greedy output is the target's own on both backends (the loop decides, whatever the drafter drafts), with the
    same acceptance on both."""
    from models.config import DFlashConfig

    target, draft = family_folders[family]
    cfg = DFlashConfig.load(draft)
    if family == "gpt_oss":
        assert cfg.block_size == 8 and cfg.rope_theta == 150000 and cfg.rope_scaling["truncate"] is False
        assert cfg.attention_bias and cfg.rms_norm_eps == 1e-5
    else:
        assert cfg.final_logit_softcapping == 30.0 and cfg.sliding_block_attention == "causal"
        assert cfg.layer_types.count("sliding_attention") == 4 and cfg.rope_scaling is None
    args = ["--target", target, "--draft", draft, "--prompt-ids", "257,85,82,68,81,198,72,68,75,75,78,258,198,257",
            "--max-new-tokens", "24", "--json"]
    torch_report = main(["--backend", "torch", *args, "--baseline"])
    assert torch_report["matches_baseline"] is True and len(torch_report["tokens"]) == 24
    pytest.importorskip("mlx_lm")
    mlx_report = main(["--backend", "mlx", *args])
    capsys.readouterr()
    assert mlx_report["tokens"] == torch_report["tokens"]
    assert mlx_report["acceptance_lengths"] == torch_report["acceptance_lengths"]


def test_a_drafter_rope_engines_do_not_apply_the_same_way_is_refused_by_name(family_folders):
    """A rope block other than plain or YaRN (a target's llama3 or mrope block copied into the drafter) is one line
    naming the key, never silently run as plain RoPE."""
    from models.config import DFlashConfig
    from models.config_keys import ConfigError

    draft = family_folders["gpt_oss"][1]
    with open(f"{draft}/config.json") as f:
        config = json.load(f)
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ConfigError, match="rope_parameters.rope_type='llama3'.*plain full-head RoPE or the YaRN"):
        DFlashConfig.from_dict(config)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0}
    with pytest.raises(ConfigError, match="needs original_max_position_embeddings"):
        DFlashConfig.from_dict(config)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_a_published_layout_drafter_exports_with_its_rope_biases_and_cap(family_folders, family, tmp_path):
    """Warm-started from a published drafter, an export keeps what its weights were trained with (YaRN, biases,
    the cap) and the shipped modeling file computes the same (the export gate reloads it with AutoModel)."""
    from export.hf import export_hf

    target, draft = family_folders[family]
    summary = export_hf(draft, tmp_path / "hf", dtype="fp32", target=target, log=lambda *_: None)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    if family == "gpt_oss":
        assert written["rope_parameters"]["rope_type"] == "yarn" and written["attention_bias"] is True
    else:
        assert written["final_logit_softcapping"] == 30.0 and "is_causal" not in written
    assert summary["parity"]["transformers"]["max_abs"] < 1e-5
