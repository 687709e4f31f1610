"""The MLX drafter is the torch drafter's twin: same names, same keys, same logits; it loads every folder kind."""

import json
import logging

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from models.config import DFlashConfig  # noqa: E402
from models.drafter import DFlashDraftModel as TorchDrafter  # noqa: E402
from models.drafter import DraftCache as TorchCache  # noqa: E402
from models.drafter_mlx import DFlashDraftModel, DraftCache  # noqa: E402
from tests.helpers import assert_close  # noqa: E402

V, H = 288, 64


@pytest.fixture(autouse=True, scope="module")
def _cpu():
    # Exactness is claimed in float32 on the CPU (also when the suite runs on a Mac).
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(old)


def _config(**kw) -> DFlashConfig:
    args = dict(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=V, num_target_layers=8, target_layer_ids=[1, 3, 5], mask_token_id=280,
                block_size=8, torch_dtype="float32", rope_theta=10000.0)
    args.update(kw)
    return DFlashConfig(**args)


def _torch_drafter(config: DFlashConfig, seed: int = 0) -> TorchDrafter:
    torch.manual_seed(seed)
    model = TorchDrafter(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Non-trivial norm weights too, so a mis-mapped key cannot hide behind ones.
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    return model


def _bind_pair(tm: TorchDrafter, mm: DFlashDraftModel, seed: int = 0):
    torch.manual_seed(seed + 100)
    emb = torch.nn.Embedding(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    tm.bind_target(emb, head)
    m_emb, m_head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    m_emb.weight = mx.array(emb.weight.detach().numpy())
    m_head.weight = mx.array(head.weight.detach().numpy())
    mm.bind_target(m_emb, m_head)


def _saved_pair(config, folder) -> tuple[TorchDrafter, DFlashDraftModel]:
    """A torch drafter, its MLX twin loaded from the torch drafter's saved folder, both bound to one target."""
    tm = _torch_drafter(config)
    tm.save_pretrained(folder)
    mm = DFlashDraftModel.from_pretrained(folder)
    _bind_pair(tm, mm)
    return tm, mm


def _drafts(tm, mm, feats, block, steps):
    """Run the same multi-cycle draft sequence (growing context cache) through both drafters."""
    tc, mc = TorchCache(tm.config.num_hidden_layers), DraftCache(mm.config.num_hidden_layers)
    start, outs = 0, []
    for c in steps:
        f = feats[:, start:start + c]
        pos = torch.arange(start, start + c + block.shape[1])[None]
        lt = tm.draft(block, f, pos, cache=tc)
        lm = mm.draft(mx.array(block.numpy()), mx.array(f.numpy()), mx.array(pos.numpy()), cache=mc)
        outs.append((lt.numpy(), np.array(lm)))
        start += c
        assert len(tc) == len(mc) == start
    return outs


@pytest.mark.parametrize("variant", ["full", "sliding_bidirectional", "sliding_causal", "large_eps"])
def test_torch_and_mlx_drafter_logits_match(tmp_path, variant):
    kw = {}
    if variant == "large_eps":  # 1e-6 is invisible at 1e-4: an MLX norm that ignored the config's eps passed
        kw = dict(rms_norm_eps=0.5)
    elif variant != "full":
        kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                  sliding_block_attention=variant.split("_")[1])
    config = _config(**kw)
    tm, mm = _saved_pair(config, tmp_path)
    torch.manual_seed(3)
    feats = torch.randn(1, 20, config.fc_in_features)
    block = torch.tensor([[17] + [config.mask_token_id] * (config.block_size - 1)])
    for k, (lt, lm) in enumerate(_drafts(tm, mm, feats, block, steps=[9, 1, 4, 6])):
        assert_close(lm, lt, 1e-4, f"draft logits, cycle {k}")


def test_positions_past_fp16_range_match_the_torch_drafter(tmp_path):
    """Positions past 2048 are not whole numbers in fp16: RoPE angles must come from float32 positions."""
    config = _config()
    tm, mm = _saved_pair(config, tmp_path)
    torch.manual_seed(3)
    feats = torch.randn(1, 5, config.fc_in_features)
    block = torch.tensor([[17] + [config.mask_token_id] * (config.block_size - 1)])
    pos = torch.arange(5001, 5001 + 5 + config.block_size)[None]
    lt = tm.draft(block, feats, pos)
    lm = mm.draft(mx.array(block.numpy()), mx.array(feats.numpy()), mx.array(pos.numpy()))
    assert_close(np.array(lm), lt, 1e-4, "draft logits at positions 5001..")


def _loaded_pair(tmp_path, **kw):
    tm = _torch_drafter(_config(**kw))
    tm.save_pretrained(tmp_path / "hf")
    return tm, DFlashDraftModel.from_pretrained(tmp_path / "hf")


def test_a_given_mask_is_used_as_is_by_sliding_layers_too(tmp_path):
    """Training layout (the whole row as context, the block at an anchor inside it): a boolean mask, or a
    dict of masks by layer type, replaces the inference sliding mask, so context from the anchor on is
    unseen, as if the context stopped there."""
    # A window wider than the row, so the truncated run's own sliding mask hides nothing either.
    _, mm = _loaded_pair(tmp_path, layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    feats = mx.random.normal((1, 12, mm.config.fc_in_features), key=mx.random.key(1))
    emb = mx.random.normal((1, 8, H), key=mx.random.key(2))
    anchor = 6
    pos = mx.concatenate([mx.arange(12), mx.arange(anchor, anchor + 8)])[None]
    mask = mx.concatenate([mx.arange(12) < anchor, mx.ones((8,), dtype=mx.bool_)])
    mask = mx.broadcast_to(mask[None, None, None], (1, 1, 8, 20))
    short = mm(emb, feats[:, :anchor], mx.arange(anchor + 8)[None])
    for given in (mask, {"full_attention": mask, "sliding_attention": mask}):
        assert_close(np.array(mm(emb, feats, pos, attention_mask=given)), np.array(short), 1e-5, "masked vs truncated")


def test_bf16_drafter_runs_in_bf16_and_matches_fp32(tmp_path):
    """RoPE tables follow the activations' dtype: a bf16 drafter's queries and keys stay bf16."""
    _, full = _loaded_pair(tmp_path)
    half = DFlashDraftModel.from_pretrained(tmp_path / "hf", dtype=mx.bfloat16)
    feats = mx.random.normal((1, 5, full.config.fc_in_features), key=mx.random.key(1))
    emb = mx.random.normal((1, 8, H), key=mx.random.key(2))
    pos = mx.arange(13)[None]
    out = half(emb.astype(mx.bfloat16), feats.astype(mx.bfloat16), pos)
    assert out.dtype == mx.bfloat16
    assert_close(np.array(out.astype(mx.float32)), np.array(full(emb, feats, pos)), 0.15, "bf16 vs fp32 drafter")


def test_unquantized_save_round_trips_without_a_quantization_key(tmp_path):
    _, mm = _loaded_pair(tmp_path)
    assert mm.quantization is None
    mm.save_pretrained(tmp_path / "mlx")
    assert "quantization" not in json.loads((tmp_path / "mlx" / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mlx" / "model.safetensors"), "np") as f:  # loaders check the format tag
        assert f.metadata() == {"format": "mlx"}
    again = DFlashDraftModel.from_pretrained(tmp_path / "mlx")
    from mlx.utils import tree_flatten

    mine, theirs = dict(tree_flatten(mm.parameters())), dict(tree_flatten(again.parameters()))
    assert mine.keys() == theirs.keys() and all(mx.array_equal(v, theirs[k]).item() for k, v in mine.items())


def test_mirrors_the_torch_names_and_keys():
    from mlx.utils import tree_flatten

    config = _config()
    keys = set(dict(tree_flatten(DFlashDraftModel(config).parameters())))
    assert keys == set(TorchDrafter(config).state_dict())
    layer = DFlashDraftModel(config).layers[0]
    assert {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"} <= set(layer)
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"} <= set(layer.self_attn)


def _write_folder(directory, config_dict, state):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("layout", ["flat", "nested"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loads_hf_folders_and_drops_stray_target_weights(tmp_path, caplog, layout, dtype):
    config = _config()
    tm = _torch_drafter(config)
    d = config.to_dict()
    if layout == "nested":  # block_size only inside dflash_config, rope only in rope_parameters
        for k in ("block_size", "rope_theta"):
            d.pop(k)
    state = {k: v.to(dtype) for k, v in tm.state_dict().items()}
    state["embed_tokens.weight"] = torch.zeros(V, H, dtype=dtype)
    state["lm_head.weight"] = torch.zeros(V, H, dtype=dtype)
    folder = _write_folder(tmp_path / "d", d, state)
    with caplog.at_level(logging.WARNING):
        mm = DFlashDraftModel.from_pretrained(folder, dtype=mx.float32)
    assert "dropping" in caplog.text and "embed_tokens" in caplog.text
    assert mm.config == DFlashConfig.load(folder)
    tm = tm.to(dtype).float()  # the same rounding the folder went through
    _bind_pair(tm, mm)
    feats = torch.randn(1, 5, config.fc_in_features)
    block = torch.tensor([[3] + [config.mask_token_id] * 7])
    (lt, lm), = _drafts(tm, mm, feats, block, steps=[5])
    assert_close(lm, lt, 1e-4, f"{layout} {dtype} drafter logits")


def test_bf16_folder_keeps_bf16_by_default(tmp_path):
    config = _config(torch_dtype="bfloat16")
    tm = _torch_drafter(config)
    folder = _write_folder(tmp_path / "d", config.to_dict(), {k: v.bfloat16() for k, v in tm.state_dict().items()})
    assert DFlashDraftModel.from_pretrained(folder).dtype == mx.bfloat16


def test_without_a_dtype_name_the_norm_weights_set_the_compute_dtype(tmp_path):
    """A folder whose config names no dtype ("auto") and keeps the norms in fp32 next to bf16 linears (as
    some exports do; a quantized one holds uint32 weights) computes in the norms' dtype."""
    config = _config()
    state = _torch_drafter(config).state_dict()
    state = {k: v if k.endswith("norm.weight") else v.bfloat16() for k, v in state.items()}
    folder = _write_folder(tmp_path / "d", {**config.to_dict(), "torch_dtype": "auto"}, state)
    assert DFlashDraftModel.from_pretrained(folder).dtype == mx.float32


def test_a_float16_config_loads_in_float16_in_eval_mode_with_the_torch_parameter_count(tmp_path):
    config = _config(torch_dtype="float16")  # over fp32 tensors: the config's dtype name decides
    tm = _torch_drafter(config)
    folder = _write_folder(tmp_path / "d", config.to_dict(), tm.state_dict())
    mm = DFlashDraftModel.from_pretrained(folder)
    assert mm.dtype == mx.float16 and not mm.training
    assert mm.num_parameters == tm.num_parameters


def test_sharded_folder_loads_every_shard_and_a_truncated_one_is_named(tmp_path):
    from mlx.utils import tree_flatten

    tm = _torch_drafter(_config())
    tm.save_pretrained(tmp_path / "s", max_shard_size=40_000)
    assert len(list((tmp_path / "s").glob("*.safetensors"))) > 1
    loaded = dict(tree_flatten(DFlashDraftModel.from_pretrained(tmp_path / "s").parameters()))
    assert loaded.keys() == tm.state_dict().keys()
    assert all(np.array_equal(np.array(loaded[k]), v.numpy()) for k, v in tm.state_dict().items())
    tm.save_pretrained(tmp_path / "t")
    path = tmp_path / "t" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="model.safetensors is corrupt or truncated .*re-download or re-export"):
        DFlashDraftModel.from_pretrained(tmp_path / "t")


def test_mismatched_weights_are_named(tmp_path):
    config = _config()
    state = _torch_drafter(config).state_dict()
    bad = config.replace(target_layer_ids=[1, 3]).to_dict()
    with pytest.raises(ValueError, match="fc.weight.*taps x hidden"):
        DFlashDraftModel.from_pretrained(_write_folder(tmp_path / "a", bad, state))
    del state["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing .*layers.1.mlp.up_proj.weight"):
        DFlashDraftModel.from_pretrained(_write_folder(tmp_path / "b", config.to_dict(), state))


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_quantized_mlx_export_round_trips(tmp_path, bits, group_size):
    config = _config()
    tm = _torch_drafter(config)
    tm.save_pretrained(tmp_path / "hf")
    full = DFlashDraftModel.from_pretrained(tmp_path / "hf")
    quant = DFlashDraftModel.from_pretrained(tmp_path / "hf").quantize(bits=bits, group_size=group_size)
    quant.save_pretrained(tmp_path / "mlx")
    raw = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert raw["quantization"] == {"bits": bits, "group_size": group_size, "mode": "affine"}
    assert DFlashConfig.from_dict(raw) == config.replace(quantization=raw["quantization"])  # canonical reader
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "mlx")
    assert isinstance(loaded.fc, nn.QuantizedLinear) and loaded.quantization == quant.quantization
    assert isinstance(loaded.layers[1].self_attn.q_proj, nn.QuantizedLinear)
    # down_proj's input (intermediate 96) only splits into groups of 32: left in float otherwise.
    assert isinstance(loaded.layers[1].mlp.down_proj, nn.QuantizedLinear) == (96 % group_size == 0)
    for m in (full, quant, loaded):
        _bind_pair(tm, m)
    feats = mx.random.normal((1, 6, config.fc_in_features), key=mx.random.key(0))
    block = mx.array([[3] + [config.mask_token_id] * 7])
    pos = mx.arange(0, 14)[None]
    out = {name: np.array(m.draft(block, feats, pos)) for name, m in
           (("full", full), ("quant", quant), ("loaded", loaded))}
    assert np.array_equal(out["loaded"], out["quant"])  # bit-exact reload
    rel = np.abs(out["quant"] - out["full"]).max() / np.abs(out["full"]).max()
    assert rel < (0.25 if bits == 4 else 0.05), f"{bits}-bit draft logits moved by {rel:.3f} of their range"


def test_quantize_defaults_to_4_bit_groups_of_64():
    mm = DFlashDraftModel(_config()).quantize()
    assert mm.quantization == {"bits": 4, "group_size": 64, "mode": "affine"}
    assert (mm.fc.bits, mm.fc.group_size) == (4, 64)


def test_quantized_weights_without_quantization_key_are_explained(tmp_path):
    config = _config()
    _torch_drafter(config).save_pretrained(tmp_path / "hf")
    DFlashDraftModel.from_pretrained(tmp_path / "hf").quantize(4, 32).save_pretrained(tmp_path / "mlx")
    raw = json.loads((tmp_path / "mlx" / "config.json").read_text())
    del raw["quantization"]
    (tmp_path / "mlx" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="no `quantization"):
        DFlashDraftModel.from_pretrained(tmp_path / "mlx")


def test_target_parts_are_borrowed_not_owned():
    from mlx.utils import tree_flatten

    mm = DFlashDraftModel(_config())
    with pytest.raises(RuntimeError, match="bind_target"):
        mm.embed(mx.array([[1]]))
    n = len(tree_flatten(mm.parameters()))
    mm.bind_target(nn.Embedding(V, H), nn.Linear(H, V, bias=False))
    assert len(tree_flatten(mm.parameters())) == n  # never trained, cast, quantized or saved with the drafter
    with pytest.raises(ValueError, match="vocab_size"):
        mm.bind_target(nn.Embedding(V + 1, H), nn.Linear(H, V + 1, bias=False))
