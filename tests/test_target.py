"""Target adapters: tapped layers equal HF hidden_states[l + 1], logits equal, clear refusals."""

import json

import pytest
import torch

from conftest import assert_close
from models.target import TargetModel, UnsupportedTarget
from models.tiny import TINY_ARCHS, save_tiny_target, tiny_target, tiny_tokenizer


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
    assert target.is_hybrid == arch.startswith("qwen3_5")


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


def test_multimodal_checkpoint_loads_its_text_tower(tmp_path):
    save_tiny_target(tmp_path, "qwen3_5_vl")
    target = TargetModel.from_pretrained(tmp_path)
    full = tiny_target("qwen3_5_vl")
    assert target.model_type == "qwen3_5_text" and target.is_hybrid and target.tokenizer is not None
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = full.model.language_model(ids, output_hidden_states=True).hidden_states
    assert_close(target.forward(ids, [2], with_logits=False).features, ref[3], atol=0, what="text tower")


def test_unsupported_architecture_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedTarget, match="not supported yet: gpt2"):
        TargetModel.from_pretrained(tmp_path)


def test_eos_ids_come_from_the_generation_config(tmp_path):
    save_tiny_target(tmp_path, "qwen3")
    target = TargetModel.from_pretrained(tmp_path)
    assert target.eos_token_ids() == [258]


@pytest.mark.parametrize("shards", [None, "60KB"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5_vl"])
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
