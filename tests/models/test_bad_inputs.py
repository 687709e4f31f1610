"""Bad inputs a user makes at this stage, each ending in a clear error (or a correct rebuild), never silently.

Part of the bad-input table: ``pytest -m bad_input`` runs every stage's cases.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.bad_input


@pytest.mark.parametrize("error, one_line", [
    (KeyError("input_ids"), False), (TypeError("forward() got an unexpected keyword"), False),
    (IndexError("list index out of range"), False), (AttributeError("x"), False),
    (ValueError("data.max_length=0: must be > 0"), True), (FileNotFoundError("no such file: x"), True),
    (PermissionError("denied: /x"), True),
])
def test_cli_keeps_the_traceback_of_bugs_and_one_line_for_user_errors(error, one_line, monkeypatch):
    from models.support import run_cli

    monkeypatch.delenv("DRAFTSMITH_TRACEBACK", raising=False)

    def main():
        raise error

    if one_line:
        with pytest.raises(SystemExit, match="^error: "):
            run_cli(main)
    else:
        with pytest.raises(type(error)):
            run_cli(main)


def test_every_project_error_type_is_a_user_error():
    import inspect
    import pkgutil

    from models.support import USER_ERRORS

    found = []
    for pkg in ("models", "data", "train", "inference", "export"):
        for info in pkgutil.iter_modules(importlib.import_module(pkg).__path__):
            if info.name in ("bench", "hf_dflash") or info.name.endswith("_mlx"):
                continue
            try:
                module = importlib.import_module(f"{pkg}.{info.name}")
            except ImportError:
                continue
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if (issubclass(cls, Exception) and cls.__module__ == module.__name__
                        and not cls.__name__.startswith("_")):
                    found.append(cls)
    assert len(found) >= 10
    not_user = [f"{cls.__module__}.{cls.__qualname__}" for cls in found if not issubclass(cls, USER_ERRORS)]
    assert not not_user, f"project error types the CLI would show as bugs: {not_user}"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_compiling_a_target_twice_changes_nothing(arch):
    """A second ``compile_layers`` wrapped the compiled wrappers again: compiles of compiled code, and a
    fall-back that called the first wrapper."""
    from models.target import TargetModel
    from models.tiny import tiny_target

    target = TargetModel(tiny_target(arch)).compile_layers(backend="eager")  # lazy: nothing compiles until a call
    forwards = [layer.forward for layer in target.layers]
    joined = [m.in_proj_joined for _, m in target.linear_attention_modules()]
    assert target.compile_layers(backend="eager") is target
    assert [layer.forward for layer in target.layers] == forwards
    again = [m.in_proj_joined for _, m in target.linear_attention_modules()]
    assert len(again) == len(joined) and all(a is b for a, b in zip(again, joined))  # the same buffers
    assert (len(joined) > 0) == target.is_hybrid


@pytest.mark.parametrize("key, value", [("num_attention_heads", 0), ("head_dim", 0), ("num_key_value_heads", 0),
                                        ("intermediate_size", 0), ("rope_theta", 0), ("rms_norm_eps", 0),
                                        ("target_layer_ids", []), ("max_position_embeddings", 0)])
def test_drafter_shape_zero_from_code_is_refused_not_replaced_by_the_targets(key, value):
    """DFlashConfig.for_target read 0 (and []) as "not given": a caller's num_attention_heads=0 silently became
    the target's. rms_norm_eps 0 and max_position_embeddings 0 were accepted outright."""
    from models.config import DFlashConfig
    from models.config_keys import ConfigError
    from models.target_shape import TargetShape
    from models.tiny import tiny_target

    target = TargetShape.from_config(tiny_target("qwen3").config)
    for shape, facts in ((target, {}), (None, {"hidden_size": 64, "vocab_size": 300, "num_target_layers": 4})):
        with pytest.raises(ConfigError, match=f"^{key}="):
            DFlashConfig.for_target(shape, mask_token_id=1, num_taps=1, **facts, **{key: value})
        DFlashConfig.for_target(shape, mask_token_id=1, num_taps=1, **facts)  # not given: the target's (or default)
    # explicit taps on a target too shallow for the default 5: the default is not computed (and refused)
    assert DFlashConfig.for_target(target, mask_token_id=1, target_layer_ids=[1]).target_layer_ids == [1]
    # a target shape that does not say (None): the defaults, not a refusal
    unsaid = TargetShape(hidden_size=64, vocab_size=300, num_layers=8, num_attention_heads=4, rms_norm_eps=None,
                         max_position_embeddings=None)
    config = DFlashConfig.for_target(unsaid, mask_token_id=1, num_taps=2)
    assert (config.rms_norm_eps, config.max_position_embeddings) == (1e-6, 40960)


@pytest.mark.parametrize("edit, problem", [
    ({"block_size": 16.5}, "block_size=16.5: must be a whole number"),  # was cut to 16 without a word
    ({"dflash_config": {"target_layer_ids": [1, 8.5, 17]}}, "target_layer_ids=8.5: must be a whole number"),
    ({"mask_token_id": True, "dflash_config": {"mask_token_id": True}}, "mask_token_id=True: must be a whole number"),
    # runtimes that read is_causal make full-attention layers causal too; without sliding layers it was
    # accepted and the drafter run bidirectionally, drafting other tokens than those runtimes
    ({"is_causal": True}, "is_causal=True: makes every layer causal inside the block"),
])
def test_a_drafter_config_with_a_fractional_number_or_is_causal_true_is_refused(edit, problem):
    import copy

    from models.config import DFlashConfig
    from models.config_keys import ConfigError

    d = json.loads((Path(__file__).parents[1] / "fixtures" / "config_flat.json").read_text())
    assert "sliding_attention" not in (d.get("layer_types") or [])
    edited = copy.deepcopy(d)
    for key, value in edit.items():
        if isinstance(value, dict):
            edited[key] = {**edited[key], **value}
        else:
            edited[key] = value
    with pytest.raises(ConfigError, match=re.escape(problem)):
        DFlashConfig.from_dict(edited)
    assert DFlashConfig.from_dict({**d, "block_size": 16.0, "is_causal": False}).block_size == 16  # 16.0 is 16


