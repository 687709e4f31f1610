"""Target adapters: tapped layers equal HF hidden_states[l + 1], logits equal, clear refusals."""

import json

import pytest
import torch

from models.target import TargetModel, UnsupportedTarget
from models.tiny import HYBRID_ARCHS, TINY_ARCHS, save_tiny_target, tiny_target, tiny_tokenizer
from tests.helpers import assert_close


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_taps_are_layer_outputs(arch):
    model = tiny_target(arch)
    target = TargetModel(model, tiny_tokenizer())
    ids = torch.tensor([[3, 70, 81, 90, 257, 12, 40]])
    out = target.forward(ids, [5, 1, 3])
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    hs = ref.hidden_states
    assert_close(out.features, torch.cat([hs[6], hs[2], hs[4]], -1), atol=0, what="features in config order")
    assert_close(out.logits, ref.logits, atol=0, what="logits")
    assert target.num_layers == 8 and target.hidden_size == 64 and target.vocab_size == 288
    assert target.is_hybrid == (arch in HYBRID_ARCHS)


def test_forward_stops_after_the_deepest_tap_when_no_logits_are_needed():
    target = TargetModel(tiny_target("qwen3"), tiny_tokenizer())
    ran = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(target.layers)]
    out = target.forward(torch.tensor([[1, 2, 3]]), [1, 3], with_logits=False)
    for h in handles:
        h.remove()
    assert ran == [0, 1, 2, 3] and out.logits is None and out.features.shape == (1, 3, 128)


def test_hooks_are_removed_after_each_call():
    target = TargetModel(tiny_target("llama"), tiny_tokenizer("llama3"))
    target.forward(torch.tensor([[1, 2, 3]]), [1, 3], with_logits=False)
    assert all(not layer._forward_hooks for layer in target.layers)


@pytest.mark.parametrize("arch, text_type", [("qwen3_5_vl", "qwen3_5_text"), ("kimi_k25", "deepseek_v3")])
def test_multimodal_checkpoint_loads_its_text_tower(tmp_path, arch, text_type):
    """Qwen3.5's multimodal checkpoint loads through AutoModelForCausalLM, Kimi K2.5's (which it refuses) as a
    DeepSeek-V3 causal LM from the ``language_model.`` weights: no vision weights in memory, none missing."""
    save_tiny_target(tmp_path, arch)
    target = TargetModel.from_pretrained(tmp_path)
    full = tiny_target(arch)
    assert target.model_type == text_type and target.is_hybrid == (arch == "qwen3_5_vl")
    assert target.tokenizer is not None and target.eos_token_ids() == [258]
    assert not any(n.startswith(("model.visual", "vision_tower", "mm_projector")) for n, _ in
                   target.model.named_parameters())
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = full.model.language_model(ids, output_hidden_states=True).hidden_states
        logits = full(input_ids=ids).logits
    assert_close(target.forward(ids, [2], with_logits=False).features, ref[3], atol=0, what="text tower")
    assert_close(target.forward(ids).logits, logits, atol=0, what="text tower logits")


def test_kimi_k25_folder_as_transformers_writes_it_loads_too(tmp_path):
    """transformers 5.24's save_pretrained of the Kimi K2.5 model writes its text layers as
    ``language_model.model.blocks.N`` (the published checkpoint and mlx_lm: ``layers``): both load the same."""
    full = tiny_target("kimi_k25")
    full.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert any(".blocks." in k and k.startswith("language_model.") for k in f.keys())
    target = TargetModel.from_pretrained(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert_close(target.forward(ids).logits, full(input_ids=ids).logits, atol=0, what="logits")


def test_unsupported_architecture_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedTarget, match="not supported yet: gpt2"):
        TargetModel.from_pretrained(tmp_path)


def test_eos_ids_come_from_the_generation_config(tmp_path):
    save_tiny_target(tmp_path, "qwen3")
    target = TargetModel.from_pretrained(tmp_path)
    assert target.eos_token_ids() == [258]


