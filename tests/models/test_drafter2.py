"""The torch DFlash2 drafter against z-lab's reference (golden numbers), the v1 drafter, and its folders on disk."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from models.config import DFlashConfig
from models.drafter import DFlashDraftModel, DraftCache
from models.drafter2 import DFlash2DraftModel, edge, load_drafter, new_drafter, select
from tests.helpers import assert_close
from tests.helpers.dflash2 import (TEMPERATURE, block_calls, golden, golden_config, max_diff_by_token,
                                   published_folder,
                                   random_dflash2, target_parts, tiny_dflash2_config, uniform_for)


def bound(model):
    embed, head = target_parts()
    lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False)
    lm_head.weight.data = head
    return model.bind_target(nn.Embedding.from_pretrained(embed), lm_head)


def proposals(model, case):
    """Both golden proposals (the second through the cache), with every number the golden file holds."""
    cache, rows = DraftCache(model.config.num_hidden_layers), []
    for n, (ids, feats, pos) in enumerate(block_calls(), 1):
        layers = []
        hooks = [layer.register_forward_hook(lambda _m, _i, out: layers.append(out)) for layer in model.layers]
        with torch.no_grad():
            hidden = model(model.embed(ids), feats, pos, cache=cache)
            logits = model.logits(hidden[:, 1:])
            greedy = model.propose(hidden[:, 1:], ids[:, 0])
            q = torch.softmax(greedy.scores / TEMPERATURE, -1)
            u = uniform_for(greedy.tokens.numpy(), greedy.candidates.numpy(), q.numpy())
            sampled = model.propose(hidden[:, 1:], ids[:, 0], TEMPERATURE, torch.from_numpy(u).float())
        for h in hooks:
            h.remove()
        rows.append(dict(prefix=f"{case}.block{n}.", hidden=hidden, layers=layers, logits=logits, greedy=greedy,
                         sampled=sampled, cache=cache.lengths()))
    return rows


@pytest.mark.parametrize("case", ["A", "B"])  # B: output_multiplier 1.5 and soft-cap 30
def test_matches_the_reference_drafter_on_both_blocks(tmp_path, case):
    """Hidden states, logits, top-K sets and values, selector scores and q (by token id), greedy tokens: the
    published folder loaded by our loader, block 2 continuing block 1's cache."""
    out = golden("outputs")
    model = bound(DFlash2DraftModel.from_pretrained(published_folder(tmp_path, case)))
    assert model.config.torch_dtype == "float32" and next(model.parameters()).dtype == torch.float32
    for row, context in zip(proposals(model, case), (11, 14)):
        ref = lambda name: out[row["prefix"] + name]  # noqa: B023, E731
        assert row["cache"] == [context, context]  # context only: the block's keys are never kept
        assert_close(row["hidden"], ref("final_hidden"), 1e-5, row["prefix"] + "final hidden (all slots)")
        for i, layer_out in enumerate(row["layers"]):
            assert_close(layer_out, ref(f"layer{i}.out"), 1e-5, row["prefix"] + f"layer {i}")
        assert_close(row["logits"], ref("logits"), 1e-5, row["prefix"] + "logits")
        greedy, sampled = row["greedy"], row["sampled"]
        unary = row["logits"].gather(-1, greedy.candidates)
        assert max_diff_by_token(greedy.candidates, unary, ref("unary_topk_indices_sorted"),
                                 ref("unary_topk_values_sorted")) <= 1e-5
        assert max_diff_by_token(greedy.candidates, greedy.scores, ref("unary_topk_indices_sorted"),
                                 ref("selector_scores_sorted_by_unary")) <= 1e-5
        assert torch.equal(greedy.tokens, ref("selector_tokens")), row["prefix"] + "selector tokens"
        # teacher forcing: every slot scored at once with the given previous tokens as predecessors
        selector, ids = model.candidate_selector, block_calls()[int(row["prefix"][-2]) - 1][0]
        previous = torch.cat([ids[:, :1], greedy.tokens[:, :-1]], 1)
        with torch.no_grad():
            forced = unary + edge(selector.hidden_projection(row["hidden"][:, 1:]), previous, greedy.candidates,
                                  selector.predecessor_codebook, selector.successor_codebook)
        assert_close(forced, greedy.scores, 1e-6, "teacher-forced scores vs the walk's")
        assert torch.equal(row["logits"].argmax(-1), ref("argmax_tokens")), row["prefix"] + "argmax tokens"
        assert greedy.q is None and torch.equal(sampled.tokens, greedy.tokens)
        assert max_diff_by_token(sampled.candidates, sampled.q, ref("unary_topk_indices_sorted"),
                                 ref("q_T0.7_greedy_predecessors_sorted_by_unary")) <= 1e-5