@pytest.mark.parametrize("mask_id, problem", [
    (264, "'<|eot_id|>', eos token"),  # EOS
    (256, "'<|endoftext|>', pad token"),  # pad
    (261, "'<|begin_of_text|>', a chat-control token"),  # BOS, written by the chat template
    (262, "'<|start_header_id|>', a chat-control token"),
    (39, "the ordinary text token 'H'"),  # a byte of text
    (0, "the ordinary text token '!'"),  # the first row is inside the embedding
    (72, "'i', produced by the chat template"),  # a byte the rendered template writes ("assistant")
    (288, "outside the target embedding (288 rows)"),
    (-1, "outside the target embedding"),
])
def test_explicit_mask_token_that_the_target_produces_is_refused(mask_id, problem):
    from models.config_keys import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    with pytest.raises(ConfigError, match="mask_token_id") as e:
        resolve_mask_token(288, tiny_tokenizer("llama3", reserved=23), explicit=mask_id)
    assert problem in str(e.value) and "Fix:" in str(e.value)


def test_mask_token_present_in_the_data_is_refused():
    from models.config_keys import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3", reserved=23)
    with pytest.raises(ConfigError, match="present in the training data"):
        resolve_mask_token(288, tok, explicit=265, produced_ids={10, 265})
    # The automatic choice skips it and takes the next reserved token.
    assert resolve_mask_token(288, tok, produced_ids={265}).id == 266


def test_a_bos_the_chat_template_never_writes_is_still_not_the_mask():
    # The tiny tokenizers' BOS is also a template token, so only that rule was ever exercised.
    from models.config_keys import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3", reserved=23)
    tok.bos_token = "<|reserved_special_token_0|>"  # id 265: a spare special, nowhere in the template
    assert tok.bos_token_id == 265
    with pytest.raises(ConfigError, match="bos token"):
        resolve_mask_token(288, tok, explicit=265)
    assert resolve_mask_token(288, tok).id == 266  # the automatic choice passes over it


def test_an_added_token_that_is_not_special_is_never_the_mask():
    """A token added as ordinary text, even one named like a reserved token, is text the tokenizer writes: no
    automatic choice takes it and giving it explicitly is refused."""
    from models.config_keys import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3")
    tok.add_tokens(["<|reserved_text|>"])  # 265, not special, the last row
    with pytest.raises(ConfigError, match="no reserved special token"):
        resolve_mask_token(len(tok), tok)
    with pytest.raises(ConfigError, match=re.escape("is the ordinary text token '<|reserved_text|>'")):
        resolve_mask_token(len(tok), tok, explicit=265)


def test_no_spare_row_and_no_reserved_token_is_a_clear_error():
    from models.config_keys import ConfigError
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3")  # 265 tokens, every one a byte, a template token or EOS/pad
    with pytest.raises(ConfigError, match="set drafter.mask_token_id to a special token your chat template never"):
        resolve_mask_token(len(tok), tok)


def test_a_checkpoints_state_folder_as_drafter_names_the_drafter_beside_it(tmp_path):
    """--draft checkpoints/step_N/state (the optimizer state) gave no hint; its drafter is step_N/drafter."""
    from models.drafter import DFlashDraftModel

    step = tmp_path / "checkpoints" / "step_8"
    (step / "state").mkdir(parents=True)
    (step / "drafter").mkdir()
    (step / "drafter" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="pass .*step_8/drafter\\)"):
        DFlashDraftModel.from_pretrained(step / "state")


def test_a_drafter_folder_with_an_extra_tensor_names_it(tmp_path, export_drafter):
    """A tensor the config does not account for (a layer more than num_hidden_layers) is named, not loaded
    around or reported as a bare state-dict error."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from models.drafter import DFlashDraftModel

    folder = Path(shutil.copytree(export_drafter, tmp_path / "d"))
    state = load_file(str(folder / "model.safetensors"))
    state["layers.1.mlp.up_proj.weight"] = torch.zeros(64, 32)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['layers.1.mlp.up_proj.weight'\].*"
                                         "fix config.json \\(num_hidden_layers"):
        DFlashDraftModel.from_pretrained(folder)


def test_a_drafter_bound_to_a_smaller_vocabulary_or_fed_narrower_features_is_refused(export_drafter):
    """Both come from pairing the drafter with another target; a smaller embedding or narrower features
    failed deep inside a matmul (or drafted ids the target does not have)."""
    import torch

    from models.drafter import DFlashDraftModel

    drafter = DFlashDraftModel.from_pretrained(export_drafter)
    with pytest.raises(ValueError, match="target embedding has 299 rows but the drafter's vocab_size is 300"):
        drafter.bind_target(torch.nn.Embedding(299, 32), torch.nn.Linear(32, 299, bias=False))
    drafter.bind_target(torch.nn.Embedding(300, 32), torch.nn.Linear(32, 300, bias=False))
    for width in (64, 128):
        with pytest.raises(ValueError, match=f"target_hidden has width {width}, expected taps x hidden = 3 x 32"):
            drafter(torch.zeros(1, 4, 32), torch.zeros(1, 2, width), torch.arange(6)[None])


def test_an_mlx_drafter_fed_features_of_another_width_is_refused(export_drafter):
    mx = pytest.importorskip("mlx.core")
    from models.drafter_mlx import DFlashDraftModel

    drafter = DFlashDraftModel.from_pretrained(export_drafter)
    for width in (64, 128):
        with pytest.raises(ValueError, match=f"target_hidden has width {width}, expected taps x hidden = 3 x 32"):
            drafter(mx.zeros((1, 4, 32)), mx.zeros((1, 2, width)), mx.arange(6)[None])


@pytest.fixture(scope="module")
def mlx_q4_folder(tmp_path_factory):
    """A tiny Qwen3 target and its MLX 4-bit (group 32) folder, written by mlx_lm's own functions."""
    pytest.importorskip("mlx_lm")
    from models.quantize import quantize_to_mlx
    from models.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("bad_quant")
    src = save_tiny_target(root / "hf", arch="qwen3", num_layers=2)
    return src, quantize_to_mlx(src, root / "q4", bits=4, group_size=32, log=lambda *_: None)