@pytest.mark.parametrize("shards", [None, "60KB"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5_vl", "kimi_k25"])
def test_borrowed_parts_are_the_loaded_embedding_and_head(tmp_path, arch, shards):
    """Offline training loads only the embedding and LM head (the multimodal checkpoint's text-tower names
    too): the same tensors and facts as the whole target, no decoder weights in memory, forward refused.
    A sharded checkpoint is read through its index (only the shards that hold the two)."""
    save_tiny_target(tmp_path, arch, max_shard_size=shards)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shards)
    whole = TargetModel.from_pretrained(tmp_path)
    part = TargetModel.borrowed_parts(tmp_path, dtype=torch.float32, device=torch.device("cpu", 0))  # as DDP gives
    assert torch.equal(part.embed_tokens.weight, whole.embed_tokens.weight)
    assert torch.equal(part.lm_head.weight, whole.lm_head.weight)
    facts = lambda t: (t.model_type, t.num_layers, t.hidden_size, t.vocab_size, t.layer_types,  # noqa: E731
                       t.eos_token_ids())
    assert facts(part) == facts(whole)
    assert part.tokenizer is not None and part.device.type == "cpu" and not part.has_layers
    loaded = [n for n, p in part.model.named_parameters() if p.device.type != "meta"]
    assert sorted(loaded) == sorted(["model.embed_tokens.weight", "lm_head.weight"]), loaded
    with pytest.raises(RuntimeError, match="without its decoder layers.*features.mode=online"):
        part.forward(torch.tensor([[1, 2, 3]]), [1])


@pytest.mark.parametrize("shards", [None, "60KB"])
def test_borrowed_parts_follow_tied_embeddings(tmp_path, shards):
    """A checkpoint with tie_word_embeddings stores no lm_head tensor (nor an index entry): the head is
    the embedding."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from models.weights import load_state_dict

    save_tiny_target(tmp_path / "untied", "qwen3")
    config = AutoConfig.from_pretrained(tmp_path / "untied")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied",
                                                             **({"max_shard_size": shards} if shards else {}))
    assert "lm_head.weight" not in load_state_dict(tmp_path / "tied")
    if shards:
        assert "lm_head.weight" not in json.loads((tmp_path / "tied" / "model.safetensors.index.json").read_text())[
            "weight_map"]
    part = TargetModel.borrowed_parts(tmp_path / "tied", dtype=torch.float32)
    whole = TargetModel.from_pretrained(tmp_path / "tied")
    assert part.lm_head.weight is part.embed_tokens.weight
    assert torch.equal(part.lm_head.weight, whole.lm_head.weight)


def test_a_layer_id_past_the_last_layer_is_refused_by_name():
    """Layer ids run 0..num_layers-1: the id equal to the depth (a drafter config written for hidden_states
    indices) is refused with the target's depth, not an IndexError from the layer list."""
    target = TargetModel(tiny_target("qwen3"), tiny_tokenizer())
    ids = torch.tensor([[1, 2, 3]])
    assert target.forward(ids, [7], with_logits=False).features.shape == (1, 3, 64)
    for bad in (8, -1):
        with pytest.raises(ValueError, match=f"layer id {bad} is outside this target's 8 layers"):
            target.forward(ids, [1, bad])


def _bf16_checkpoint(folder):
    """A tiny target saved in bfloat16 (as Hub checkpoints are), with its tokenizer."""
    tiny_target("qwen3", dtype=torch.bfloat16).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_dtype_defaults_to_the_checkpoints_own(tmp_path):
    """No dtype (or "auto") loads a bf16 checkpoint in bf16, as transformers' dtype="auto" does, for the whole
    target and for its borrowed embedding and head: a float32 default doubled the memory and changed the
    features the drafter trains on. An explicit dtype wins."""
    folder = _bf16_checkpoint(tmp_path / "bf16")
    assert TargetModel.from_pretrained(folder).dtype == torch.bfloat16
    assert TargetModel.from_pretrained(folder, dtype="auto").dtype == torch.bfloat16
    assert TargetModel.borrowed_parts(folder).lm_head.weight.dtype == torch.bfloat16
    assert TargetModel.from_pretrained(folder, dtype="float32").dtype == torch.float32
    assert TargetModel.borrowed_parts(folder, dtype=torch.float32).dtype == torch.float32


def test_an_untied_checkpoint_missing_its_lm_head_is_refused(tmp_path):
    """Only a tie_word_embeddings checkpoint may lack lm_head.weight; an untied one without it (an incomplete
    download) is named, never trained against the embedding as its head."""
    from safetensors.torch import load_file, save_file

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    shard = folder / "model.safetensors"
    tensors = load_file(str(shard))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor named lm_head.weight .*incomplete download"):
        TargetModel.borrowed_parts(folder)


@pytest.mark.parametrize("loader", ["from_pretrained", "borrowed_parts"])
def test_a_truncated_later_shard_of_a_sharded_checkpoint_is_named(tmp_path, loader):
    """Every shard is checked, not only the first: a sharded target whose shard holding the LM head was cut
    short is refused with that file's name by both loaders."""
    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2, max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index["lm_head.weight"]
    assert shard.name != sorted(set(index.values()))[0]  # not the first shard
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=f"{shard.name} is corrupt or truncated.*re-download"):
        getattr(TargetModel, loader)(folder)


