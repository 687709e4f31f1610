"""Quantized targets: torch dequantization equals ``mx.dequantize`` bitwise; the dequantized torch target
runs like the MLX quantized one; target.quantization reaches the loaded target; provenance of data.

Measured tolerance (fp32, CPU, tiny 4-layer targets quantized 4-bit g32 by mlx_lm): the torch forward of the
dequantized weights vs mlx_lm's quantized forward (quantized matmul kernels, a different summation order)
differs by at most 1.7e-5 in logits (|logits| ~3) and 9e-6 in tapped features over the six architectures;
the tests allow 1e-4.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from models.dequantize import dequantize, dequantize_weights, read_safetensors  # noqa: E402
from models.quantization import QuantizationError, parse_quantization  # noqa: E402
from models.quantize import quantize_to_mlx, resolve_target  # noqa: E402
from models.target import load_mlx_target  # noqa: E402
from models.tiny import MOE_FAMILY_ARCHS, save_tiny_target  # noqa: E402

TOL = 1e-4  # see the module docstring for the measured differences


def to_torch(a) -> torch.Tensor:
    """An mx.array as a torch tensor with the same bits (bf16 through a uint16 view)."""
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a.view(mx.int32))).view(torch.uint32)
    return torch.from_numpy(np.array(a))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Tiny HF targets (4 layers) by architecture, written once per module."""
    root = tmp_path_factory.mktemp("quant_src")
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = save_tiny_target(root / arch, arch=arch, num_layers=4)
            if arch == "qwen3_5_moe":  # published Qwen3.5 MoE checkpoints store fused experts (mlx_lm reads those)
                from tests.inference.test_mlx_loop import fuse_experts

                fuse_experts(made[arch])
        return made[arch]

    return get


# ---------------------------------------------------------------------------- dequantization, bitwise
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantize_equals_mx_dequantize_bitwise_on_random_weights(bits, group, dtype):
    w = (mx.random.normal((48, 384), key=mx.random.key(bits * 1000 + group)) * 0.05).astype(getattr(mx, dtype))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    ref = to_torch(mx.dequantize(packed, scales, biases, group_size=group, bits=bits))
    ours = dequantize(to_torch(packed), to_torch(scales), to_torch(biases), group, bits)
    assert same_bits(ours, ref), f"max diff {(ours.float() - ref.float()).abs().max().item():.3e}"
    if dtype != "float32":  # a bf16/fp16 checkpoint dequantized for a float32 run: computed in float32
        ref = to_torch(mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group,
                                     bits=bits))
        ours = dequantize(to_torch(packed), to_torch(scales), to_torch(biases), group, bits, dtype=torch.float32)
        assert ours.dtype == torch.float32 and same_bits(ours, ref)