def test_a_target_retrained_in_place_is_quantized_again(tmp_path):
    """The quantized folder's cache key was the target's path, config and the settings: a target retrained or
    fine-tuned in place (same path, same config.json) trained against its old weights, quantized."""
    pytest.importorskip("mlx_lm")
    from safetensors.torch import load_file

    from models.quantize import quantize_to_mlx
    from models.tiny import save_tiny_target

    said = []
    src = save_tiny_target(tmp_path / "hf", arch="qwen3", num_layers=2, seed=0)
    first = load_file(str(quantize_to_mlx(src, tmp_path / "q4", bits=4, group_size=32, log=said.append)
                          / "model.safetensors"))
    assert quantize_to_mlx(src, tmp_path / "q4", bits=4, group_size=32, log=said.append) == tmp_path / "q4"
    cached = len(said)  # the same weights: reused, nothing logged
    save_tiny_target(tmp_path / "hf", arch="qwen3", num_layers=2, seed=1)  # the same config, other weights
    again = load_file(str(quantize_to_mlx(src, tmp_path / "q4", bits=4, group_size=32, log=said.append)
                          / "model.safetensors"))
    assert len(said) > cached
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not (first[name] == again[name]).all()


def _copy_with(folder, dst, drop=(), config_update=None):
    """A copy of an MLX folder with some tensors dropped and the config changed."""
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


def test_mlx_prefix_without_a_path_is_refused():
    from models.quantization import QuantizationError, parse_quantization

    with pytest.raises(QuantizationError, match="needs a folder or Hub id after 'mlx:'"):
        parse_quantization("mlx:")


def test_group_size_not_dividing_the_hidden_size_is_refused(mlx_q4_folder, tmp_path):
    from models.quantization import QuantizationError
    from models.quantize import quantize_to_mlx
    from models.tiny import save_tiny_target

    with pytest.raises(QuantizationError, match="group size 128 does not divide the target's hidden size 64.*"
                                                "use group size \\[32, 64\\]"):
        quantize_to_mlx(mlx_q4_folder[0], tmp_path / "q", bits=4, group_size=128)
    # A vision-language config keeps the text tower's hidden size under text_config.
    nested = save_tiny_target(tmp_path / "vl", arch="qwen3_5_vl", num_layers=2)
    with pytest.raises(QuantizationError, match="group size 128 does not divide the target's hidden size 64"):
        quantize_to_mlx(nested, tmp_path / "q", bits=4, group_size=128)
    assert not (tmp_path / "q").exists()


def test_quantizing_to_a_width_or_family_mlx_lm_cannot_take_is_refused_before_it_loads(mlx_q4_folder, tmp_path):
    """A direct call (python API, the quantization experiment) is checked as target.quantization is: a width MLX
    does not pack, or a model family draftsmith does not train for, is named before mlx_lm reads the weights."""
    import shutil

    from models.quantization import QuantizationError
    from models.quantize import quantize_to_mlx
    from models.target import UnsupportedTarget

    with pytest.raises(QuantizationError, match="7 bits is not an MLX affine width; use one of \\[2, 3, 4, 5, 6, 8\\]"):
        quantize_to_mlx(mlx_q4_folder[0], tmp_path / "q", bits=7, group_size=32)
    other = shutil.copytree(mlx_q4_folder[0], tmp_path / "gpt2")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedTarget, match="not supported yet: gpt2"):
        quantize_to_mlx(other, tmp_path / "q", bits=4, group_size=32)
    assert not (tmp_path / "q").exists()


def test_missing_scales_is_refused(mlx_q4_folder, tmp_path):
    from models.quantization import QuantizationError
    from models.target import load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", drop=("model.layers.0.mlp.up_proj.scales",))
    with pytest.raises(QuantizationError, match="up_proj.weight is packed .* but model.layers.0.mlp.up_proj.scales "
                                                "is missing"):
        load_mlx_target(bad)


def test_missing_biases_is_refused(mlx_q4_folder, tmp_path):
    from models.quantization import QuantizationError
    from models.target import load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", drop=("model.layers.1.self_attn.o_proj.biases",))
    with pytest.raises(QuantizationError, match="o_proj: has .scales but no .biases"):
        load_mlx_target(bad)


def test_config_bits_that_do_not_match_the_weights_are_refused(mlx_q4_folder, tmp_path):
    from models.quantization import QuantizationError
    from models.target import load_mlx_target

    bad = _copy_with(mlx_q4_folder[1], tmp_path / "bad", config_update={"bits": 8})
    with pytest.raises(QuantizationError, match="do not fit 8 bits at group size 32.*does not match the weights"):
        load_mlx_target(bad)


def test_dequantize_refuses_scales_and_biases_of_other_shapes():
    """Biases with fewer groups than the scales must not broadcast (every group would get the first bias); nor may
    one row's groups, read at the wrong group size, spread over the rows."""
    import torch

    from models.dequantize import dequantize
    from models.quantization import QuantizationError

    packed, scales, biases = torch.zeros(4, 8, dtype=torch.uint32), torch.ones(4, 2), torch.zeros(4, 2)
    assert dequantize(packed, scales, biases, 32, 4).shape == (4, 64)  # 4 rows of 64 4-bit values
    for s, b in ((scales, torch.zeros(4, 1)), (torch.ones(3, 2), torch.zeros(3, 2))):
        with pytest.raises(QuantizationError, match="wrong bits \\(4\\) or group size"):
            dequantize(packed, s, b, 32, 4)
    # One row of 64 4-bit values with one scale: group 64, not 32 (its 64 values would read as two rows of 32).
    assert dequantize(packed[:1], scales[:1, :1], biases[:1, :1], 64, 4).shape == (1, 64)
    with pytest.raises(QuantizationError, match="holds 64 values per row, but scales \\(1, 1\\) .* expect 32"):
        dequantize(packed[:1], scales[:1, :1], biases[:1, :1], 32, 4)


def test_scales_without_their_weight_are_refused():
    import torch

    from models.dequantize import dequantize_weights
    from models.quantization import QuantizationError

    weights = {"a.weight": torch.ones(2, 2), "b.scales": torch.ones(2, 1), "b.biases": torch.zeros(2, 1)}
    with pytest.raises(QuantizationError, match="b.scales has no matching .weight"):
        dequantize_weights(weights, {"quantization": {"bits": 4, "group_size": 32}}, torch.float32)