class _Process:
    """The parts of an accelerate Accelerator that train.setup.load_target reads: one CPU process."""

    is_main_process, device, distributed_type = True, torch.device("cpu"), "NO"

    def wait_for_everyone(self):
        pass


@pytest.mark.parametrize("features, dtype, whole, loaded", [
    ("online", "auto", True, torch.float32),  # auto off CUDA: float32, not bf16 (CPU bf16 is slow and lossy)
    ("offline", "auto", False, torch.float32),  # offline features: embedding and LM head only
    ("offline", "bfloat16", False, torch.bfloat16),
])
def test_training_loads_the_target_in_its_dtype_and_only_the_parts_it_needs(tmp_path, features, dtype, whole,
                                                                           loaded):
    from train.config import load_config
    from train.setup import load_target

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    cfg = load_config(["recipe=tiny", f"target.path={folder}", f"features.mode={features}",
                       f"features.store={tmp_path / 'store'}", f"target.dtype={dtype}", "eval.true_tau_prompts=0"])
    target, path = load_target(cfg, tmp_path, _Process(), log=lambda *_: None)
    assert path == str(folder) and target.has_layers == whole and target.dtype == loaded


def test_a_tiny_target_is_built_in_its_own_folder_of_the_run_and_loaded_from_it(tmp_path, monkeypatch):
    """tiny:<arch> is built in out_dir/tiny_target, beside the run's data and checkpoints, and that folder
    (not "tiny:<arch>") is the path training loads and records. The main process builds it; every process
    waits for it before reading it."""
    import train.setup
    from train.config import load_config
    from train.setup import load_target

    events, resolve = [], train.setup.resolve_target

    def build(path, arch, log):
        events.append(("build", path, arch))
        return save_tiny_target(path, arch, num_layers=2)

    class Recorded(_Process):
        def wait_for_everyone(self):
            events.append("wait")

    monkeypatch.setattr(train.setup, "build_tiny_target", build)
    monkeypatch.setattr(train.setup, "resolve_target", lambda *a, **kw: events.append("read") or resolve(*a, **kw))
    cfg = load_config(["recipe=tiny", "target.path=tiny:llama", "eval.true_tau_prompts=0"])
    _, path = load_target(cfg, tmp_path, Recorded(), log=lambda *_: None)
    assert path == str(tmp_path / "tiny_target")
    assert events == [("build", path, "llama"), "wait", "read", "wait", "read"]


def test_offline_features_load_the_whole_target_when_its_weights_are_no_safetensors(tmp_path):
    """Only safetensors shards let the embedding and LM head be read alone: a target saved as
    pytorch_model.bin is loaded whole instead of failing to borrow its parts."""
    from safetensors.torch import load_file

    from train.config import load_config
    from train.setup import load_target

    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    cfg = load_config(["recipe=tiny", f"target.path={folder}", "features.mode=offline",
                       f"features.store={tmp_path / 'store'}", "eval.true_tau_prompts=0"])
    target, _ = load_target(cfg, tmp_path, _Process(), log=lambda *_: None)
    assert target.has_layers and target.num_layers == 2


def test_a_target_spread_by_device_map_is_loaded_with_its_memory_budget(tmp_path, monkeypatch):
    from train.config import load_config
    from train.setup import load_target

    asked = {}

    def from_pretrained(path, **kwargs):
        asked.update(kwargs)
        raise KeyboardInterrupt  # what was asked is all this test needs

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(TargetModel, "from_pretrained", from_pretrained)
    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    cfg = load_config(["recipe=tiny", f"target.path={folder}", "target.device_map=auto",
                       "target.max_memory=0=1GiB,cpu=2GiB"])
    with pytest.raises(KeyboardInterrupt):
        load_target(cfg, tmp_path, _Process(), log=lambda *_: None)
    assert asked["device_map"] == "auto" and asked["max_memory"] == "0=1GiB,cpu=2GiB" and "device" not in asked