def test_identity_convs_give_exactly_the_v1_hidden_states(tmp_path):
    """The reference's own weights with identity convs: bit-equal to our v1 drafter on the same backbone, and to
    the reference's identity-conv and v1 numbers."""
    out = golden("outputs")
    v2 = DFlash2DraftModel.from_pretrained(published_folder(tmp_path))
    for layer in v2.layers:
        layer.attention_conv.reset_to_identity()
        layer.mlp_conv.reset_to_identity()
    v1 = DFlashDraftModel(v2.config.as_variant("dflash")).eval()
    v1.load_state_dict({k: v for k, v in v2.state_dict().items() if k in v1.state_dict()})
    ids, feats, pos = block_calls()[0]
    embed, _ = target_parts()
    with torch.no_grad():
        h2, h1 = v2(embed[ids], feats, pos), v1(embed[ids], feats, pos)
    assert torch.equal(h2, h1)
    assert_close(h2, out["A.block1.final_hidden_identity_conv"], 1e-5, "identity convs vs the reference")
    assert_close(h1, out["A.block1.final_hidden_v1"], 1e-5, "v1 vs the reference's v1")


def test_a_new_drafter_starts_as_v1_with_the_unary_ranking():
    """Fresh weights: identity convs and an edge term of exactly 0, so the walk is the unary argmax."""
    torch.manual_seed(0)
    model = bound(new_drafter(tiny_dflash2_config())).eval()
    for layer in model.layers:
        conv = layer.attention_conv
        assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
        assert not conv.base_kernel[:, 1:].any() and not conv.kernel_projection.weight.any()
    selector = model.candidate_selector
    assert not selector.hidden_projection.weight.any() and selector.successor_codebook.std() > 0.01
    g = torch.Generator().manual_seed(2)
    feats, emb = torch.randn(1, 6, model.config.fc_in_features, generator=g), torch.randn(1, 8, 64, generator=g)
    with torch.no_grad():
        hidden = model(emb, feats, torch.arange(14)[None])
        proposal = model.propose(hidden[:, 1:], torch.tensor([5]))
    assert torch.equal(proposal.tokens, model.logits(hidden[:, 1:]).argmax(-1))
    # not stuck there: a loss on the scores moves hidden_projection first (the codebooks once it has moved)
    hidden = model(emb, feats, torch.arange(14)[None])
    model.propose(hidden[:, 1:], torch.tensor([5])).scores.logsumexp(-1).sum().backward()
    assert selector.hidden_projection.weight.grad.abs().max() > 0
    assert not selector.predecessor_codebook.grad.any() and not selector.successor_codebook.grad.any()


def test_a_packed_training_row_convolves_each_block_alone():
    """Two blocks in one row, the training mask: the reference's numbers with block-local convs, not the ones
    its conv gives over the whole row."""
    out, (b1, b2) = golden("outputs"), block_calls()
    model = DFlash2DraftModel(DFlashConfig.from_dict(golden_config("A")))
    model.load_state_dict(model.state_from_disk({k: v for k, v in golden("weights").items()
                                                 if not k.startswith("target.")}))
    embed, _ = target_parts()
    ids = torch.cat([b1[0], b2[0]], 1)
    with torch.no_grad():
        hidden = model.eval()(embed[ids], torch.cat([b1[1], b2[1]], 1), out["A.packed.position_ids"],
                              attention_mask=out["A.packed.attention_mask"].bool())
    assert_close(hidden, out["A.packed.final_hidden_block_local_conv"], 1e-5, "packed row, block-local convs")
    assert (hidden - out["A.packed.final_hidden_reference_conv_crosses_blocks"]).abs().max() > 1