def test_mlx_path_that_is_not_quantized_is_refused(mlx_q4_folder, tmp_path):

    from models.quantization import QuantizationError
    from models.quantize import resolve_target
    from models.target import load_mlx_target

    with pytest.raises(QuantizationError, match="has no MLX 'quantization' in its config.json"):
        resolve_target(str(mlx_q4_folder[0]), f"mlx:{mlx_q4_folder[0]}", tmp_path)
    with pytest.raises(QuantizationError, match="has no MLX 'quantization: {bits, group_size}'.*not an MLX affine"):
        load_mlx_target(mlx_q4_folder[0])  # never loaded as if quantized, named "mlx-Nonebit-gNone"
    partial = _copy_with(mlx_q4_folder[1], tmp_path / "partial")
    config = json.loads((partial / "config.json").read_text())
    del config["quantization"]["bits"]
    (partial / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="has no MLX 'quantization: {bits, group_size}'"):
        load_mlx_target(partial)


def test_an_mlx_checkpoint_that_does_not_fit_the_model_names_the_tensors(mlx_q4_folder):
    """A tensor missing, left over or of another shape is named with the model's own names (not the bare
    load_state_dict error, nor a model with a tensor of the wrong size)."""

    import torch

    from models.dequantize import build_hf_model, dequantize_weights, read_safetensors, to_hf_state_dict
    from models.quantization import QuantizationError

    folder = mlx_q4_folder[1]
    config = json.loads((folder / "config.json").read_text())
    state = to_hf_state_dict(dequantize_weights(read_safetensors(folder), config, torch.float32), "qwen3")
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(QuantizationError, match="does not map onto Qwen3ForCausalLM: missing \\['model.norm.weight"):
        build_hf_model(config, missing, torch.float32)
    extra = {**state, "model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}
    with pytest.raises(QuantizationError, match="missing \\[\\], unexpected \\['model.layers.2.mlp.up_proj.weight"):
        build_hf_model(config, extra, torch.float32)
    with pytest.raises(QuantizationError, match="^model.norm.weight: checkpoint shape \\(32,\\) != model shape "
                                                "\\(64,\\)"):
        build_hf_model(config, {**state, "model.norm.weight": torch.ones(32)}, torch.float32)


def test_quantizing_into_a_foreign_folder_is_refused(mlx_q4_folder, tmp_path):
    from models.quantization import QuantizationError
    from models.quantize import quantize_to_mlx

    (tmp_path / "mine.txt").write_text("not yours")
    with pytest.raises(QuantizationError, match="was not written by draftsmith's quantizer"):
        quantize_to_mlx(mlx_q4_folder[0], tmp_path, bits=4, group_size=32)
    (tmp_path / "empty").mkdir()  # an empty folder made beforehand is not foreign
    assert quantize_to_mlx(mlx_q4_folder[0], tmp_path / "empty", bits=4, group_size=32, log=lambda *_: None) == \
        tmp_path / "empty"


def test_bnb_without_bitsandbytes_says_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    from models.quantization import QuantizationError
    from models.quantize import resolve_target
    from models.target import transformers_quantization_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(QuantizationError, match="bnb-4bit needs bitsandbytes: pip install bitsandbytes"):
        transformers_quantization_config("bnb-4bit")
    with pytest.raises(QuantizationError, match="bnb-4bit needs bitsandbytes"):  # resolved before any weight loads
        resolve_target("Qwen/Qwen3-8B", "bnb-4bit", tmp_path)


def test_fp8_without_cuda_says_so(monkeypatch):
    import torch

    from models.quantization import QuantizationError
    from models.target import transformers_quantization_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QuantizationError, match="fp8 needs a CUDA GPU.*use mlx-8bit"):
        transformers_quantization_config("fp8")


@pytest.mark.parametrize("placement, ok", [
    ({"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": "cpu"}, False),  # offloaded beside GPUs
    ({"model.embed_tokens": "disk", "model.layers.0": 0, "lm_head": 0}, False),
    ({"model": 0, "lm_head": "disk"}, False),
    ({"model.embed_tokens": 0, "model.layers.0": "disk", "lm_head": 0}, True),  # a layer offloaded: slow, correct
    ({"model.embed_tokens": "cpu", "model.layers.0": "cpu", "lm_head": "cpu"}, True),  # a CPU-only run
])
def test_device_map_that_offloads_the_embedding_or_lm_head(placement, ok):
    """The drafter borrows the embedding and LM head weights: offloaded, they are empty placeholders."""
    from types import SimpleNamespace

    from models.target import check_borrowed_parts_resident

    model = SimpleNamespace(hf_device_map=placement)
    if ok:
        check_borrowed_parts_resident(model)
    else:
        with pytest.raises(ValueError, match="must stay in device memory .* Raise max_memory for the first GPU"):
            check_borrowed_parts_resident(model)


def test_max_memory_that_is_not_device_size_pairs():
    from models.target import parse_max_memory

    assert parse_max_memory("0=70GiB,1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}
    with pytest.raises(ValueError, match="write DEVICE=SIZE pairs separated by commas"):
        parse_max_memory("70GiB")
    with pytest.raises(ValueError, match="device 'gpu0' is not a GPU index, 'cpu' or 'disk'"):
        parse_max_memory("gpu0=70GiB")


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_map="everywhere"), "device_map 'everywhere': use one of auto, balanced"),
    (dict(device_map="auto", device="cpu"), "give either device .* or device_map"),
    (dict(max_memory="0=70GiB"), "max_memory needs device_map"),
])
def test_device_map_mistakes_before_any_weights_load(tmp_path, kwargs, message):
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=4)
    with pytest.raises(ValueError, match=message):
        TargetModel.from_pretrained(folder, **kwargs)