def test_who_loads_the_whole_target_and_who_borrows_its_embedding_and_head():
    """Offline features with true tau: the main process generates, and under FSDP every process takes part
    in the drafter's all-gathers, so each needs the decoder layers; a target spread by device_map is never
    borrowed (its parts come through the map)."""
    from train.config import load_config
    from train.plan import borrows_target, loads_whole_target

    offline = load_config(["recipe=tiny", "features.mode=offline", "features.store=feats", "eval.true_tau_prompts=4"])
    assert [loads_whole_target(offline, is_main, fsdp) for is_main, fsdp in
            ((True, False), (False, False), (False, True))] == [True, False, True]
    assert loads_whole_target(load_config(["recipe=tiny", "features.mode=online"]), False, False)
    assert borrows_target(offline)
    assert not borrows_target(load_config(["recipe=tiny", "features.mode=offline", "features.store=feats",
                                           "target.device_map=auto"]))


def test_a_shard_with_bytes_past_its_tensors_is_refused(tmp_path):
    """A safetensors file longer than its header describes (two downloads appended, a copy written over a
    bigger file) is as broken as a short one: named, with its sizes."""
    folder = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    shard = folder / "model.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + b"\0" * 16)
    with pytest.raises(ValueError, match=f"model.safetensors is corrupt or truncated: {size + 16} bytes, its header "
                                         f"describes {size}"):
        TargetModel.from_pretrained(folder)


# ------------------------------------------------------------------ MLX-quantized targets (loading side)
def _quantize(src, out, bits, group_size):
    pytest.importorskip("mlx_lm")
    from models.quantize import quantize_to_mlx

    return quantize_to_mlx(src, out, bits=bits, group_size=group_size, log=lambda *_: None)


def test_an_mlx_quantized_bf16_target_loads_in_bf16_by_default(tmp_path):
    """Without a dtype the dequantized weights take the scales' dtype (bf16 for a bf16 source, as
    mlx-community repos are), which is what the Mac computes in; float32 only when asked."""
    q = _quantize(_bf16_checkpoint(tmp_path / "bf16"), tmp_path / "q", 4, 32)
    target = TargetModel.from_pretrained(q)
    assert target.dtype == torch.bfloat16 and target.quantization == "mlx-4bit-g32"
    assert TargetModel.from_pretrained(q, dtype="float32").dtype == torch.float32


def test_quantizing_again_with_other_bits_rebuilds_the_cached_folder(tmp_path):
    """The cache is keyed on every argument: asking for 8 bits where a 4-bit folder was made rebuilds it,
    never hands back the 4-bit weights under an 8-bit name; so does another group size or dtype."""
    from models.quantize import quantize_to_mlx

    src = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    out = tmp_path / "q"
    _quantize(src, out, 4, 32)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    _quantize(src, out, 8, 32)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    assert TargetModel.from_pretrained(out).quantization == "mlx-8bit-g32"
    _quantize(src, out, 8, 64)
    assert TargetModel.from_pretrained(out).quantization == "mlx-8bit-g64"
    quantize_to_mlx(src, out, bits=8, group_size=64, dtype="bfloat16", log=lambda *_: None)
    assert TargetModel.from_pretrained(out).dtype == torch.bfloat16  # the source is float32: rebuilt in bf16


def test_a_group_size_that_does_not_divide_the_hidden_size_is_refused(tmp_path):
    """hidden 64 and group 128: mlx_lm would leave every such layer unquantized (a bf16 target named 4-bit);
    refused with the sizes that fit, before anything is written."""
    from models.quantization import QuantizationError

    src = save_tiny_target(tmp_path / "t", "qwen3", num_layers=2)
    with pytest.raises(QuantizationError, match=r"group size 128 does not divide the target's hidden size 64: .*"
                                                r"use group size \[32, 64\]"):
        _quantize(src, tmp_path / "q", 4, 128)
    assert not (tmp_path / "q").exists()