def test_block_two_of_a_packed_row_does_not_depend_on_block_one():
    """A planted boundary: new tokens in block 1 leave block 2 exactly as it was (its attention never sees
    block 1, and its first slot's conv tap stops at its own start), and block 2 equals its inference pass."""
    cfg = tiny_dflash2_config(conv_kernel_size=3)
    model = random_dflash2(cfg)
    g = torch.Generator().manual_seed(1)
    feats, emb = torch.randn(1, 12, cfg.fc_in_features, generator=g), torch.randn(1, 16, 64, generator=g)
    anchors = (4, 9)
    pos = torch.cat([torch.arange(12), torch.arange(4, 12), torch.arange(9, 17)])[None]
    mask = torch.zeros(1, 1, 16, 28, dtype=torch.bool)
    for b, a in enumerate(anchors):
        mask[..., 8 * b:8 * b + 8, :a] = True
        mask[..., 8 * b:8 * b + 8, 12 + 8 * b:20 + 8 * b] = True
    changed = emb.clone()
    changed[0, :8] = torch.randn(8, 64, generator=g)
    with torch.no_grad():
        base, other = model(emb, feats, pos, attention_mask=mask), model(changed, feats, pos, attention_mask=mask)
        alone = model(emb[:, 8:], feats[:, :9], torch.arange(17)[None])
    assert torch.equal(base[:, 8:], other[:, 8:]), "block 2 depends on block 1's tokens"
    assert (base[:, :8] - other[:, :8]).abs().max() > 0.1
    assert_close(base[:, 8:], alone, 1e-5, "packed block 2 vs its inference pass")


