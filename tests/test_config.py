"""The canonical drafter config: both layouts, the written schema, the layer-id rule, every validation."""

import json
import re
from pathlib import Path

import pytest

from models.config import ConfigError, DFlashConfig, default_layer_ids
from models.mask_token import choose_mask_token, tokenizer_emitted_ids

FIXTURES = Path(__file__).parent / "fixtures"

WRITTEN_KEYS = {  # plus is_causal=false for bidirectional sliding layers
    "architectures", "model_type", "auto_map", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "attention_bias",
    "attention_dropout", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "layer_types",
    "sliding_window", "use_sliding_window", "torch_dtype", "num_target_layers", "block_size", "rope_theta",
    "rope_parameters", "dflash_config",
}


def load(name):
    return json.loads((FIXTURES / name).read_text())


def test_flat_and_nested_layouts_read_to_the_same_config():
    flat = DFlashConfig.from_dict(load("config_flat.json"))
    nested = DFlashConfig.from_dict(load("config_nested.json"))
    assert flat == nested
    assert flat.target_layer_ids == [1, 9, 17, 25, 33]
    assert flat.block_size == 16 and flat.mask_token_id == 151669 and flat.rope_theta == 1e6
    assert flat.fc_in_features == 5 * 4096


def test_written_layout_is_flat_complete_and_round_trips(tmp_path):
    cfg = DFlashConfig.from_dict(load("config_nested.json"))
    d = cfg.to_dict()
    assert set(d) == WRITTEN_KEYS
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["block_size"] == d["dflash_config"]["block_size"] == 16
    assert d["rope_theta"] == d["rope_parameters"]["rope_theta"] == 1e6
    assert d["rope_parameters"]["rope_type"] == "default"
    assert d["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert d["layer_types"] == ["full_attention"] * 5 and d["use_sliding_window"] is False
    assert "eagle_aux_hidden_state_layer_ids" not in json.dumps(d)
    assert DFlashConfig.from_dict(d) == cfg
    cfg.save(tmp_path)
    assert DFlashConfig.load(tmp_path) == cfg
    assert json.loads((tmp_path / "config.json").read_text()) == d


def test_tap_order_is_kept_as_trained(tmp_path):
    """Features are joined in config order, so [5, 1, 3] is another drafter than [1, 3, 5]: every place
    the ids are written or read keeps the order (all other configs here are sorted)."""
    cfg = DFlashConfig.for_target(hidden_size=64, vocab_size=300, num_target_layers=8, max_position_embeddings=512,
                                  mask_token_id=290, head_dim=16, num_taps=3)
    cfg = DFlashConfig.from_dict({**cfg.to_dict(), "dflash_config": {**cfg.to_dict()["dflash_config"],
                                                                      "target_layer_ids": [5, 1, 3]}})
    assert cfg.target_layer_ids == [5, 1, 3]
    assert cfg.to_dict()["dflash_config"]["target_layer_ids"] == [5, 1, 3]
    cfg.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [5, 1, 3]
    assert DFlashConfig.load(tmp_path).target_layer_ids == [5, 1, 3]


def test_drafter_rope_is_plain_even_for_a_partial_rotary_target():
    # A Qwen3.5 target uses partial rotary + mrope; the drafter config must not inherit it.
    cfg = DFlashConfig.for_target(hidden_size=64, vocab_size=300, num_target_layers=8, max_position_embeddings=512,
                                  mask_token_id=290, head_dim=16, num_taps=3)
    assert cfg.to_dict()["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg.rope_theta}
    d = cfg.to_dict()
    d["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    with pytest.raises(ConfigError, match="plain full-head RoPE"):
        DFlashConfig.from_dict(d)


@pytest.mark.parametrize("layers,taps,expected", [
    (36, 5, [1, 9, 17, 25, 33]), (32, 5, [1, 8, 15, 22, 29]), (64, 5, [1, 16, 31, 46, 61]),
    (28, 1, [14]), (8, 3, [1, 3, 5]),
    # halves round to even, as Python's round() in the reference rule: 20.5 -> 20, 16.5 -> 16, 68.5 -> 68
    (30, 5, [1, 8, 14, 20, 27]), (35, 3, [1, 16, 32]), (94, 5, [1, 24, 46, 68, 91]),
])
def test_default_layer_ids(layers, taps, expected):
    assert default_layer_ids(layers, taps) == expected
    assert max(expected) < layers - 1


def base(**kw):
    d = load("config_flat.json")
    d.update(kw)
    return d


@pytest.mark.parametrize("change,field,words", [
    ({"dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 35]}}, "target_layer_ids",
     "last layer cannot be tapped"),
    ({"dflash_config": {"mask_token_id": 151669, "target_layer_ids": [-1, 9]}}, "target_layer_ids", "outside"),
    ({"dflash_config": {"mask_token_id": 151936, "target_layer_ids": [1, 9]}}, "mask_token_id",
     "outside the target embedding"),
    ({"block_size": 1, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1], "block_size": 1}}, "block_size",
     "at least one mask"),
    ({"num_key_value_heads": 5}, "num_key_value_heads", "must divide"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types", "has 4 entries"),
    ({"layer_types": ["sliding_attention"] * 5, "use_sliding_window": True, "sliding_window": None}, "sliding_window",
     "positive integer"),
    ({"dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9], "block_size": 8}}, "block_size",
     "different values"),
    ({"num_target_layers": None}, "num_target_layers", "missing"),
])
def test_validation_errors_name_field_value_and_fix(change, field, words):
    with pytest.raises(ConfigError) as err:
        DFlashConfig.from_dict(base(**change))
    assert err.value.field == field
    assert words in str(err.value) and "Fix:" in str(err.value)


def test_target_checks():
    cfg = DFlashConfig.from_dict(load("config_flat.json"))
    cfg.check_target(hidden_size=4096, vocab_size=151936, num_layers=36, emitted_ids=range(151669))
    with pytest.raises(ConfigError, match="hidden size is 5120"):
        cfg.check_target(hidden_size=5120, vocab_size=151936, num_layers=36)
    with pytest.raises(ConfigError, match="152064 rows"):
        cfg.check_target(hidden_size=4096, vocab_size=152064, num_layers=36)
    with pytest.raises(ConfigError, match="has 40 decoder layers"):
        cfg.check_target(hidden_size=4096, vocab_size=151936, num_layers=40)
    with pytest.raises(ConfigError, match="tokenizer emits"):
        cfg.check_target(hidden_size=4096, vocab_size=151936, num_layers=36, emitted_ids=range(151700))


def test_mask_token_choice():
    from models.tiny import TINY_VOCAB, tiny_tokenizer

    tok = tiny_tokenizer()
    mask = choose_mask_token(TINY_VOCAB, tokenizer_emitted_ids(tok))
    assert mask == len(tok) == 265  # first row past the byte tokens and the specials
    assert choose_mask_token(10, [0, 1, 3]) == 2  # a gap inside the vocabulary counts too
    with pytest.raises(ConfigError, match="no spare row"):
        choose_mask_token(len(tok), tokenizer_emitted_ids(tok))


def test_sliding_semantics_follow_the_explicit_field_then_the_zlab_convention():
    d = load("config_flat.json")
    d.update(layer_types=["sliding_attention", "full_attention"] * 2 + ["full_attention"], sliding_window=64,
             use_sliding_window=True)
    assert DFlashConfig.from_dict(d).sliding_block_attention == "causal"  # z-lab: sliding layers are causal
    written = DFlashConfig.from_dict({**d, "is_causal": False}).to_dict()
    assert written["is_causal"] is False and written["dflash_config"]["sliding_block_attention"] == "bidirectional"
    assert "is_causal" not in DFlashConfig.from_dict(d).to_dict()
    with pytest.raises(ConfigError, match="full-attention layers included"):
        DFlashConfig.from_dict({**d, "is_causal": True})


def test_quantization_is_part_of_the_config():
    d = load("config_flat.json")
    cfg = DFlashConfig.from_dict({**d, "quantization": {"bits": 4, "group_size": 64}})
    assert cfg.quantization == {"bits": 4, "group_size": 64, "mode": "affine"}
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    assert "quantization" not in DFlashConfig.from_dict(d).to_dict()
    with pytest.raises(ConfigError, match="MLX affine quantization"):
        DFlashConfig.from_dict({**d, "quantization": {"bits": 4, "group_size": 48}})


@pytest.mark.parametrize("arch, theta", [("qwen3", 10000.0), ("llama", 500000.0), ("qwen3_5_vl", 10000.0)])
def test_one_resolver_takes_the_targets_shape_and_rope_base(arch, theta):
    """Heads / KV heads / head dim / MLP / eps / RoPE base from the target's config (Qwen3.5: its nested text
    tower, whose partial rotary is not copied); a keyword overrides; param count and FLOPs match the model."""
    from models.config import TargetShape
    from models.drafter import DFlashDraftModel
    from models.tiny import tiny_target

    shape = TargetShape.from_config(tiny_target(arch).config.to_dict())
    assert (shape.hidden_size, shape.num_layers, shape.num_attention_heads, shape.head_dim, shape.rope_theta) == \
        (64, 8, 4, 16, theta)
    cfg = DFlashConfig.for_target(shape, mask_token_id=280, num_hidden_layers=2, num_taps=3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (4, 2, 16, 128)
    assert cfg.rope_theta == theta and cfg.to_dict()["rope_parameters"] == {"rope_type": "default", "rope_theta": theta}
    assert cfg.target_layer_ids == default_layer_ids(8, 3) and cfg.max_position_embeddings == 4096
    assert DFlashConfig.for_target(shape, mask_token_id=280, rope_theta=1e6).rope_theta == 1e6
    assert cfg.num_parameters() == DFlashDraftModel(cfg).num_parameters
    # 2 layers x (2 x (q,k,v,o + MLP MACs) + 2 x 2 x heads x head_dim x 100 keys) + LM head 2 x 64 x 288
    assert cfg.flops_per_token(100) == 2 * (2 * (64 * 16 * 12 + 3 * 64 * 128) + 4 * 4 * 16 * 100) + 2 * 64 * 288


def test_resolver_without_a_target_needs_the_target_facts():
    with pytest.raises(ConfigError, match="hidden_size"):
        DFlashConfig.for_target(mask_token_id=0)
    cfg = DFlashConfig.for_target(hidden_size=4096, vocab_size=151936, num_target_layers=36,
                                  max_position_embeddings=40960, mask_token_id=151669)
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.rope_theta, cfg.target_layer_ids) == \
        (32, 128, 1e6, [1, 9, 17, 25, 33])


def test_mask_token_resolution_order():
    """Tokenizer's own mask token > first spare row > reserved special (no spare row) > error."""
    from models.mask_token import resolve_mask_token
    from models.tiny import TINY_VOCAB, tiny_tokenizer

    assert resolve_mask_token(TINY_VOCAB, tiny_tokenizer()).id == 265  # spare row (Qwen3-like)
    own = resolve_mask_token(TINY_VOCAB, tiny_tokenizer(mask_token="<|mask|>"))
    assert (own.id, own.token) == (265, "<|mask|>") and "own mask token" in own.reason
    llama = resolve_mask_token(TINY_VOCAB, tiny_tokenizer("llama3", reserved=TINY_VOCAB - 265))
    assert (llama.id, llama.token) == (265, "<|reserved_special_token_0|>") and "reserved" in llama.reason
    explicit = resolve_mask_token(TINY_VOCAB, tiny_tokenizer("llama3", reserved=TINY_VOCAB - 265), explicit=287)
    assert explicit.id == 287 and "explicitly" in explicit.reason
    assert resolve_mask_token(TINY_VOCAB, tiny_tokenizer(), explicit=280).id == 280  # a spare row


def test_each_mask_rule_gives_its_id_name_and_printed_reason():
    """The choice is printed with its reason: a spare row has no name, a given special token is named; the very
    last embedding row is still a spare row."""
    from models.mask_token import MaskChoice, resolve_mask_token
    from models.tiny import TINY_VOCAB, tiny_tokenizer

    assert choose_mask_token(10, range(9)) == 9
    assert resolve_mask_token(266, tiny_tokenizer()) == \
        MaskChoice(265, None, "the first embedding row the tokenizer never emits")
    llama = tiny_tokenizer("llama3", reserved=TINY_VOCAB - 265)
    assert resolve_mask_token(TINY_VOCAB, llama, explicit=287) == MaskChoice(
        287, "<|reserved_special_token_22|>", "given explicitly (the special token '<|reserved_special_token_22|>')")
    assert resolve_mask_token(TINY_VOCAB, tiny_tokenizer(), explicit=280) == \
        MaskChoice(280, None, "given explicitly (a spare embedding row)")


def test_the_declared_mask_token_counts_whatever_its_name_and_only_when_usable():
    """The tokenizer's declared mask token wins over a mask-named special at a lower id and over a spare row,
    even under a name no list knows; one the data produces is passed over for the first spare row."""
    from models.mask_token import MaskChoice, resolve_mask_token
    from models.tiny import TINY_VOCAB, tiny_tokenizer

    tok = tiny_tokenizer(mask_token="<|block_fill|>")  # id 265
    assert resolve_mask_token(TINY_VOCAB, tok) == MaskChoice(265, "<|block_fill|>", "the tokenizer's own mask token")
    assert resolve_mask_token(TINY_VOCAB, tok, produced_ids={265}) == \
        MaskChoice(266, None, "the first embedding row the tokenizer never emits")
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[MASK]"]})  # 265
    tok.add_special_tokens({"mask_token": "<|block_fill|>"})  # 266, the declared one
    assert resolve_mask_token(TINY_VOCAB, tok).id == 266


def test_an_unused_special_token_in_any_case_is_a_reserved_token():
    """Gemma-style ``<unused0>`` tokens count as reserved, whatever their case, when no spare row exists."""
    from models.mask_token import resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3")
    tok.add_special_tokens({"additional_special_tokens": ["<UNUSED_0>"]})  # 265, the last row
    got = resolve_mask_token(len(tok), tok)
    assert (got.id, got.token) == (265, "<UNUSED_0>") and got.reason.startswith("a reserved special token")


def test_tokens_the_rendered_template_produces_are_never_the_mask():
    """A template may produce a special token it never spells out: both a rendered conversation (its assistant
    turn) and a generation prompt are rendered, and what they produce is refused."""
    from models.mask_token import forbidden_mask_ids, resolve_mask_token
    from models.tiny import tiny_tokenizer

    tok = tiny_tokenizer("llama3", reserved=23)  # no spare row: 265.. are reserved specials
    tok.chat_template = (
        "{% for m in messages %}{{ m.content }}"
        "{% if m.role == 'assistant' %}{{ '<|reserved_special_token_' ~ 1 ~ '|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|reserved_special_token_' ~ 0 ~ '|>' }}{% endif %}")
    bad = forbidden_mask_ids(tok)
    assert bad[265] == bad[266] == bad[tok.convert_tokens_to_ids("u")] == "produced by the chat template"
    assert 267 not in bad
    assert resolve_mask_token(288, tok).id == 267
    # A tokenizer without a chat template renders nothing: only its named specials are forbidden.
    tok.chat_template = None
    assert forbidden_mask_ids(tok) == {264: "eos token", 256: "pad token"}


def test_every_training_key_is_in_the_readme_table():
    """The README's recipe-keys table is where users look a key up: a key added without a row is
    a key nobody finds (`--help` lists names only)."""

    from train.config import valid_keys

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme[readme.index("Recipe keys ("):readme.index("Modes (each has an end-to-end test")]
    # A row's first cell names its keys: `section.key` first, then the same section's keys by
    # their short names (`target.path`, `revision`); a short name counts only in a row of its own
    # section, so `target.dtype` is not found through `features.dtype`'s row.
    rows = [re.findall(r"`([^`]+)`", line.split("|")[1])
            for line in table.splitlines() if line.startswith("| `")]

    def has_row(key):
        section, _, name = key.rpartition(".")
        return any(key in names or (section and name in names
                                    and any(n.startswith(section + ".") for n in names))
                   for names in rows)

    sections = {k for k in valid_keys() if any(o.startswith(k + ".") for o in valid_keys())}
    missing = [k for k in valid_keys() if k not in sections and k != "recipe" and not has_row(k)]
    assert not missing, f"keys without a README row: {missing}"


def test_a_mask_named_special_token_is_found_whatever_its_case():
    """A special token named ``[MASK]`` (BERT style) that the tokenizer does not declare as its mask
    token is still its own mask token, ahead of a spare row."""
    from models.mask_token import resolve_mask_token
    from models.tiny import TINY_VOCAB, tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[MASK]"]})
    assert tok.mask_token_id is None
    got = resolve_mask_token(TINY_VOCAB, tok)
    assert (got.id, got.token, got.reason) == (265, "[MASK]", "the tokenizer's own mask token")


def test_every_id_of_a_list_valued_special_is_forbidden_as_the_mask():
    """A tokenizer may give several EOS ids: each of them is refused, not only the first."""
    import types

    from models.mask_token import forbidden_mask_ids

    tok = types.SimpleNamespace(eos_token_id=[5, 7], pad_token_id=9, bos_token_id=None, unk_token_id=None,
                                chat_template=None)
    assert forbidden_mask_ids(tok, produced_ids=[11]) == {5: "eos token", 7: "eos token", 9: "pad token",
                                                          11: "present in the training data"}
    # One id with several roles keeps the first reason (EOS before pad); BOS and UNK are refused too.
    tok = types.SimpleNamespace(eos_token_id=5, pad_token_id=5, bos_token_id=6, unk_token_id=7, chat_template=None)
    assert forbidden_mask_ids(tok, produced_ids=[5, 8]) == {5: "eos token", 6: "bos token", 7: "unk token",
                                                            8: "present in the training data"}


def test_named_specials_outside_the_added_tokens_still_count():
    """A tokenizer may list a special id that its added tokens do not hold: it is emitted, it is special (a
    proper mask, no warning), and an ordinary vocabulary entry is not."""
    import types

    from models.mask_token import mask_problem, resolve_mask_token

    tok = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1}, all_special_ids=[2], added_tokens_decoder={},
                                convert_ids_to_tokens=lambda i: {0: "a", 1: "b", 2: "<reserved_2>"}[i],
                                eos_token_id=None, pad_token_id=None, bos_token_id=None, unk_token_id=None,
                                chat_template=None)
    assert tokenizer_emitted_ids(tok) == {0, 1, 2}
    assert mask_problem(tok, 2) is None and mask_problem(tok, 1) == "an ordinary text token"
    got = resolve_mask_token(3, tok)
    assert (got.id, got.token) == (2, "<reserved_2>") and got.reason.startswith("a reserved special token")