def test_an_mlx_folder_reads_its_model_shards_not_other_safetensors_beside_them(tmp_path):
    """mlx_lm writes LoRA adapters as adapters.safetensors next to the model: the target's weights are the
    model*.safetensors files only, so the loaded target is the same with or without them."""
    from safetensors.torch import save_file

    q = _quantize(save_tiny_target(tmp_path / "t", "qwen3", num_layers=2), tmp_path / "q", 4, 32)
    before = TargetModel.from_pretrained(q, dtype="float32").embed_tokens.weight.clone()
    save_file({"model.layers.0.self_attn.q_proj.lora_a": torch.zeros(64, 8),
               "model.layers.0.self_attn.q_proj.lora_b": torch.zeros(8, 64)}, str(q / "adapters.safetensors"))
    assert torch.equal(TargetModel.from_pretrained(q, dtype="float32").embed_tokens.weight, before)


def test_an_mlx_folder_of_the_older_weights_nn_layout_reads_every_file(tmp_path):
    """mlx-examples' converter named the shards weights.00.safetensors, weights.01.safetensors, ...: a folder
    without model*.safetensors reads all of its safetensors files."""
    from safetensors.torch import load_file, save_file

    from models.dequantize import read_safetensors

    q = _quantize(save_tiny_target(tmp_path / "t", "qwen3", num_layers=2), tmp_path / "q", 4, 32)
    weights = load_file(str(q / "model.safetensors"))
    embed = sorted(k for k in weights if k.startswith("model.embed_tokens."))
    save_file({k: weights[k] for k in embed}, str(q / "weights.00.safetensors"))
    save_file({k: v for k, v in weights.items() if k not in embed}, str(q / "weights.01.safetensors"))
    for old in ("model.safetensors", "model.safetensors.index.json"):
        (q / old).unlink()
    assert sorted(read_safetensors(q)) == sorted(weights)
    target = TargetModel.from_pretrained(q, dtype="float32")
    assert target.quantization == "mlx-4bit-g32" and target.embed_tokens.weight.shape == (target.vocab_size, 64)


# ------------------------------------------------------------------ safetensors folders (models/weights.py)
def test_a_sharded_folder_reads_the_shards_its_index_names_and_names_a_missing_one(tmp_path):
    """A stale ``model.safetensors`` beside the shards (an earlier unsharded save) is never read; a shard
    the index lists but the folder lacks is named, by the reader and by the up-front check."""
    from safetensors.torch import save_file

    from models.weights import INDEX, check_folder_weights, load_state_dict, weight_files

    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"x": torch.ones(2)}, str(tmp_path / first))
    save_file({"y": torch.full((2,), 2.0)}, str(tmp_path / second))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"x": first, "y": second}}))
    assert [p.name for p in weight_files(tmp_path)] == [first, second]
    state = load_state_dict(tmp_path)
    assert torch.equal(state["x"], torch.ones(2)) and torch.equal(state["y"], torch.full((2,), 2.0))
    check_folder_weights(tmp_path)
    (tmp_path / second).unlink()
    with pytest.raises(FileNotFoundError, match=f"{second} is listed in {INDEX} but missing"):
        weight_files(tmp_path)
    for name in (first, "model.safetensors"):  # only the index left: still a folder to check, not one to skip
        (tmp_path / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"{first} is listed in {INDEX} but missing"):
        check_folder_weights(tmp_path)