def test_the_proposal_is_fixed_shape_with_no_host_read():
    """Traced with symbolic shapes, the walk (greedy and sampled) has no read of a device value to the host."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 7, 288, generator=g), torch.randn(2, 7, 8, generator=g), torch.randn(288, 8, generator=g),
            torch.randn(288, 8, generator=g), torch.tensor([1, 2]))
    for temperature in (0.0, 0.7):
        def walk(*a):
            p = select(*a, top_k=4, temperature=temperature, uniform=torch.full((2, 7), 0.5))
            return p.tokens, p.scores
        graph = make_fx(walk, tracing_mode="symbolic")(*args).graph
        assert not [n for n in graph.nodes if "local_scalar_dense" in str(n.target) or "nonzero" in str(n.target)]
        assert tuple(walk(*args)[0].shape) == (2, 7)


def test_sampling_draws_from_q_over_the_candidates():
    """q rows are distributions over the K candidates; a draw u picks the candidate whose CDF interval holds it."""
    g = torch.Generator().manual_seed(0)
    logits, proj = torch.randn(3, 5, 50, generator=g), torch.randn(3, 5, 6, generator=g)
    books = torch.randn(50, 6, generator=g), torch.randn(50, 6, generator=g)
    bonus = torch.tensor([1, 2, 3])
    low = select(logits, proj, *books, bonus, top_k=4, temperature=1.0, uniform=torch.zeros(3, 5))
    high = select(logits, proj, *books, bonus, top_k=4, temperature=1.0, uniform=torch.full((3, 5), 1 - 1e-7))
    assert_close(low.q.sum(-1), torch.ones(3, 5), 1e-6, "q sums")
    assert torch.equal(low.tokens[:, 0], low.candidates[:, 0, 0]) and torch.equal(high.tokens[:, 0],
                                                                                   high.candidates[:, 0, -1])
    assert torch.isin(low.tokens, low.candidates.flatten(1)).all()


# --------------------------------------------------------------------------- folders and warm starts
def test_reads_the_published_layout_and_the_references_weight_spelling(tmp_path):
    published = DFlash2DraftModel.from_pretrained(published_folder(tmp_path / "a"))
    suffixed = load_drafter(published_folder(tmp_path / "b", codebook_suffix=True))
    assert isinstance(suffixed, DFlash2DraftModel)
    for k, v in published.state_dict().items():
        assert torch.equal(v, suffixed.state_dict()[k]), k


def test_save_writes_the_published_names_and_reloads_bit_exact(tmp_path):
    model = random_dflash2(tiny_dflash2_config())
    model.save_pretrained(tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names == set(model.config.weight_shapes()) == set(model.state_dict())
    assert "candidate_selector.predecessor_codebook" in names and not any(k.endswith("codebook.weight") for k in names)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["architectures"] == ["DFlash2DraftModel"] and d["auto_map"]["AutoModel"].endswith(".DFlash2DraftModel")
    again = load_drafter(tmp_path)
    assert again.config == model.config
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


def test_init_from_a_v1_drafter_starts_a_v2_with_its_backbone(tmp_path):
    cfg = tiny_dflash2_config()
    torch.manual_seed(0)
    v1 = DFlashDraftModel(cfg.as_variant("dflash")).init_weights()
    v1.save_pretrained(tmp_path / "v1")
    torch.manual_seed(1)
    v2 = new_drafter(cfg, init_from=tmp_path / "v1").eval()
    for k, v in v1.state_dict().items():
        assert torch.equal(v, v2.state_dict()[k]), k
    g = torch.Generator().manual_seed(2)
    feats, emb = torch.randn(1, 6, cfg.fc_in_features, generator=g), torch.randn(1, 8, 64, generator=g)
    with torch.no_grad():
        assert torch.equal(v2(emb, feats, torch.arange(14)[None]), v1.eval()(emb, feats, torch.arange(14)[None]))
    v2.save_pretrained(tmp_path / "v2")
    again = new_drafter(cfg, init_from=tmp_path / "v2")  # a v2 from a v2: everything
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in v2.state_dict().items())


def test_weight_shapes_follow_the_published_formulas():
    """z-lab's published DFlash2 checkpoint (its fixture header: H 6656, 5 layers, 32 x 128 query heads, 8 KV
    heads, MLP 19968, vocab 202048, 5 taps, K 2, G 16, rank 256): our formulas give its shapes."""
    cfg = DFlashConfig(hidden_size=6656, intermediate_size=19968, num_hidden_layers=5, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=202048, num_target_layers=64,
                       target_layer_ids=[1, 16, 31, 46, 61], mask_token_id=202047, variant="dflash2")
    shapes = cfg.weight_shapes()
    published = {"fc.weight": (6656, 33280), "layers.4.self_attn.q_proj.weight": (4096, 6656),
                 "layers.4.self_attn.k_proj.weight": (1024, 6656), "layers.0.self_attn.o_proj.weight": (6656, 4096),
                 "layers.0.self_attn.q_norm.weight": (128,), "layers.0.mlp.gate_proj.weight": (19968, 6656),
                 "layers.0.mlp.down_proj.weight": (6656, 19968), "layers.2.attention_conv.base_kernel": (2, 2, 6656),
                 "layers.2.mlp_conv.kernel_projection.weight": (1664, 6656),
                 "candidate_selector.hidden_projection.weight": (256, 6656),
                 "candidate_selector.predecessor_codebook": (202048, 256),
                 "candidate_selector.successor_codebook": (202048, 256)}
    assert {k: shapes[k] for k in published} == published
    assert len(shapes) == 3 + 5 * (11 + 4) + 3
    per_layer_convs = 2 * (2 * 2 * 6656 + 2 * 2 * 6656 * 6656 // 16)
    assert cfg.parameter_counts()["convs"] == 5 * per_layer_convs
    assert cfg.parameter_counts()["total"] == sum(int(np.prod(s)) for s in shapes.values())