def test_embedding_and_head_only_from_an_incomplete_checkpoint(tmp_path):
    """Offline training reads only the embedding and LM head: shards without them (an interrupted
    download), or no safetensors at all, are named, never loaded as meta or random weights."""
    from safetensors.torch import load_file, save_file

    from models.target import TargetModel
    from models.tiny import save_tiny_target

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    shard = folder / "model.safetensors"
    tensors = load_file(str(shard))
    save_file({k: v for k, v in tensors.items() if "embed_tokens" not in k}, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor named model.embed_tokens.weight.*incomplete download"):
        TargetModel.borrowed_parts(folder)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        TargetModel.borrowed_parts(folder)


def test_embedding_and_head_from_a_broken_sharded_checkpoint_or_an_unreachable_hub(tmp_path, monkeypatch):
    """A shard index that is truncated, or that names a shard not on disk, is named with the fix; a Hub
    target whose weight spans cannot be read (no network) says so, never fingerprints it from less."""
    from data.store import target_identity
    from models.target import TargetModel
    from models.tiny import save_tiny_target
    from tests.helpers.fake_hub import FakeHub

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2, max_shard_size="60KB")
    index = folder / "model.safetensors.index.json"
    weight_map = __import__("json").loads(index.read_text())["weight_map"]
    (folder / weight_map["lm_head.weight"]).unlink()
    with pytest.raises(FileNotFoundError, match=f"{weight_map['lm_head.weight']} \\(named in .*index.json for "
                                                "lm_head.weight\\) is missing: an incomplete download"):
        TargetModel.borrowed_parts(folder)
    # A local folder is never fetched into: the whole load names the missing shard too, not a Hub download.
    with pytest.raises(FileNotFoundError, match=f"{weight_map['lm_head.weight']} is listed in .*index.json but "
                                                "missing: the download or export is incomplete"):
        TargetModel.from_pretrained(folder)
    index.write_text(index.read_text()[:40])
    with pytest.raises(ValueError, match="index.json is not a safetensors shard index .*truncated download"):
        TargetModel.borrowed_parts(folder)

    hub = FakeHub(tmp_path / "cache", monkeypatch)
    hub.add("org/t", save_tiny_target(tmp_path / "remote", "qwen3", num_layers=2, max_shard_size="60KB"))

    class Offline:
        def ls(self, *a, **kw):
            raise ConnectionError("no route to host")

    monkeypatch.setattr("huggingface_hub.HfFileSystem", Offline)
    with pytest.raises(OSError, match="could not read the weight files of 'org/t' .*to fingerprint the target "
                                      ".*ConnectionError: no route to host.*hf download org/t"):
        target_identity("org/t")
    with pytest.raises(FileNotFoundError, match="target 'no/such/folder' is neither a local folder nor a Hub id"):
        target_identity("no/such/folder")  # never the fingerprint of nothing
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="target '.*empty': .*empty has no config.json, so it is not a model "
                                                "folder: give the target model's folder or its Hub id"):
        target_identity(str(tmp_path / "empty"))
    # Offline with only the small files cached: the shards to read are named, with the command that fetches them.
    hub.offline = True
    with pytest.raises(OSError, match=r"target 'org/t': \['model-0000\d-of-0000\d\.safetensors'.*\] not in the "
                                      r"local snapshot .* \(HF_HUB_OFFLINE=1\?, or not in the repo\): download "
                                      r"them \(hf download org/t "):
        TargetModel.borrowed_parts("org/t")


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_truncated_or_garbled_target_shard_is_named_by_every_loader(tmp_path, damage):
    """A target cut short by a copy or download ended in a safetensors / mlx_lm traceback (the drafter's
    own loader already named the file)."""
    import importlib.util

    from models.quantize import quantize_to_mlx
    from models.target import load_mlx_target
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    def spoil(path):
        data = path.read_bytes()
        path.write_bytes(data[:-1000] if damage == "truncated" else b"\xff" * 8 + data[8:])

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    loaders = [TargetModel.from_pretrained, TargetModel.borrowed_parts]
    if importlib.util.find_spec("mlx_lm") is not None:  # the CPU suite has it ([dev] extra)
        from models.target_mlx import TargetModel as MLXTarget

        loaders.append(MLXTarget.from_pretrained)
        quantized = quantize_to_mlx(folder, tmp_path / "q", bits=4, group_size=32)
        spoil(quantized / "model.safetensors")
        with pytest.raises(ValueError, match="q/model.safetensors is corrupt or truncated.*re-download"):
            load_mlx_target(quantized)
    spoil(folder / "model.safetensors")
    for load in loaders:
        with pytest.raises(ValueError, match="t/model.safetensors is corrupt or truncated.*re-download"):
            load(folder)


@pytest.mark.parametrize("header, said", [
    (b"[]", "unreadable safetensors header"),  # JSON, but no table of tensors
    (b'{"x": 1}', "unreadable safetensors header"),  # a tensor entry that is no table
    (b'{"x": {"data_offsets": []}}', "unreadable safetensors header"),  # offsets without an end
    (b"", "header length 0 in a file of 8 bytes"),
    (b"{}" + b" " * 28, "header length 30 in a file of 36 bytes"),  # cut inside the header
])
def test_a_garbled_safetensors_header_is_named_as_such(tmp_path, header, said):
    """Every way a header can be wrong ends in the same named error, never a KeyError / TypeError
    traceback; a header length past the end of the file says both sizes. ``load_state_dict`` (no
    up-front check) names a truncated file too."""
    from safetensors.torch import save_file

    from models.weights import check_complete, load_state_dict

    path = tmp_path / "model.safetensors"
    data = len(header).to_bytes(8, "little") + header
    path.write_bytes(data[:36] if len(header) == 30 else data)
    with pytest.raises(ValueError, match=f"model.safetensors is corrupt or truncated \\(.*{re.escape(said)}"):
        check_complete(path)
    save_file({"x": torch.ones(64)}, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="model.safetensors is corrupt or truncated .*re-download"):
        load_state_dict(tmp_path)


def test_a_missing_relative_folder_that_looks_like_a_hub_id_says_both(tmp_path, monkeypatch):
    """``runs/small-target`` (recipe=small before lab.small_target built it) is also an org/name id:
    the error names the Hub failure in one line and the local folder that is not there."""
    from models.hub import resolve_model_dir

    def offline(repo_id, **_):
        raise RuntimeError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened ...")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError) as e:
        resolve_model_dir("runs/small-target", what="target")
    message = str(e.value)
    assert "\n" not in message and "Name or service not known)" in message
    assert f"there is no local folder {tmp_path / 'runs' / 'small-target'}" in message and "build it first" in message