def test_weight_files_are_each_shard_once_in_name_order(tmp_path):
    """An index names a shard once per tensor, in any order: each shard is read once, in name order; an
    unindexed folder's files come in name order too, a folder without any is named, and a sharded save
    returns its shards, not another safetensors file already beside them."""
    from safetensors.torch import save_file

    from models.weights import INDEX, save_state_dict, weight_files

    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"x": torch.ones(2), "z": torch.ones(1)}, str(tmp_path / first))
    save_file({"y": torch.ones(2), "w": torch.ones(1)}, str(tmp_path / second))
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"y": second, "x": first, "w": second, "z": first}}))
    assert weight_files(tmp_path) == [tmp_path / first, tmp_path / second]
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("c.safetensors", "a.safetensors", "d.safetensors", "b.safetensors"):
        save_file({"x": torch.ones(1)}, str(plain / name))
    assert [p.name for p in weight_files(plain)] == ["a.safetensors", "b.safetensors", "c.safetensors", "d.safetensors"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights in .*empty"):
        weight_files(tmp_path / "empty")
    saved = tmp_path / "saved"
    saved.mkdir()
    save_file({"x": torch.ones(1)}, str(saved / "adapter.safetensors"))
    written = save_state_dict({"a": torch.ones(1000), "b": torch.ones(1000)}, saved, max_shard_size=5000)
    assert [p.name for p in written] == [first, second]


@pytest.mark.parametrize("index", ['{"metadata": {}}', '["model.safetensors"]', '{"weight_map": '])
def test_an_index_without_a_weight_map_is_named_as_a_broken_index(tmp_path, index):
    from models.hub import INDEX, shard_index

    (tmp_path / INDEX).write_text(index)
    with pytest.raises(ValueError, match=f"{INDEX} is not a safetensors shard index"):
        shard_index(tmp_path)


def test_a_safetensors_file_without_tensors_is_complete(tmp_path):
    """The header may fill the whole file (no tensor data): that is its full size, not a truncation."""
    from safetensors.torch import save_file

    from models.weights import check_complete

    save_file({}, str(tmp_path / "empty.safetensors"), metadata={"format": "pt"})
    check_complete(tmp_path / "empty.safetensors")
    with open(tmp_path / "empty.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        check_complete(tmp_path / "empty.safetensors")


@pytest.mark.parametrize("arch, shape", [("qwen3", (1, 5)), ("llama", (1, 5)), ("qwen3_5", (3, 1, 5))])
def test_rope_hands_each_decoder_the_position_ids_it_indexes(tiny_targets, monkeypatch, arch, shape):
    """Qwen3.5's M-RoPE rotary gets one position row per section ([3, 1, T]): transformers 5.17 indexes
    that shape directly and failed on [1, T] (the static loop's prefill, seen on a GPU node); the cos/sin
    are those of the decoder's own call."""
    target = tiny_targets(arch)
    rotary, seen = target.decoder.rotary_emb, []
    own = rotary.forward
    monkeypatch.setattr(rotary, "forward", lambda x, ids: seen.append(tuple(ids.shape)) or own(x, ids))
    h, pos = torch.randn(1, 5, target.hidden_size), torch.arange(3, 8)
    cos, sin = target.rope(h, pos)
    assert seen == [shape]
    ref_cos, ref_sin = own(h, pos[None])
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_the_cache_keyword_is_the_one_the_installed_transformers_takes():
    """transformers 5.24 renamed a layer's ``past_key_values`` (a GatedDeltaNet mixer's ``cache_params``) to
    ``cache``, keeping the old names with a deprecation warning until 5.40: the name comes from the
    signature, also of a layer whose instance forward ``compile_layers`` replaced."""
    from models.target import cache_kwarg

    class New(torch.nn.Module):
        def forward(self, x, cache=None):
            return x

    class Old(torch.nn.Module):
        def forward(self, x, past_key_values=None):
            return x

    assert cache_kwarg(New()) == "cache" and cache_kwarg(Old()) == "past_key_values"
    assert cache_kwarg(Old(), "cache_params") == "cache_params"
    wrapped = New()
    wrapped.forward = lambda *a, **k: None
    assert cache_kwarg(wrapped) == "cache"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_the_loops_pass_their_caches_without_a_deprecation_warning(arch, recwarn):
    """The eager loop (rollback replay included) and the static loop hand HF layers their cache by the
    current keyword: no FutureWarning from transformers."""
    from inference.static_loop import StaticTarget, static_dflash_generate
    from inference.torch_loop import dflash_generate
    from tests.helpers import ReferenceProposer

    target = TargetModel(tiny_target(arch, seed=0), tiny_tokenizer())
    prompt = [257, 85, 82, 68, 81, 198]
    proposer = ReferenceProposer(prompt + [5] * 40, [1, 3, 5], 4, 288, {len(prompt) + 2})
    dflash_generate(target, proposer, prompt, 8, eos_token_ids=[], block_size=4)
    st = StaticTarget(target, [1, 3, 5], max_len=32, block_size=4)
    static_dflash_generate(st, proposer, prompt, 8, eos_token_ids=[], block_size=4)
    deprecations = [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)]
    assert not deprecations, deprecations


# ------------------------------------------------------------------ gpt-oss and Gemma 4 (issue 46)
@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4"])
def test_gemma_logits_are_soft_capped_and_the_block_embedding_scaled(tiny_targets, arch):
    """Gemma 4's logits are cap * tanh(logits / cap) (greedy decoding cannot tell: argmax is the same) and its
    embedding is the table times sqrt(hidden), as the model's own forward computes them."""
    target = tiny_targets(arch)
    ids = torch.tensor([[3, 70, 81, 90, 257, 12, 40]])
    with torch.no_grad():
        ref = target.model(ids, output_hidden_states=True)
        raw = target.lm_head(ref.hidden_states[-1])
    assert target.softcap == 30.0
    assert_close(target.forward(ids, [1]).logits, ref.logits, atol=0, what="soft-capped logits")
    assert_close(target.logits(ref.hidden_states[-1]), ref.logits, atol=0, what="TargetModel.logits")
    assert_close(ref.logits, 30.0 * torch.tanh(raw / 30.0), atol=1e-5, what="the cap")
    assert (raw - ref.logits).abs().max() > 1e-3  # the tiny logits are large enough for the cap to show
    scaled = target.embed_tokens.weight[ids] * target.hidden_size ** 0.5
    assert_close(target.embed(ids), scaled, atol=1e-6, what="embedding x sqrt(hidden)")
    assert_close(target.embed(ids), ref.hidden_states[0], atol=0, what="the decoder's input")


def test_logits_without_a_cap_in_the_config_are_the_lm_heads(tiny_targets):
    target = tiny_targets("gpt_oss")
    h = torch.randn(1, 3, target.hidden_size)
    assert target.softcap is None and torch.equal(target.logits(h), target.lm_head(h))


@pytest.mark.parametrize("arch", ["gemma4", "gemma4_text", "gpt_oss"])
def test_borrowed_parts_of_the_new_families_embed_as_the_whole_target(tmp_path, arch):
    """Offline training borrows the embedding and LM head only: Gemma's sqrt(hidden) scale (a buffer that is not
    in the checkpoint, left on the meta device) is there too, and the multimodal checkpoint's text-tower names
    are read."""
    save_tiny_target(tmp_path, arch)
    whole = TargetModel.from_pretrained(tmp_path)
    part = TargetModel.borrowed_parts(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[3, 70, 81, 269, 257]])
    assert_close(part.embed(ids), whole.embed(ids), atol=0, what=f"{arch} borrowed embedding")
    assert torch.equal(part.lm_head.weight, whole.lm_head.weight)
    h = torch.randn(1, 2, whole.hidden_size)
    assert_close(part.logits(h), whole.logits(h), atol=0, what=f"{arch} borrowed logits")
    assert (part.family, part.layer_types, part.softcap) == (whole.family, whole.layer_types, whole.softcap)