def test_dequantize_of_a_matrix_larger_than_one_chunk_is_bitwise_too():
    """Real matrices (an embedding, an MLP) are dequantized in chunks of rows (2**24 values at a time): each
    chunk must take its own rows' scales and biases. The tiny models fit in one chunk."""
    rng = np.random.default_rng(0)
    rows, n, bits, group = 257, 1 << 16, 4, 64  # 256 rows per chunk: a full chunk and a one-row one
    packed = rng.integers(0, 2**32, (rows, n * bits // 32), dtype=np.uint32)
    scales = rng.standard_normal((rows, n // group), dtype=np.float32)
    biases = rng.standard_normal((rows, n // group), dtype=np.float32)
    ref = to_torch(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=group, bits=bits))
    ours = dequantize(torch.from_numpy(packed), torch.from_numpy(scales), torch.from_numpy(biases), group, bits)
    assert same_bits(ours, ref), f"rows differing: {(ours != ref).any(-1).nonzero().flatten()[:5].tolist()}"


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_tiny_model_quantized_by_mlx_lm_dequantizes_bitwise(sources, tmp_path, bits, group):
    """Every layer mlx_lm quantized (and with what it chose per layer) equals mx.dequantize of that layer;
    at group 128 most layers of the 64-wide tiny target stay unquantized (mlx_lm skips them) and load as they are."""
    from mlx.utils import tree_flatten

    from models.target_mlx import TargetModel as MlxTarget

    if group == 128:  # quantize_to_mlx refuses a group that does not divide hidden; mlx_lm itself skips layers
        from mlx_lm.utils import load, quantize_model, save

        src = sources("qwen3")
        model, tok, config = load(str(src), return_config=True, lazy=True)
        model, qconfig = quantize_model(model, config, group, bits)
        out = tmp_path / "q"
        save(out, src, model, tok, qconfig)
    else:
        out = quantize_to_mlx(sources("qwen3_moe"), tmp_path / "q", bits=bits, group_size=group, log=lambda *_: None)
    mlx_model = MlxTarget.from_pretrained(out).model
    config = json.loads((out / "config.json").read_text())
    ours = dequantize_weights(read_safetensors(out), config, torch.float32)
    quantized = [(name, m) for name, m in mlx_model.named_modules() if hasattr(m, "scales")]
    assert len(quantized) >= (3 if group == 128 else 20)
    for name, m in quantized:
        ref = to_torch(mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits))
        assert same_bits(ours[f"{name}.weight"], ref), name
    plain = {k: v for k, v in tree_flatten(mlx_model.parameters()) if not k.endswith((".scales", ".biases"))
             and k.removesuffix(".weight") not in dict(quantized)}
    for k, v in plain.items():
        assert torch.equal(ours[k], to_torch(v)), k
    if group != 128:
        moe_gates = [n for n, m in quantized if n.endswith("mlp.gate")]
        assert moe_gates and all(dict(quantized)[n].bits == 8 for n in moe_gates)  # mlx_lm's per-layer rule


# ---------------------------------------------------------------------------- torch vs MLX forward
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_5_vl", "qwen3_moe", "qwen3_5_moe",
                                  *MOE_FAMILY_ARCHS])
def test_dequantized_torch_target_matches_the_mlx_quantized_target(sources, tmp_path, arch):
    """Training against the quantized target: mlx_lm quantizes each family (GLM's shared experts, Qwen3-Next's
    fused GatedDeltaNet projections, DeepSeek-V3 / Kimi's latent attention, whose kv_b_proj mlx_lm splits in two)
    and torch reads the folder back to the same forward."""
    from models.target import TargetModel
    from models.target_mlx import TargetModel as MlxTarget

    out = quantize_to_mlx(sources(arch), tmp_path / "q4", bits=4, group_size=32, log=lambda *_: None)
    torch_target = load_mlx_target(out, dtype=torch.float32)
    mlx_target = MlxTarget.from_pretrained(out, dtype=mx.float32)
    assert torch_target.quantization == mlx_target.quantization == "mlx-4bit-g32" and torch_target.num_layers == 4
    # The weights it holds are dequantized: its config must not tell transformers it is a quantized model.
    assert getattr(torch_target.model.config, "quantization_config", None) is None
    if arch == "qwen3":  # the unquantized source: the same word from both adapters
        assert MlxTarget.from_pretrained(sources(arch)).quantization == TargetModel.from_pretrained(
            sources(arch)).quantization == "none"
    ids = [[256, 257, 40, 100, 101, 32, 115, 10, 99, 200, 45, 61]]
    a = torch_target.forward(torch.tensor(ids), [0, 2])
    b = mlx_target.forward(mx.array(ids), [0, 2])
    feat_diff = np.abs(a.features.numpy() - np.array(b.features)).max()
    logit_diff = np.abs(a.logits.numpy() - np.array(b.logits)).max()
    assert feat_diff < TOL and logit_diff < TOL, (feat_diff, logit_diff)


def _torch_greedy(target, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    cache = target.new_cache()
    out = []
    logits = target.forward(ids, cache=cache).logits[:, -1]
    for _ in range(n):
        tok = int(logits.argmax(-1))
        out.append(tok)
        logits = target.forward(torch.tensor([[tok]]), cache=cache).logits[:, -1]
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_greedy_tokens_identical_for_64_tokens(sources, tmp_path, arch):
    from mlx_lm.generate import generate_step

    from models.target_mlx import TargetModel as MlxTarget

    out = quantize_to_mlx(sources(arch), tmp_path / "q4", bits=4, group_size=32, log=lambda *_: None)
    prompt = [256, 257, 117, 115, 101, 114, 10, 104, 105]
    ours = _torch_greedy(load_mlx_target(out, dtype=torch.float32), prompt, 64)
    mlx_target = MlxTarget.from_pretrained(out, dtype=mx.float32)
    ref = [int(t) for t, _logprobs in generate_step(mx.array(prompt), mlx_target.model, max_tokens=64)]
    assert ours == ref


# ---------------------------------------------------------------------------- target.quantization
def test_quantization_values_parse():
    assert parse_quantization("none").describe() == "none"
    assert parse_quantization("mlx-4bit").describe() == "mlx-4bit-g64"
    assert parse_quantization("mlx-3bit-g32").describe() == "mlx-3bit-g32"
    assert parse_quantization("mlx:mlx-community/Qwen3-4B-4bit").path == "mlx-community/Qwen3-4B-4bit"
    assert parse_quantization("bnb-4bit").kind == "bnb" and parse_quantization("fp8").kind == "fp8"
    # An unset key (YAML null, an empty override, false) is no quantization; spaces around a value are not read.
    assert [parse_quantization(v).kind for v in (None, "", False, " none ")] == ["none"] * 4
    assert parse_quantization(" mlx: /q4 ").path == "/q4"


def test_trained_against_names_what_the_run_used(sources, tmp_path):
    from models.provenance import trained_against

    src = sources("qwen3")
    out = quantize_to_mlx(src, tmp_path / "q", bits=4, group_size=32, log=lambda *_: None)
    assert trained_against(str(src), "none") == "none (unquantized weights)"
    assert trained_against(str(out), "none") == f"mlx:{out} (mlx-4bit-g32)"
    assert trained_against(str(src), "mlx-3bit") == "mlx-3bit-g64"
    assert trained_against(str(src), "mlx:mlx-community/Qwen3-8B-4bit") == "mlx:mlx-community/Qwen3-8B-4bit"


def test_resolve_target_quantizes_once_and_loads_dequantized(sources, tmp_path):
    from models.target import TargetModel

    src = str(sources("qwen3"))
    logs = []
    path, tq = resolve_target(src, "mlx-8bit", tmp_path, log=logs.append)
    assert tq is None and path.endswith("target-mlx-8bit-g64") and len(logs) == 1
    assert resolve_target(src, "mlx-8bit", tmp_path, log=logs.append)[0] == path and len(logs) == 1  # cached
    assert resolve_target(src, f"mlx:{path}", tmp_path) == (path, None)
    target = TargetModel.from_pretrained(path, dtype="float32")  # the one loader everything goes through
    bf16 = TargetModel.from_pretrained(src, dtype="float32")
    assert target.quantization == "mlx-8bit-g64" and bf16.quantization == "none"
    w, w0 = target.layers[0].mlp.up_proj.weight, bf16.layers[0].mlp.up_proj.weight
    assert 0 < (w - w0).abs().max() < 0.02 * w0.abs().max()  # 8-bit: close, not equal
    g32, _ = resolve_target(src, "mlx-4bit-g32", tmp_path, log=logs.append)  # the group size asked is the one made
    assert json.loads((tmp_path / "target-mlx-4bit-g32" / "config.json").read_text())["quantization"] == {
        "group_size": 32, "bits": 4, "mode": "affine"} and g32.endswith("target-mlx-4bit-g32")
    assert load_mlx_target(g32, dtype=torch.float32, device="meta").model.lm_head.weight.device.type == "meta"


def test_train_config_key_and_data_provenance(sources, tmp_path, capsys):
    """target.quantization is a config key (recorded in config.yaml); data regenerated by the bf16 target is
    refused for the quantized one unless data.force_target=true."""
    from data.prepare import DataMismatch, load_prepared, prepare
    from data.tiny_chat import write
    from models.target import TargetModel
    from train.config import load_config

    cfg = load_config(["recipe=tiny", "target.quantization=mlx-3bit"])
    assert cfg.target.quantization == "mlx-3bit" and "quantization: mlx-3bit" in cfg.to_yaml()
    src = str(sources("qwen3"))
    chats = write(tmp_path / "chats.jsonl", n=3, seed=0)
    prepare(src, str(chats), tmp_path / "data", regenerate="local", progress=False,
            gen_kwargs={"max_tokens": 8, "batch_size": 4})
    bf16 = TargetModel.from_pretrained(src, dtype="float32")
    _, meta = load_prepared(tmp_path / "data", tokenizer=bf16.tokenizer, target=bf16)
    assert meta["regenerated_by_quantization"] == "none"
    q_path, _ = resolve_target(src, "mlx-4bit-g32", tmp_path, log=lambda *_: None)
    quantized = TargetModel.from_pretrained(q_path, dtype="float32")
    with pytest.raises(DataMismatch, match="regenerated by .*quantization none.*data.force_target=true"):
        load_prepared(tmp_path / "data", tokenizer=quantized.tokenizer, target=quantized)
    load_prepared(tmp_path / "data", tokenizer=quantized.tokenizer, target=quantized, force=True)
    assert "warning:" in capsys.readouterr().err


def test_prepare_cli_regenerates_with_the_quantized_target(sources, tmp_path):
    """python -m data.prepare --regenerate local --quantization mlx-4bit-g32: the answers come from the
    quantized weights (quantized once beside --out), so the data matches the quantized target, not the bf16 one."""
    from data.prepare import DataMismatch, load_prepared, main
    from data.tiny_chat import write
    from models.target import TargetModel

    src = str(sources("qwen3"))
    chats = write(tmp_path / "chats.jsonl", n=3, seed=0)
    main(["--target", src, "--source", str(chats), "--out", str(tmp_path / "data"), "--regenerate", "local",
          "--quantization", "mlx-4bit-g32", "--max-tokens", "8", "--no-progress"])
    q_dir = tmp_path / "target-mlx-4bit-g32"
    quantized = TargetModel.from_pretrained(q_dir, dtype="float32")
    _, meta = load_prepared(tmp_path / "data", tokenizer=quantized.tokenizer, target=quantized)
    assert meta["regenerated_by_quantization"] == quantized.quantization != "none"
    bf16 = TargetModel.from_pretrained(src, dtype="float32")
    with pytest.raises(DataMismatch, match="data.force_target=true"):
        load_prepared(tmp_path / "data", tokenizer=bf16.tokenizer, target=bf16)


def test_quantizing_an_already_quantized_folder_is_refused(sources, tmp_path):
    out = quantize_to_mlx(sources("qwen3"), tmp_path / "q", bits=4, group_size=32, log=lambda *_: None)
    with pytest.raises(QuantizationError, match="already quantized.*target.quantization=mlx:"):
        quantize_to_mlx(out, tmp_path / "again", bits=4, group_size=32)


# ---------------------------------------------------------------------------- reading an MLX folder: small cases
def test_layer_params_take_a_layers_own_entry_and_name_the_layer_that_does_not_fit():
    from models.dequantize import layer_params

    quant = {"bits": 4, "group_size": 64, "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32}}
    assert layer_params(quant, "model.layers.1.mlp.down_proj", 8, 1) == (4, 64)  # 8 words = 256 bits = 64 x 4
    assert layer_params(quant, "model.layers.0.mlp.down_proj", 8, 1) == (8, 32)  # 256 bits = 32 x 8
    with pytest.raises(QuantizationError, match="^model.layers.1.mlp.down_proj: packed width 8 words and 2 scale "
                                                "groups do not fit 4 bits at group size 64"):
        layer_params(quant, "model.layers.1.mlp.down_proj", 8, 2)
    with pytest.raises(QuantizationError, match="mode 'mxfp4' is not supported"):
        layer_params({**quant, "mode": "mxfp4"}, "model.layers.1.mlp.down_proj", 8, 1)
    # A row wider than the config says (8-bit weights under a 4-bit config) is refused as well, not read in part.
    with pytest.raises(QuantizationError, match="packed width 16 words and 1 scale groups do not fit 4 bits"):
        layer_params(quant, "model.layers.1.mlp.down_proj", 16, 1)


@pytest.mark.parametrize("sanitized", [True, False])
def test_qwen35_names_layouts_and_norms_come_back_to_transformers(sanitized):
    """mlx_lm's sanitize moves conv1d to [C, K, 1] and adds 1 to the norms: both are undone, but only for a
    folder it sanitized (an HF-layout conv1d [C, 1, K] means the norms are still transformers' own)."""
    from models.dequantize import to_hf_state_dict

    conv = torch.arange(8.0).reshape(2, 1, 4)
    weights = {
        "language_model.model.layers.0.linear_attn.conv1d.weight": conv.transpose(1, 2) if sanitized else conv,
        "model.language_model.layers.0.input_layernorm.weight": torch.tensor([1.5, 0.25]),
        "model.language_model.norm.weight": torch.tensor([2.0, 1.0]),
        "model.language_model.layers.0.linear_attn.A_log": torch.tensor([1.5, 0.25]),
        "model.visual.blocks.0.attn.qkv.weight": torch.ones(2, 2),
        "vision_tower.patch_embed.weight": torch.ones(2),
        "mtp.fc.weight": torch.ones(2, 2),
        "model.mtp.layers.0.input_layernorm.weight": torch.ones(2),
    }
    out = to_hf_state_dict(weights, "qwen3_5_text")
    shift = 1.0 if sanitized else 0.0
    assert sorted(out) == ["model.layers.0.input_layernorm.weight", "model.layers.0.linear_attn.A_log",
                           "model.layers.0.linear_attn.conv1d.weight", "model.norm.weight"]
    assert torch.equal(out["model.layers.0.linear_attn.conv1d.weight"], conv)
    assert torch.equal(out["model.layers.0.input_layernorm.weight"], torch.tensor([1.5, 0.25]) - shift)
    assert torch.equal(out["model.norm.weight"], torch.tensor([2.0, 1.0]) - shift)
    assert torch.equal(out["model.layers.0.linear_attn.A_log"], torch.tensor([1.5, 0.25]))


def test_only_a_config_with_bits_and_group_size_is_an_mlx_quantized_folder(tmp_path):
    from models.quantization import is_mlx_quantized

    assert not is_mlx_quantized(tmp_path)  # no config.json
    for quantization, expected in (({"bits": 4, "group_size": 64}, True), ({"bits": 4}, False), (None, False)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization": quantization}))
        assert is_mlx_quantized(tmp_path) == expected, quantization


def test_unpack_reads_a_little_endian_bit_stream_and_refuses_a_partial_pack():
    """3-bit values: every 3 bytes hold 8 values, lowest bits first (built here as one Python integer)."""
    from models.dequantize import unpack

    values = [(7 * i + 3) % 8 for i in range(32)]
    stream = sum(v << (3 * i) for i, v in enumerate(values)).to_bytes(12, "little")
    words = torch.frombuffer(bytearray(stream), dtype=torch.uint8).view(torch.uint32)
    assert unpack(words[None], 3).tolist() == [values]
    with pytest.raises(QuantizationError, match="packed row of 16 bytes is not a whole number of 3-bit packs"):
        unpack(torch.zeros(2, 4, dtype=torch.uint32), 3)
    # 7 bits would divide these 28 bytes into packs, and unpack noise: only MLX's widths are read.
    with pytest.raises(QuantizationError, match="7-bit packing is not an MLX affine width"):
        unpack(torch.zeros(2, 7, dtype=torch.uint32), 7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantize_is_bitwise_for_the_other_mlx_widths_too(dtype):
    """2, 5 and 6 bits are MLX affine widths as well (5 and 6 pack across word boundaries)."""
    for bits in (2, 5, 6):
        w = (mx.random.normal((16, 256), key=mx.random.key(bits)) * 0.05).astype(getattr(mx, dtype))
        packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
        ref = to_torch(mx.dequantize(packed, scales, biases, group_size=32, bits=bits))
        ours = dequantize(to_torch(packed), to_torch(scales), to_torch(biases), 32, bits)
        assert same_bits(ours, ref), bits


def test_unpack_refuses_words_that_are_not_32_bit():
    """Packed weights read as int64 (or float) would unpack byte soup: only uint32 / int32 words are read."""
    from models.dequantize import unpack

    assert unpack(torch.tensor([[0x76543210]], dtype=torch.int32), 4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    for dtype in (torch.int64, torch.float32):
        with pytest.raises(QuantizationError, match="packed weights must be uint32 words"):
            unpack(torch.zeros(1, 2, dtype=dtype), 4)


def test_layer_params_refuse_a_layers_own_mode_or_width_and_name_the_layer():
    from models.dequantize import layer_params

    quant = {"bits": 4, "group_size": 64, "model.layers.0.mlp.gate": {"bits": 8, "group_size": 64, "mode": "mxfp4"},
             "model.layers.0.mlp.up_proj": {"bits": 7, "group_size": 32}}
    with pytest.raises(QuantizationError, match="^model.layers.0.mlp.gate: quantization mode 'mxfp4'"):
        layer_params(quant, "model.layers.0.mlp.gate", 16, 1)
    with pytest.raises(QuantizationError, match="^model.layers.0.mlp.up_proj: 7 bits is not an MLX affine width"):
        layer_params(quant, "model.layers.0.mlp.up_proj", 7, 1)  # 7 words = 224 bits = 32 x 7: the widths fit
    assert layer_params(quant, "model.layers.1.mlp.up_proj", 8, 1) == (4, 64)


def test_dequantize_weights_casts_the_unquantized_tensors_and_needs_a_quantization_entry():
    """Norms and other plain tensors come out in the requested dtype (Qwen3.5's ``w - 1`` on a norm is then
    computed in it, not in the checkpoint's bf16); scales without a config entry are a clear error."""
    w = (mx.random.normal((4, 64), key=mx.random.key(0)) * 0.05).astype(mx.bfloat16)
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    weights = {"lin.weight": to_torch(packed), "lin.scales": to_torch(scales), "lin.biases": to_torch(biases),
               "norm.weight": torch.tensor([1.0078125, 2.0], dtype=torch.bfloat16),
               "rope.position_ids": torch.arange(3, dtype=torch.int32)}  # an integer buffer, not packed weights
    out = dequantize_weights(weights, {"quantization": {"bits": 4, "group_size": 32}}, torch.float32)
    assert out["norm.weight"].dtype == torch.float32 and out["lin.weight"].dtype == torch.float32
    assert out["norm.weight"].tolist() == [1.0078125, 2.0]
    assert sorted(out) == ["lin.weight", "norm.weight", "rope.position_ids"]
    assert out["rope.position_ids"].dtype == torch.int32 and out["rope.position_ids"].tolist() == [0, 1, 2]
    with pytest.raises(QuantizationError, match="^lin is quantized but config.json has no 'quantization' entry"):
        dequantize_weights(weights, {}, torch.float32)


def test_a_checkpoint_without_lm_head_needs_tied_embeddings(sources, tmp_path):
    """No lm_head.weight: the embedding stands in only when the config ties them; otherwise it is refused
    (a copied embedding would be a wrong head)."""
    from models.dequantize import build_hf_model, to_hf_state_dict

    out = quantize_to_mlx(sources("qwen3"), tmp_path / "q", bits=8, group_size=32, log=lambda *_: None)
    config = json.loads((out / "config.json").read_text())
    state = to_hf_state_dict(dequantize_weights(read_safetensors(out), config, torch.float32), config["model_type"])
    state.pop("lm_head.weight")
    assert not config.get("tie_word_embeddings")
    with pytest.raises(QuantizationError, match="no lm_head.weight and the config does not tie embeddings"):
        build_hf_model(config, dict(state), torch.float32)
    model = build_hf_model({**config, "tie_word_embeddings": True}, dict(state), torch.float32)
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    # Tied: one parameter, so moving the model to a device moves one embedding, not two copies of it.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # The model holds the dtype asked for, whatever the dtype of the tensors handed in.
    assert {p.dtype for p in build_hf_model(config, {**state, "lm_head.weight": torch.zeros(
        config["vocab_size"], config["hidden_size"])}, torch.bfloat16).parameters()} == {torch.bfloat16}


def test_quantizing_to_bf16_keeps_the_layers_mlx_lm_keeps_in_float32(sources, tmp_path):
    """mlx_lm.convert casts floating weights to the dtype except where the model's cast_predicate says not
    (Qwen3.5's A_log stays float32): the folder holds what mlx_lm.convert would write."""
    from safetensors.torch import load_file

    out = quantize_to_mlx(sources("qwen3_5"), tmp_path / "q", bits=4, group_size=32, dtype="bfloat16",
                          log=lambda *_: None)
    weights = load_file(str(out / "model.safetensors"))
    a_log = [k for k in weights if k.endswith("A_log")]
    norms = [k for k in weights if k.endswith("input_layernorm.weight")]
    assert a_log and all(weights[k].dtype == torch.float32 for k in a_log)
    assert norms and all(weights[k].dtype == torch.bfloat16 for k in norms)


def test_transformers_quantizers_are_configured_as_documented(sources, tmp_path, monkeypatch):
    """bnb-4bit is NF4 computing in bf16; none leaves the target as it is (no quantization to pass on)."""
    import importlib.util

    from models.target import transformers_quantization_config

    src = str(sources("qwen3"))
    assert resolve_target(src, "none", tmp_path) == (src, None) and resolve_target(src, None, tmp_path) == (src, None)
    assert transformers_quantization_config("none") is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes"
                        else real(name, *a))
    cfg = transformers_quantization_config("bnb-4bit")
    assert (cfg.load_in_4bit, cfg.bnb_4bit_quant_type, cfg.bnb_4bit_compute_dtype) == (True, "nf4", torch.bfloat16)
    # MLX values are no transformers quantizer: loading a bf16 target "as mlx-4bit" would train on bf16 weights.
    for value in ("mlx-4bit", "mlx:/q4"):
        with pytest.raises(QuantizationError, match="MLX quantization is resolved to a folder first"):
            transformers_quantization_config(value)


def test_the_quantized_folders_cache_key_reads_the_first_and_last_mib_of_each_weight_file(tmp_path):
    """A target retrained in place keeps its path and config: its weight files' names, sizes and both ends are
    hashed, so a change in the first or the last MiB (the last layers and the head of a large shard), or a shard
    renamed, quantizes it again."""
    from models.quantize import weights_digest

    shard = tmp_path / "model.safetensors"
    data = bytearray(bytes(range(256)) * (3 << 12))  # 3 MiB: a middle MiB neither end covers
    shard.write_bytes(bytes(data))
    (tmp_path / "config.json").write_text("{}")
    digests = {weights_digest(tmp_path)}
    for at in (10, len(data) - 10):
        data[at] ^= 0xFF
        shard.write_bytes(bytes(data))
        digests.add(weights_digest(tmp_path))
    shard.rename(tmp_path / "model-00001-of-00001.safetensors")
    digests.add(weights_digest(tmp_path))
    (tmp_path / "config.json").write_text('{"changed": true}')  # not a weight file: the config is keyed apart
    assert len(digests) == 4 and weights_digest(tmp_path) in digests
