"""Bad inputs a user actually makes, each ending in a clear error (or a correct rebuild), never silently.

One module so none of them regresses. Each section belongs to one part of the pipeline; a case is
a plain test function (or a parametrized table) named after the mistake it guards against.
"""

from __future__ import annotations

import pytest  # noqa: F401  (used by the sections below)

# ---------------------------------------------------------------- config, resume, data re-use (train/, data/)


# ---------------------------------------------------------------- mask token


# ---------------------------------------------------------------- generate / validate (inference/)


# ---------------------------------------------------------------- export and push (export/)


# ---------------------------------------------------------------- quantized targets
@pytest.fixture(scope="module")
def mlx_q4_folder(tmp_path_factory):
    """A tiny Qwen3 target and its MLX 4-bit (group 32) folder, written by mlx_lm's own functions."""
    pytest.importorskip("mlx_lm")
    from models.quant import quantize_to_mlx
    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("bad_quant")
    src = save_tiny_target(root / "hf", arch="qwen3", num_layers=2)
    return src, quantize_to_mlx(src, root / "q4", bits=4, group_size=32, log=lambda *_: None)


def _copy_with(folder, dst, drop=(), config_update=None):
    """A copy of an MLX folder with some tensors dropped and the config changed."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dst)
    weights = {k: v for k, v in load_file(str(dst / "model.safetensors")).items() if k not in drop}
    save_file(weights, str(dst / "model.safetensors"))
    if config_update:
        config = json.loads((dst / "config.json").read_text())
        config["quantization"].update(config_update)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("value, message", [
    ("gptq", "not a quantization draftsmith knows: use none | mlx:PATH_OR_ID"),
    ("mlx-7bit", "7 bits is not an MLX affine width"),
    ("mlx-4bit-g48", "group size 48 is not supported; use one of \\[32, 64, 128\\]"),
])
def test_bad_quantization_value_fails_at_config_time(value, message):
    from models.quant import QuantizationError
    from train.config import load_config

    with pytest.raises(QuantizationError, match=message):
        load_config(["recipe=tiny", f"target.quantization={value}"])


def test_mlx_prefix_without_a_path_is_refused():
    from models.quant import QuantizationError, parse_quantization

    with pytest.raises(QuantizationError, match="needs a folder or Hub id after 'mlx:'"):
        parse_quantization("mlx:")


def test_group_size_not_dividing_the_hidden_size_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, quantize_to_mlx

    with pytest.raises(QuantizationError, match="group size 128 does not divide the target's hidden size 64.*"
                                                "use group size \\[32, 64\\]"):
        quantize_to_mlx(mlx_q4_folder[0], tmp_path / "q", bits=4, group_size=128)


def test_missing_scales_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", drop=("model.layers.0.mlp.up_proj.scales",))
    with pytest.raises(QuantizationError, match="up_proj.weight is packed .* but model.layers.0.mlp.up_proj.scales "
                                                "is missing"):
        load_mlx_target(bad)


def test_missing_biases_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", drop=("model.layers.1.self_attn.o_proj.biases",))
    with pytest.raises(QuantizationError, match="o_proj: has .scales but no .biases"):
        load_mlx_target(bad)


def test_config_bits_that_do_not_match_the_weights_are_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", config_update={"bits": 8})
    with pytest.raises(QuantizationError, match="do not fit 8 bits at group size 32.*does not match the weights"):
        load_mlx_target(bad)


def test_mlx_path_that_is_not_quantized_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, resolve_target

    with pytest.raises(QuantizationError, match="has no MLX 'quantization' in its config.json"):
        resolve_target(str(mlx_q4_folder[0]), f"mlx:{mlx_q4_folder[0]}", tmp_path)


def test_quantizing_into_a_foreign_folder_is_refused(mlx_q4_folder, tmp_path):
    from models.quant import QuantizationError, quantize_to_mlx

    (tmp_path / "mine.txt").write_text("not yours")
    with pytest.raises(QuantizationError, match="was not written by draftsmith's quantizer"):
        quantize_to_mlx(mlx_q4_folder[0], tmp_path, bits=4, group_size=32)


def test_bnb_without_bitsandbytes_says_what_to_install(monkeypatch):
    import importlib.util

    from models.quant import QuantizationError, transformers_quantization_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(QuantizationError, match="bnb-4bit needs bitsandbytes: pip install bitsandbytes"):
        transformers_quantization_config("bnb-4bit")


def test_fp8_without_cuda_says_so(monkeypatch):
    import torch

    from models.quant import QuantizationError, transformers_quantization_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QuantizationError, match="fp8 needs a CUDA GPU.*use mlx-8bit"):
        transformers_quantization_config("fp8")



# ---------------------------------------------------------------- scale-out
