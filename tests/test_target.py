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