def test_a_file_given_for_a_model_folder_is_named(tmp_path, monkeypatch):
    """``--target runs/t/model.safetensors`` (or its config.json) names the folder to pass instead, also when the
    file's path looks like an org/name Hub id."""
    from models.hub import resolve_model_dir

    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("the Hub was asked"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    for given in ("t/config.json", str(tmp_path / "t" / "config.json")):
        with pytest.raises(NotADirectoryError, match=f"target {re.escape(repr(given))} is a file; pass the folder "
                                                     "that holds config.json"):
            resolve_model_dir(given, what="target")


@pytest.mark.parametrize("given", ["./small-target", "../small-target", "/small-target", "-org/name", ".hidden/name"])
def test_a_missing_path_that_cannot_be_a_hub_id_is_named_without_asking_the_hub(tmp_path, monkeypatch, given):
    """A Hub id starts with a letter or digit: ``./small-target`` (or an absolute path) that is not there is a
    missing folder, said at once, not a repo to look up (retries, then a network error that hides the typo)."""
    from models.hub import is_hub_id, resolve_model_dir

    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("the Hub was asked"))
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id(given)
    with pytest.raises(FileNotFoundError, match=f"target {re.escape(repr(given))} is neither a local folder nor a "
                                                "Hub id of the form org/name"):
        resolve_model_dir(given, what="target")


def test_forward_of_a_target_loaded_without_its_layers():
    from models.target import TargetModel
    from models.tiny import tiny_target

    target = TargetModel(tiny_target("qwen3", num_layers=2))
    target.has_layers = False
    with pytest.raises(RuntimeError, match="without its decoder layers.*python -m data.prepare"):
        target.forward(__import__("torch").tensor([[1, 2]]), [0])


