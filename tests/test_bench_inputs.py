"""Bad and edge inputs of the three benches (train.bench, data.bench, inference.bench): refused up front
in one line, before any model is built, and toy-sized runs that used to crash. No timing is checked."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

TOY_DATA = ["--hidden", "64", "--layers", "6", "--taps", "3", "--vocab", "300", "--rows", "2", "--seq", "16",
            "--batch-size", "2", "--repeats", "1", "--shard-rows", "1", "--dtypes", "bf16"]


def bench(module: str):
    return importlib.import_module(f"{module}.bench").main


def argparse_error(capsys, module: str, argv: list[str]) -> str:
    """The argparse error line (exit status 2) of ``python -m MODULE.bench ARGV``."""
    with pytest.raises(SystemExit) as e:
        bench(module)(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def no_cuda(monkeypatch):
    """As on a machine without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_build(monkeypatch):
    """Building a recipe-shaped target fails the test: refusals must come before it."""
    import data.bench

    def refuse(*a, **k):
        raise AssertionError("a random target was built")
    monkeypatch.setattr(data.bench, "recipe_target", refuse)


# ------------------------------------------------------------------ 1. static cache sized for the warm-up too
def test_static_loop_bench_with_few_new_tokens_fits_its_warm_up(capsys):
    """The warm-up generates 2 blocks: a static cache sized from --max-new-tokens 8 alone was too short."""
    bench("inference")(["--tiny", "qwen3", "--loop", "static", "--max-new-tokens", "8", "--prompts", "hi"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["bench"] for x in lines] == ["decode", "decode_parts"]
    assert lines[0]["loop"] == "static" and lines[0]["tokens"] == 8


# ------------------------------------------------------------------ 2. no model source, empty --prompts
def test_inference_bench_without_a_model_says_which_flags_to_give(capsys):
    assert "give --target and --draft, --tiny ARCH or --random-target RECIPE" in argparse_error(
        capsys, "inference", ["--loop", "eager"])


def test_inference_bench_with_an_empty_prompts_flag(capsys):
    assert "argument --prompts: expected at least one argument" in argparse_error(
        capsys, "inference", ["--tiny", "qwen3", "--prompts"])


# ------------------------------------------------------------------ 3. GPU-only combinations without CUDA
@pytest.mark.parametrize("module, argv, message", [
    ("train", ["--e2e", "qwen3-8b"],
     r"--e2e qwen3-8b builds its 8.2B-parameter target: it needs a CUDA GPU.*--e2e tiny"),
    ("inference", ["--random-target", "qwen3-8b"],
     r"--random-target qwen3-8b builds a full-size target: it needs a CUDA GPU.*--random-target tiny.*--device cpu"),
    ("train", ["--attention", "flex"], r"--attention flex needs a CUDA GPU \(flex attention has no CPU backward\)"),
])
def test_gpu_only_bench_runs_are_refused_without_cuda(no_cuda, no_build, module, argv, message):
    with pytest.raises(ValueError, match=message):
        bench(module)(argv)


def test_random_target_on_an_explicit_cpu_device_is_built(no_cuda, monkeypatch):
    """--device cpu is the user's say-so: the full-size target is built (here: the builder is reached)."""
    import inference.bench

    def reached(recipe, device):
        raise RuntimeError(f"building {recipe} on {device}")
    monkeypatch.setattr(inference.bench, "random_models", reached)
    with pytest.raises(RuntimeError, match="building qwen3-8b on cpu"):
        bench("inference")(["--random-target", "qwen3-8b", "--device", "cpu"])


# ------------------------------------------------------------------ 4. the tiny recipe, and recipes without a shape
def test_train_bench_e2e_tiny_runs_the_tiny_recipe(capsys):
    bench("train")(["--e2e", "tiny", "--steps", "1", "--warmup", "0", "--seq", "64", "--anchors", "4"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["bench"] == "train_e2e" and row["recipe"] == "tiny"
    assert (row["hidden"], row["layers"], row["block"]) == (64, 2, 8)  # the tiny target's width, tiny.yaml's drafter


def test_inference_bench_random_tiny_target(capsys):
    bench("inference")(["--random-target", "tiny", "--loop", "eager", "--max-new-tokens", "4", "--prompts", "x",
                        "--prompt-tokens", "8"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert lines[0]["bench"] == "decode" and lines[0]["tokens"] == 4 and lines[0]["prompt_tokens"] == 8


@pytest.mark.parametrize("module, flag", [("train", "--e2e"), ("inference", "--random-target")])
def test_a_recipe_without_a_target_shape_names_the_ones_that_work(no_build, module, flag):
    with pytest.raises(ValueError, match=r"recipe 'small' has no random-target shape.*'qwen3-8b'.*'tiny'"):
        bench(module)([flag, "small"])


# ------------------------------------------------------------------ 5. numeric flags out of range
@pytest.mark.parametrize("module, argv, message", [
    ("train", ["--steps", "0"], "--steps 0: use 1 or more"),
    ("train", ["--anchors", "32", "0"], "--anchors 0: use 1 or more"),
    ("train", ["--batch", "0"], "--batch 0: use 1 or more"),
    ("train", ["--vocab", "1"], "--vocab 1: use 2 or more"),
    ("train", ["--head-dim", "15"], "--head-dim 15: use an even size"),
    ("data", ["--rows", "0"], "--rows 0: use 1 or more"),
    ("data", ["--repeats", "0"], "--repeats 0: use 1 or more"),
    ("data", ["--seq", "0"], "--seq 0: use 1 or more"),
    ("data", ["--batch-size", "0"], "--batch-size 0: use 1 or more"),
    ("data", ["--hidden", "30"], "--hidden 30: use a multiple of 4 below 256"),
    ("inference", ["--tiny", "qwen3", "--repeat", "0"], "--repeat 0: use 1 or more"),
    ("inference", ["--tiny", "qwen3", "--max-new-tokens", "0"], "--max-new-tokens 0: use 1 or more"),
])
def test_numeric_flags_out_of_range_are_argparse_errors(capsys, no_build, module, argv, message):
    assert message in argparse_error(capsys, module, argv)


# ------------------------------------------------------------------ 6. --device
@pytest.mark.parametrize("module, extra", [("data", []), ("inference", ["--tiny", "qwen3"])])
def test_device_cuda_without_cuda_is_one_line(no_cuda, module, extra):
    with pytest.raises(ValueError, match="--device cuda but torch sees no CUDA device: use --device cpu"):
        bench(module)([*extra, "--device", "cuda"])


@pytest.mark.parametrize("module, extra", [("data", []), ("inference", ["--tiny", "qwen3"])])
def test_device_that_is_no_device_is_an_argparse_error(capsys, module, extra):
    assert "--device 'gpu': use cpu or cuda" in argparse_error(capsys, module, [*extra, "--device", "gpu"])


# ------------------------------------------------------------------ 7. data.bench's feature stores
def test_data_bench_removes_its_stores(tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bench("data")(TOY_DATA)
    assert "extract" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_data_bench_removes_its_stores_on_an_error(tmp_path, monkeypatch):
    import tempfile

    import data.store

    def broken(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(data.store, "FeatureStore", broken)  # after the first store is written
    with pytest.raises(KeyboardInterrupt):
        bench("data")(TOY_DATA)
    assert list(tmp_path.iterdir()) == []


def test_data_bench_keeps_its_stores_when_asked_and_says_where(tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bench("data")([*TOY_DATA, "--keep-stores"])
    (kept,) = tmp_path.iterdir()
    assert f"feature stores kept in {kept}" in capsys.readouterr().err
    assert (kept / "bf16" / "index.json").is_file()


# ------------------------------------------------------------------ 8. --dtypes
def test_data_bench_unknown_store_dtype_is_refused_before_any_forward(capsys):
    with pytest.raises(SystemExit):
        bench("data")(["--dtypes", "bf16", "fp16"])
    out, err = capsys.readouterr()
    assert out == "" and "argument --dtypes: invalid choice: 'fp16'" in err


# ------------------------------------------------------------------ 9. --loop with MLX, swapped folders
def test_inference_bench_loop_with_the_mlx_backend_is_refused(capsys):
    assert "--loop times the torch loops; the MLX backend runs its own" in argparse_error(
        capsys, "inference", ["--tiny", "qwen3", "--loop", "eager", "--backend", "mlx"])


@pytest.mark.parametrize("loop", [[], ["--loop", "eager"]])
def test_inference_bench_swapped_target_and_draft_says_swap(tmp_path, loop):
    from inference.bench import tiny_folders

    target, draft = tiny_folders("qwen3", str(tmp_path))
    with pytest.raises(ValueError, match=r"swap them \(--target .*target --draft .*draft\)"):
        bench("inference")(["--target", draft, "--draft", target, *loop])


# ------------------------------------------------------------------ 10. --help
@pytest.mark.parametrize("module, default", [
    ("train", "timed steps (default 10)"), ("data", "timed repeats; the best is reported (default 2)"),
    ("inference", "Default: --random-target times static and eager; otherwise one line per prompt through "
                  "generate's auto loop"),
])
def test_bench_help_names_the_command_and_its_defaults(capsys, module, default):
    with pytest.raises(SystemExit) as e:
        bench(module)(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m {module}.bench") and default in " ".join(text.split())
