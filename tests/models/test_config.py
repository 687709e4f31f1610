"""The canonical drafter config: both layouts, the written schema, the layer-id rule, every validation."""

import json
import re
from pathlib import Path

import pytest

from models.config import DFlashConfig, default_layer_ids
from models.config_keys import ConfigError
from models.mask_token import choose_mask_token, tokenizer_emitted_ids

FIXTURES = Path(__file__).parents[1] / "fixtures"

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


def test_taps_are_written_and_read_in_ascending_order(tmp_path):
    """Features are joined in ascending layer order by every engine, so the ids are strictly increasing everywhere
    (an out-of-order list is refused: tests/models/test_bad_inputs.py) and kept as given when written and read."""
    cfg = DFlashConfig.for_target(hidden_size=64, vocab_size=300, num_target_layers=8, max_position_embeddings=512,
                                  mask_token_id=290, head_dim=16, num_taps=3)
    cfg = DFlashConfig.from_dict({**cfg.to_dict(), "dflash_config": {**cfg.to_dict()["dflash_config"],
                                                                      "target_layer_ids": [1, 3, 5]}})
    assert cfg.to_dict()["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    cfg.save(tmp_path)
    assert DFlashConfig.load(tmp_path).target_layer_ids == [1, 3, 5]


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
    from models.target_shape import TargetShape
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


def test_every_training_key_is_in_the_docs_table():
    """docs/training.md's recipe-keys table is where users look a key up: a key added without a row is
    a key nobody finds (`--help` lists names only)."""

    from train.config import valid_keys

    readme = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
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
    assert not missing, f"keys without a row in docs/training.md: {missing}"


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


@pytest.mark.parametrize("layers,taps", [(7, 5), (3, 2), (36, 0)])
def test_too_few_layers_or_no_taps_is_refused_not_collapsed(layers, taps):
    # 7 layers leave only [1, 4] for 5 taps: the rule would tap layer 2 twice; 0 taps would return [].
    with pytest.raises(ConfigError) as err:
        default_layer_ids(layers, taps)
    assert err.value.field == ("num_taps" if taps == 0 else "num_target_layers")


def test_the_shallowest_target_for_n_taps_taps_every_layer_from_1_to_l_minus_3():
    assert default_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert default_layer_ids(5, 2) == [1, 2]


def cfg_dict(**kw):
    """The flat fixture with ``kw`` set at top level (None deletes a key)."""
    d = load("config_flat.json")
    for k, v in kw.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def test_written_engine_values_are_exact():
    d = DFlashConfig.from_dict(load("config_flat.json")).to_dict()
    assert d["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert d["tie_word_embeddings"] is False and d["num_target_layers"] == 36
    assert d["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "block_size": 16,
                                  "sliding_block_attention": "bidirectional"}


def test_mlx_quantization_is_written_under_both_keys_and_mlx_only_drops_auto_map():
    from models.config_layout import mlx_only

    d = DFlashConfig.from_dict(cfg_dict(quantization={"bits": 4, "group_size": 64})).to_dict()
    assert d["quantization"] == d["quantization_config"] == {"bits": 4, "group_size": 64, "mode": "affine"}
    mlx = mlx_only(d)
    assert "auto_map" not in mlx and mlx["quantization"] == d["quantization"]
    assert set(mlx) == set(d) - {"auto_map"}


@pytest.mark.parametrize("q", [{"bits": 16, "group_size": 64}, {"bits": 4, "group_size": 64, "mode": "mxfp4"}])
def test_quantization_that_is_not_mlx_affine_is_refused(q):
    with pytest.raises(ConfigError, match="MLX affine"):
        DFlashConfig.from_dict(cfg_dict(quantization=q))


def test_describe_quantization_names_bits_mode_and_group():
    from models.config_layout import describe_quantization

    assert describe_quantization({"bits": 4, "group_size": 64}) == "4-bit affine, group 64"
    assert describe_quantization({"quant_method": "fp8"}) == "fp8"
    assert describe_quantization(None) is None and describe_quantization({}) is None


def test_a_sliding_drafter_writes_use_sliding_window_and_reads_its_window_from_layer_types_alone():
    types = ["sliding_attention", "full_attention"] * 2 + ["full_attention"]
    cfg = DFlashConfig.from_dict(cfg_dict(layer_types=types, sliding_window=64, use_sliding_window=None,
                                          is_causal=False))
    assert cfg.sliding_window == 64 and cfg.sliding_block_attention == "bidirectional"
    d = cfg.to_dict()
    assert d["use_sliding_window"] is True and d["sliding_window"] == 64 and d["is_causal"] is False
    assert DFlashConfig.from_dict(d) == cfg


def test_a_window_without_sliding_layers_is_dropped_and_the_block_stays_bidirectional():
    # Qwen3 configs carry sliding_window=4096 with use_sliding_window=false: no layer slides.
    cfg = DFlashConfig.from_dict(cfg_dict(sliding_window=4096))
    assert cfg.sliding_window is None and cfg.sliding_block_attention == "bidirectional"
    assert "is_causal" not in cfg.to_dict()


def test_use_sliding_window_without_layer_types_is_refused():
    with pytest.raises(ConfigError) as err:
        DFlashConfig.from_dict(cfg_dict(layer_types=None, use_sliding_window=True, sliding_window=64))
    assert err.value.field == "layer_types"


def test_omitted_shape_keys_fall_back_to_the_attention_shape_and_dtype_alias():
    d = cfg_dict(head_dim=None, num_key_value_heads=None, torch_dtype=None, dtype="float16")
    cfg = DFlashConfig.from_dict(d)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.torch_dtype) == (4096 // 32, 32, "float16")
    assert DFlashConfig.from_dict(cfg_dict(head_dim=None, hidden_size=2048)).head_dim == 64


def test_every_key_may_sit_at_top_level_only():
    # Older exports put the DFlash keys flat; rope_scaling is the transformers 4 spelling of rope_parameters.
    d = cfg_dict(dflash_config=None, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], rope_theta=None,
                 rope_scaling={"type": "default", "rope_theta": 5e5})
    cfg = DFlashConfig.from_dict(d)
    assert (cfg.mask_token_id, cfg.target_layer_ids, cfg.block_size, cfg.rope_theta) == \
        (151669, [1, 9, 17, 25, 33], 16, 5e5)
    with pytest.raises(ConfigError, match="plain full-head RoPE"):
        DFlashConfig.from_dict({**d, "rope_scaling": {"type": "yarn", "rope_theta": 5e5}})


@pytest.mark.parametrize("change,field", [
    ({"head_dim": 127}, "head_dim"),
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"layer_types": ["full_attention"] * 4 + ["linear_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 5, "sliding_window": 0}, "sliding_window"),
    ({"layer_types": ["sliding_attention"] * 5, "sliding_window": -64}, "sliding_window"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"intermediate_size": None}, "intermediate_size"),  # named, not a KeyError
    ({"dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 9]}}, "target_layer_ids"),
    ({"dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1], "sliding_block_attention": "full"}},
     "sliding_block_attention"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
])
def test_each_bad_value_is_refused_by_field(change, field):
    with pytest.raises(ConfigError) as err:
        DFlashConfig.from_dict(cfg_dict(**change))
    assert err.value.field == field


def test_layer_zero_and_the_layer_before_the_last_may_be_tapped():
    cfg = DFlashConfig.from_dict(cfg_dict(dflash_config={"mask_token_id": 0, "target_layer_ids": [0, 34]}))
    assert cfg.target_layer_ids == [0, 34] and cfg.mask_token_id == 0


def test_replace_refuses_an_unknown_field_and_load_names_a_truncated_file(tmp_path):
    cfg = DFlashConfig.from_dict(load("config_flat.json"))
    assert cfg.replace(block_size=8).block_size == 8
    with pytest.raises(ConfigError) as err:
        cfg.replace(blocksize=8)
    assert err.value.field == "blocksize"
    (tmp_path / "config.json").write_text('{"hidden_size": 4')
    with pytest.raises(ConfigError, match="not valid JSON"):
        DFlashConfig.load(tmp_path)


def test_resolver_takes_the_targets_eps_and_head_dim_and_derives_heads_from_head_dim():
    from models.target_shape import TargetShape

    shape = TargetShape(hidden_size=2048, vocab_size=1000, num_layers=36, num_attention_heads=16, head_dim=256,
                        num_key_value_heads=4, rms_norm_eps=1e-5, intermediate_size=6144)
    cfg = DFlashConfig.for_target(shape, mask_token_id=999)
    assert (cfg.head_dim, cfg.rms_norm_eps, cfg.num_key_value_heads, cfg.target_layer_ids) == \
        (256, 1e-5, 4, [1, 9, 17, 25, 33])
    bare = DFlashConfig.for_target(hidden_size=4096, vocab_size=1000, num_target_layers=36, mask_token_id=0,
                                   head_dim=64)
    assert (bare.num_attention_heads, bare.num_key_value_heads) == (64, 64)


def test_target_shape_reads_explicit_head_dim_and_the_full_attention_rope_block():
    from models.target_shape import TargetShape

    shape = TargetShape.from_config({"hidden_size": 2560, "vocab_size": 1000, "num_hidden_layers": 34,
                                     "num_attention_heads": 8, "head_dim": 256, "rope_parameters": {
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}})
    assert (shape.head_dim, shape.rope_theta) == (256, 1e6)
    assert TargetShape.from_config({"hidden_size": 64, "vocab_size": 10, "num_hidden_layers": 8,
                                    "num_attention_heads": 4, "rope_theta": 5e5,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}).rope_theta == 5e5


def test_a_drafter_config_is_known_by_its_architecture_or_its_dflash_block():
    from models.config_layout import is_drafter_config

    assert is_drafter_config({"architectures": ["DFlashDraftModel"]})
    assert is_drafter_config({"architectures": ["Qwen3ForCausalLM"], "dflash_config": {"block_size": 16}})
    assert not is_drafter_config({"architectures": ["Qwen3ForCausalLM"]})
    assert not is_drafter_config([{"architectures": ["DFlashDraftModel"]}])


def test_flops_without_the_lm_head():
    cfg = DFlashConfig.from_dict(load("config_flat.json"))
    assert cfg.flops_per_token(0) - cfg.flops_per_token(0, lm_head=False) == 2 * 4096 * 151936
    assert cfg.flops_per_token(1, lm_head=False) - cfg.flops_per_token(0, lm_head=False) == 5 * 4 * 32 * 128


# Kimi K2.5's published shapes (moonshotai/Kimi-K2.5 text_config; DeepSeek-V3's differs in heads and vocab)
KIMI_TEXT = {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
             "num_attention_heads": 64, "num_key_value_heads": 64, "intermediate_size": 18432, "kv_lora_rank": 512,
             "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
             "head_dim": 64, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
             "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}}


@pytest.mark.parametrize("config, heads", [({"model_type": "kimi_k25", "text_config": KIMI_TEXT}, 64),
                                           ({**KIMI_TEXT, "model_type": "deepseek_v3", "num_attention_heads": 128,
                                             "num_key_value_heads": 128, "vocab_size": 129280}, 128)])
def test_latent_attention_targets_give_the_published_kimi_drafter_shape(config, heads):
    """MLA configs say head_dim = the rope width (64) and as many KV heads as query heads: the drafter takes the
    value-head width (128) and 8 KV heads instead, z-lab's Kimi-K2.5 drafter (64 x 128 heads, 8 KV heads, MLP
    18432, 6 taps [1, 12, 24, 35, 47, 58], RoPE base 50000); about 3.5B parameters with 6 layers."""
    from models.target_shape import TargetShape

    shape = TargetShape.from_config(config)
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (heads, 8, 128)
    cfg = DFlashConfig.for_target(shape, mask_token_id=128815, num_hidden_layers=6, num_taps=6, block_size=8)
    assert cfg.target_layer_ids == [1, 12, 24, 35, 47, 58] and cfg.intermediate_size == 18432
    assert cfg.rope_theta == 50000.0 and cfg.to_dict()["rope_parameters"]["rope_type"] == "default"
    if heads == 64:
        assert 3.4e9 < cfg.num_parameters() < 3.6e9  # the published folder: 6.48 GiB of bf16


def test_a_kimi_shaped_drafter_folder_without_its_yarn_block_loads(tmp_path):
    """A drafter folder with the published Kimi-K2.5 drafter's keys (flat layout, block 8, mask 163838) loads.
    The published config also carries the target's YaRN block (rope_scaling), which this reader refuses for now
    (the drafters' RoPE is plain): the test folder leaves it out."""
    d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168, "vocab_size": 163840,
         "head_dim": 128, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 6,
         "intermediate_size": 18432, "num_target_layers": 61, "max_position_embeddings": 262144,
         "rope_theta": 50000.0, "block_size": 8, "rms_norm_eps": 1e-5,
         "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = DFlashConfig.load(tmp_path)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_key_value_heads, cfg.target_layer_ids[-1]) == (8, 163838, 8, 58)
    with pytest.raises(ConfigError, match="plain full-head RoPE"):
        DFlashConfig.from_dict({**d, "rope_scaling": {"rope_type": "yarn", "factor": 64.0}})


def _chat_tokenizer(controls: list[str], template: str, fill: bool, unk: str | None = None):
    """The tiny byte tokenizer with a family's chat-control tokens and template; ``fill``: reserved specials after
    them up to the 288 embedding rows (no spare row, as Kimi's 163840), then ``unk``."""
    from models.tiny import TINY_VOCAB, tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": controls})
    reserved = TINY_VOCAB - len(tok) - bool(unk) if fill else 0
    tok.add_special_tokens({"additional_special_tokens": [f"<|reserved_token_{i}|>" for i in range(reserved)]})
    if unk:
        tok.add_special_tokens({"unk_token": unk})
    tok.chat_template = template
    return tok


def test_kimi_and_deepseek_control_tokens_are_never_the_mask():
    """Kimi K2.5's template writes <|im_system|> / <|im_user|> / <|im_assistant|> / <|im_middle|> / <|im_end|> and
    its vocabulary has no spare row: the mask is a reserved token, never a control token; an explicit control token
    is refused, an explicit UNK (the published drafter's 163838 is Kimi's [UNK]) is taken. DeepSeek-V3's template
    (<｜User｜>, <｜Assistant｜>, <｜end▁of▁sentence｜>) leaves spare rows: the first one."""
    from models.mask_token import resolve_mask_token

    kimi_controls = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]
    kimi = _chat_tokenizer(kimi_controls, (
        "{% for m in messages %}{% if m.role == 'system' %}<|im_system|>system<|im_middle|>{% elif m.role == 'user' %}"
        "<|im_user|>user<|im_middle|>{% else %}<|im_assistant|>assistant<|im_middle|>{% endif %}{{ m.content }}"
        "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"),
        fill=True, unk="[UNK]")
    assert len(kimi) == 288
    controls = {kimi.convert_tokens_to_ids(t) for t in kimi_controls}
    choice = resolve_mask_token(288, kimi)
    assert choice.id not in controls and choice.token == "<|reserved_token_0|>" and "reserved" in choice.reason
    for control in sorted(controls):
        with pytest.raises(ConfigError, match="chat-control token|produced by the chat template|eos token"):
            resolve_mask_token(288, kimi, explicit=control)
    unk = kimi.convert_tokens_to_ids("[UNK]")
    assert resolve_mask_token(288, kimi, explicit=unk).id == unk
    with pytest.raises(ConfigError, match="present in the training data"):
        resolve_mask_token(288, kimi, explicit=unk, produced_ids={unk})

    deepseek_controls = ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]
    deepseek = _chat_tokenizer(deepseek_controls, (
        "<｜begin▁of▁sentence｜>{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
        "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% else %}{{ m.content }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"), fill=False)
    choice = resolve_mask_token(288, deepseek)
    assert choice.id == len(deepseek) == 269 and choice.token is None  # the first spare row