def test_gpt_oss_never_runs_under_sdpa(tiny_targets, monkeypatch):
    """SDPA has no argument for gpt-oss's learned attention sinks and would drop them silently: the plain
    (unpadded, uncached) forward's CAUSAL_SDPA fast path is never taken for it, even where every layer is full
    attention and the config says sdpa; a family without sinks takes it there."""
    import models.target as mt

    asked = []
    real = mt.attention_implementation
    monkeypatch.setattr(mt, "attention_implementation", lambda configs, name: asked.append(name) or real(configs, name))
    ids = torch.tensor([[3, 70, 81, 90]])
    for arch in ("gpt_oss", "qwen3"):
        target = tiny_targets(arch)
        monkeypatch.setattr(target, "layer_types", ["full_attention"] * target.num_layers)
        for c in target._attention_configs:
            monkeypatch.setattr(c, "_attn_implementation", "sdpa")
        target.forward(ids, [1], with_logits=False)
    assert asked == [None, mt.CAUSAL_SDPA]
    assert not mt.family_facts("gpt_oss").sdpa and mt.family_facts("gemma4").sdpa


def test_gemma_kv_shared_layers_hold_no_cache_and_the_rollback_check_skips_them(tiny_targets):
    """Gemma 4 E-models' last layers read the K/V of an earlier layer of their kind: their cache layers hold
    nothing, the per-cycle check skips them, and their store layers hold every committed position."""
    from transformers.cache_utils import DummyLayer

    from inference.rollback_torch import CacheRollback

    target = tiny_targets("gemma4_e")
    cache = target.new_cache()
    target.forward(torch.tensor([list(range(60, 80))]), cache=cache, with_logits=False)
    shared = [i for i, layer in enumerate(cache.layers) if isinstance(layer, DummyLayer)]
    assert shared == [6, 7]
    CacheRollback(target).check(cache, 20)
    with pytest.raises(AssertionError, match="layer 0 holds 20 positions, committed length is 19"):
        CacheRollback(target).check(cache, 19)