def test_help_into_a_closed_pipe_ends_quietly():
    # `python -m train.distill --help | head -3`: the reader leaves first. It printed "error: [Errno 32]
    # Broken pipe", as if the command had failed on the user's input.
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write fails, every time
    try:
        done = subprocess.run([sys.executable, "-m", "train.distill", "--help"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 1  # what Python's own docs advise on EPIPE: not 0, the output was cut
    read, write = os.pipe()  # the same for the draftsmith command's own help
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "models.support", "--help"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.stderr, done.returncode) == ("", 1)

    from models.support import run_cli

    def server_went_away():  # a broken pipe that is not our output's (a regeneration server's socket)
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(SystemExit, match=r"^error: \[Errno 32\] Broken pipe"):
        run_cli(server_went_away)


def test_a_lock_file_goes_with_a_failed_run_only_when_that_run_made_it(tmp_path):
    """A refusal of someone else's folder left the command's lock file in it; a lock file already there (a killed
    run's) stays, and so does the one of a run that ended well (its folder is its output)."""
    from models.support import hold

    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError), hold(folder, ".x.lock", "--out", "-"):
        raise RuntimeError("not a folder of ours")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    (folder / ".x.lock").write_text("123\n")  # a killed run's
    with pytest.raises(RuntimeError), hold(folder, ".x.lock", "--out", "-"):
        raise RuntimeError
    assert (folder / ".x.lock").is_file()
    with hold(tmp_path / "new", ".x.lock", "--out", "-") as out:
        (out / "result.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [".x.lock", "result.json"]


def test_a_killed_runs_lock_file_names_only_the_run_holding_it_now(tmp_path):
    """A lock file a killed run left holds its pid: the next holder writes over it, so a refused run names the
    holder, not "<old pid> <pid>"."""
    import os

    from models.support import hold

    (tmp_path / ".x.lock").write_text("99999999\n")
    with hold(tmp_path, ".x.lock", "--out", "-"):
        assert (tmp_path / ".x.lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(ValueError) as err, hold(tmp_path, ".x.lock", "--out", "wait"):
            pass
    assert str(err.value) == f"--out {tmp_path} is in use by another run (pid {os.getpid()}): wait"


def test_a_file_system_without_locks_runs_with_a_note(tmp_path, monkeypatch):
    """Some cluster mounts refuse flock (ENOLCK): the run goes on, saying that a second run is not kept out,
    instead of failing on an OSError."""
    import errno
    import fcntl

    from models.support import hold

    def no_locks(handle, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    notes = []
    with hold(tmp_path / "out", ".x.lock", "--out", "-", log=notes.append) as out:
        (out / "result.json").write_text("{}")
    assert len(notes) == 1 and "cannot be locked on this file system (No locks available)" in notes[0]
    assert "a second run into the same folder is not refused" in notes[0]


@pytest.mark.parametrize("setting, said", [
    ("fast", "use auto, torch, or six whole numbers M1,N1,M2,N2,STAGES,WARPS"),
    ("64,64,64,64", "six whole numbers"),
    ("64,64,64,64,2,4,1", "six whole numbers"),
    ("64,64,64,64,-2,4", "six whole numbers"),
    ("48,64,64,64,2,4", "must each be 16, 32, 64 or 128"),
    ("256,256,256,256,1,8", "must each be 16, 32, 64 or 128"),  # past the mask's 128-wide tiles
    ("64,32,64,64,2,4", "N1 must be a multiple of M1"),
    ("64,64,32,64,2,4", "M2 a multiple of N2"),
    ("64,64,64,64,0,4", "STAGES must be 1..6"),
    ("64,64,64,64,2,3", "WARPS one of 1, 2, 4, 8, 16"),
])
def test_a_bad_flex_backward_setting_says_the_accepted_forms(setting, said):
    from models.flex_options import parse_flex_backward

    with pytest.raises(ValueError, match=re.escape(said)):
        parse_flex_backward(setting)


# ----------------------------------------------------------------------------- DFlash2 drafters
@pytest.mark.parametrize("edit, problem", [
    (lambda d: d["dflash_config"].update(conv_group_size=24), "conv_group_size=24: must divide hidden_size=64"),
    (lambda d: d["dflash_config"].update(selector_top_k=300), "selector_top_k=300: is more than the 288 tokens"),
    (lambda d: d["dflash_config"].update(conv_kernel_size=9), "conv_kernel_size=9: reaches past the block (8 slots)"),
    (lambda d: d["dflash_config"].update(selector_rank=0), "selector_rank=0: must be a positive integer"),
    (lambda d: d["dflash_config"].pop("selector_rank"), "selector_rank=None: missing from config.json"),
    (lambda d: d["dflash_config"].update(output_multiplier=-1), "output_multiplier=-1: must be a positive number"),
    (lambda d: d.update(layer_types=["full_attention", "sliding_attention"]),
     "a DFlash2 drafter has sliding_attention in every layer"),
    (lambda d: d.pop("is_causal"), "is_causal=None: a DFlash2 drafter attends to its whole block"),
    (lambda d: d.update(is_causal=True), "is_causal=True: a DFlash2 drafter attends to its whole block"),
    (lambda d: d.update(sliding_window=4), "sliding_window=4: is smaller than the block (8)"),
    (lambda d: d.update(architectures=["DFlashDraftModel"]), "names DFlashDraftModel but the config has DFlash2's"),
])
def test_a_dflash2_config_with_inconsistent_shape_keys_is_refused_before_any_weight_loads(tmp_path, edit, problem):
    """Each published-layout key checked with the shape it depends on, in one line naming the key and the fix."""
    from models.config_keys import ConfigError
    from models.drafter2 import load_drafter
    from tests.helpers.dflash2 import published_folder

    folder = published_folder(tmp_path)
    d = json.loads((folder / "config.json").read_text())
    edit(d)
    (folder / "config.json").write_text(json.dumps(d))
    (folder / "model.safetensors").write_bytes(b"not read")  # refused before the weights are opened
    with pytest.raises(ConfigError, match=re.escape(problem)) as e:
        load_drafter(folder)
    assert "\n" not in str(e.value) and "Fix: " in str(e.value)


def test_dflash2_settings_on_a_v1_drafter_and_a_v2_folder_in_a_v1_loader_are_refused(tmp_path):
    from models.config_keys import ConfigError
    from models.drafter import DFlashDraftModel
    from tests.helpers.dflash2 import published_folder, tiny_dflash2_config

    with pytest.raises(ConfigError, match="selector_rank=8: is a DFlash2 setting on a variant dflash drafter"):
        tiny_dflash2_config(variant="dflash")
    with pytest.raises(ConfigError, match="variant='dflash3': unknown drafter generation"):
        tiny_dflash2_config(variant="dflash3")
    with pytest.raises(ValueError, match="is a DFlash2DraftModel drafter, which DFlashDraftModel does not build: "
                                         "load it with models.drafter2.load_drafter"):
        DFlashDraftModel.from_pretrained(published_folder(tmp_path))


def test_a_dflash2_block_that_is_not_whole_blocks_is_refused():
    from tests.helpers.dflash2 import random_dflash2, tiny_dflash2_config

    model = random_dflash2(tiny_dflash2_config())
    with pytest.raises(ValueError, match="12 block slots is not a multiple of block_size 8"):
        model(torch.zeros(1, 12, 64), torch.zeros(1, 3, 192), torch.arange(15)[None])


def test_init_from_a_dflash2_drafter_for_a_v1_run_is_refused(tmp_path):
    from models.drafter2 import new_drafter
    from tests.helpers.dflash2 import published_folder, tiny_dflash2_config

    folder = published_folder(tmp_path)
    config = tiny_dflash2_config(num_target_layers=6, target_layer_ids=[1, 2, 3], mask_token_id=265)
    config = config.as_variant("dflash")
    with pytest.raises(ValueError, match="is a DFlash2DraftModel drafter and this run trains a DFlashDraftModel: "
                                         "set drafter.variant=dflash2"):
        new_drafter(config, init_from=folder)


def test_target_layer_ids_out_of_order_are_refused_everywhere(tmp_path, export_drafter):
    """drafter.target_layer_ids=[3,1,2] passed the config and every export gate: training concatenated the features
    in config order, vLLM, SGLang and the MLX loaders in ascending order, so fc got permuted inputs in every engine.
    The ids are strictly increasing everywhere: config creation, recipe keys, a folder's config.json, export gates,
    extract --layers."""
    from data.features import check_layer_ids
    from export.check import schema_problems
    from models.config import DFlashConfig
    from models.config_keys import ConfigError
    from train.config import load_config

    ordered = "layer ids must be strictly increasing (engines concatenate the features in ascending layer order, "
    with pytest.raises(ConfigError, match=re.escape(f"target_layer_ids=[3, 1, 2]: {ordered}[1, 2, 3])")):
        DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, vocab_size=300, num_target_layers=8,
                     target_layer_ids=[3, 1, 2], mask_token_id=290)
    with pytest.raises(ValueError, match=re.escape(f"drafter.target_layer_ids=[3, 1, 2]: {ordered}")):
        load_config(["recipe=tiny", "drafter.target_layer_ids=[3,1,2]"])
    d = json.loads((export_drafter / "config.json").read_text())
    d["dflash_config"]["target_layer_ids"] = [5, 1, 3]
    (export_drafter / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=re.escape("target_layer_ids=[5, 1, 3]: " + ordered)):
        DFlashConfig.load(export_drafter)
    assert [p for p in schema_problems(d, export_drafter) if "strictly increasing" in p] == [
        f"target_layer_ids [5, 1, 3]: {ordered}[1, 3, 5])"]
    with pytest.raises(ConfigError, match="strictly increasing"):
        check_layer_ids([3, 1], 8)
    check_layer_ids([1, 3], 8)


def test_a_full_disk_is_recognised_however_the_writer_says_it(tmp_path):
    """safetensors and pyarrow say "No space left on device" in their own error types (no errno), datasets wraps
    the OSError: each becomes the one line naming the folder; other errors pass through as they are."""
    import errno
    import os

    from models.support import DiskFullError, full_disk_named, is_user_error

    class WriterError(Exception):  # e.g. safetensors' SafetensorError
        pass

    def wrapped():
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            raise RuntimeError("An error occurred while generating the dataset") from e

    for raise_it in (lambda: (_ for _ in ()).throw(WriterError('IoError(Os { code: 28, kind: StorageFull, message: '
                                                               '"No space left on device" })')), wrapped,
                     lambda: (_ for _ in ()).throw(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))):
        with pytest.raises(DiskFullError, match=f"no space left on the disk of {re.escape(str(tmp_path))} .*: free "
                                                "space there and rerun the same command: it resumes") as e:
            with full_disk_named(tmp_path, "it resumes"):
                raise_it()
        assert is_user_error(e.value)
    elsewhere = tmp_path.parent / "cache" / "x.arrow"  # a writer that names a file on another folder: that folder
    with pytest.raises(DiskFullError, match=f"disk of {re.escape(str(elsewhere.parent))}"):
        with full_disk_named(tmp_path, "it resumes"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(elsewhere))
    with pytest.raises(KeyError):
        with full_disk_named(tmp_path, "it resumes"):
            raise KeyError("x")


def test_an_mlx_target_made_from_another_model_is_refused_and_the_copy_is_recorded(mlx_q4_folder, tmp_path,
                                                                                     export_drafter):
    """target.quantization=mlx:DIR with DIR a quantized copy of another model of the same shape: training ran
    against DIR's weights without a word, while the drafter, its exports, serve commands and card named
    target.path. DIR must be a copy of target.path (config shape keys; where target.path's weights are here, its
    norms and first embedding rows), and is recorded as what the drafter was trained against."""
    import shutil

    from safetensors.torch import load_file, save_file

    from export.card import render_card
    from models.provenance import provenance_from_run
    from models.quantization import QuantizationError
    from models.quantize import resolve_target
    from models.tiny import save_tiny_target

    src, q4 = mlx_q4_folder
    said = []
    assert resolve_target(str(src), f"mlx:{q4}", tmp_path, log=said.append) == (str(q4), None)
    assert said == [f"target.quantization=mlx:{q4}: a quantized copy of target.path={src} (config and 4 weight "
                    "fingerprints checked); the drafter records it as the target it trained against"]
    refused = f"target.quantization=mlx:{q4}: {q4} is not a quantized copy of target.path="
    other = save_tiny_target(tmp_path / "other", "qwen3", num_layers=2, seed=1)  # the same shape, other weights
    with pytest.raises(QuantizationError, match=re.escape(f"{refused}{other}: its first 16 embedding rows dequantize "
                                                          "to other values (") + r".*Train against a quantized copy "
                                                          r"of .*other \(target.quantization=mlx-4bit"):
        resolve_target(str(other), f"mlx:{q4}", tmp_path)
    tuned = Path(shutil.copytree(src, tmp_path / "tuned"))  # a fine-tune that left the embedding alone
    state = load_file(str(tuned / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"] * 1.01
    save_file(state, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match=re.escape(f"{refused}{tuned}: model.norm.weight differs (max |diff|")):
        resolve_target(str(tuned), f"mlx:{q4}", tmp_path)
    deeper = save_tiny_target(tmp_path / "deeper", "qwen3", num_layers=3)
    with pytest.raises(QuantizationError, match=re.escape(f"{refused}{deeper}: num_hidden_layers 2, target.path's 3")):
        resolve_target(str(deeper), f"mlx:{q4}", tmp_path)
    config_only = tmp_path / "config-only"  # as a Hub id's small files: the config is all there is to compare
    config_only.mkdir()
    shutil.copy(src / "config.json", config_only / "config.json")
    resolve_target(str(config_only), f"mlx:{q4}", tmp_path, log=said.append)
    assert "(config (weights not compared: target.path's weights are not on this machine) checked)" in said[-1]

    prov = provenance_from_run({"target": {"path": str(src), "quantization": f"mlx:{q4}"}})
    assert prov["quantized_target"] == str(q4.resolve())
    assert prov["target_quantization"] == f"mlx:{q4.resolve()} (mlx-4bit-g32)"
    d = json.loads((export_drafter / "config.json").read_text())
    d["draftsmith"] = {"target": "Qwen/Qwen3-8B", "quantized_target": "mlx-community/Qwen3-8B-4bit",
                       "target_quantization": "mlx:mlx-community/Qwen3-8B-4bit"}
    (export_drafter / "config.json").write_text(json.dumps(d))
    card = str(render_card(export_drafter, "me/d"))
    assert "--target mlx-community/Qwen3-8B-4bit --draft me/d" in card
    assert "It was trained against `mlx-community/Qwen3-8B-4bit`, a quantized copy of the target" in card
    assert "vllm serve Qwen/Qwen3-8B" in card


@pytest.mark.parametrize("edit, problem", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_parameters.rope_type='llama3': rope type 'llama3': a drafter runs plain RoPE or YaRN"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0}},
     "a YaRN rope block needs original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
      "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}},
     "says another RoPE than rope_parameters (default)"),
    ({"final_logit_softcapping": -30.0}, "final_logit_softcapping=-30.0: must be a positive number"),
])
def test_a_drafter_rope_block_other_than_plain_or_yarn_or_a_negative_cap_is_refused(edit, problem):
    """A target's rope block copied into a drafter config: plain RoPE and YaRN (published gpt-oss drafters) run,
    anything else is named, never run as plain RoPE; a logit cap must be positive."""
    from models.config import DFlashConfig
    from models.config_keys import ConfigError

    d = json.loads((Path(__file__).parents[1] / "fixtures" / "config_flat.json").read_text())
    with pytest.raises(ConfigError, match=re.escape(problem)):
        DFlashConfig.from_dict({**d, **edit})


@pytest.mark.parametrize("model_type", ["gemma4_assistant", "gemma4_unified"])
def test_a_relative_of_a_supported_family_is_refused_by_its_model_type(tmp_path, model_type):
    """Google's own Gemma 4 MTP drafters ("assistant") and the encoder-free 12B are other architectures: named as
    not supported, before any weight loads, with the families that are."""
    from models.target import TargetModel, UnsupportedTarget

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(UnsupportedTarget, match=f"not supported yet: {model_type}\\. .*gpt-oss, Gemma 4 .*gemma4, "
                                                "gemma4_text, .*gpt_oss"):
        TargetModel.from_pretrained(tmp_path)
