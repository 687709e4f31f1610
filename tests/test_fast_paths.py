"""CPU checks of the speed paths: the direct BlockMask, the preallocated caches and the static loop.

Each fast path is compared with the generic one it replaces (same tiles, same tokens, same
acceptance lengths); the CUDA graph replay of the static loop is checked in ``test_cuda.py``.
"""

import logging

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from conftest import assert_close

from train.block_mask import direct_block_mask, documents_contiguous, tile_states
from train.objective import draw_blocks, flex_block_mask


def _tiles(bm) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-level ``(partial, full)`` dense maps of a BlockMask."""
    def dense(num, idx):
        out = torch.zeros(*num.shape, bm.kv_indices.shape[-1], dtype=torch.bool)
        for key in torch.cartesian_prod(*[torch.arange(d) for d in num.shape]):
            k = tuple(key.tolist())
            out[k][idx[k][: int(num[k])].long()] = True
        return out
    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


def _packed_rows(b: int, s: int, seed: int):
    """Rows of 1-3 packed documents, a prompt then an answer each, and padding at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (b, s), generator=g)
    lm = torch.zeros(b, s, dtype=torch.long)
    doc = torch.full((b, s), -1, dtype=torch.long)
    pos = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        end = s - int(torch.randint(0, s // 5, (1,), generator=g))
        n_cuts = int(torch.randint(0, 3, (1,), generator=g))
        cuts = sorted(set(torch.randint(end // 4, end - end // 4, (n_cuts,), generator=g).tolist()))
        bounds = [0, *cuts, end]
        for d, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
            doc[r, a:z], pos[r, a:z] = d, torch.arange(z - a)
            lm[r, a + (z - a) // 3:z] = 1
    return ids, lm, doc, pos


@pytest.mark.parametrize("s,anchors,block", [(300, 40, 16), (256, 24, 8), (130, 100, 4), (40, 6, 4)])
def test_direct_block_mask_equals_create_block_mask(s, anchors, block):
    """Same partial and full tiles as the generic builder, at tile-aligned and ragged lengths, with
    packed documents, padding and padding blocks (rows with fewer candidates than anchors)."""
    ids, lm, doc, pos = _packed_rows(3, s, seed=s + anchors)
    lm[0] = 0
    lm[0, 2:6] = 1  # row 0 has 3 candidates: padding blocks
    assert documents_contiguous(doc)
    blocks = draw_blocks(ids, lm, doc, pos, anchors, block, 95, torch.Generator().manual_seed(0))
    assert not bool(blocks.valid.all())
    _same_as_create_block_mask(blocks, doc, block)


def test_direct_block_mask_with_anchors_on_tile_edges():
    """Anchors at 127, 128, 255...: a context interval that ends exactly on a 128-key tile edge (a
    query tile whose first anchor is 127 sees keys 0..126, tile 0 partial, not full). Random draws
    almost never put an anchor there."""
    from train.objective import build_blocks

    s, block = 400, 16
    ids = torch.randint(0, 90, (1, s), generator=torch.Generator().manual_seed(0))
    lm, doc, pos = torch.ones(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long), torch.arange(s)[None]
    anchors = torch.tensor([[127, 128, 129, 130, 131, 132, 133, 134, 255, 256, 257, 1, 0, 383, 384, 126]])
    blocks = build_blocks(ids, lm, doc, pos, anchors, torch.ones_like(anchors, dtype=torch.bool), block, 95)
    _same_as_create_block_mask(blocks, doc, block)


@pytest.mark.parametrize("s,block,anchors,valid,second_doc", [
    # Every block of a query tile has the same anchor: 128 makes context tile 0 full and tile 1
    # empty, 129 makes tile 1 partial (it sees key 128 only), 256 makes tiles 0 and 1 full.
    (400, 16, [128] * 8 + [129] * 8 + [256] * 8, None, None),
    # s = 129 = 1 mod 16, 8 blocks: the last key (129 + 127 = 256) is alone in the last key tile.
    (129, 16, list(range(5, 125, 15)), None, None),
    # Padding blocks (valid False) whose anchors are not 0 see no context at all: only they reach
    # past key 100, so key tiles 1 and 2 stay empty for the first query tile.
    (300, 8, [3, 260, 10, 280, 20, 30, 40, 50, 60, 70, 80, 90, 95, 97, 98, 99],
     [True, False, True, False] + [True] * 12, None),
    # Anchors on the first token of the second document (key 200) see no context: not the first
    # document before it.
    (400, 16, [200] * 8 + [300] * 8, None, 200),
    # A block of 128 is one query tile; its keys 256..355 fill the ragged last key tile, which is
    # still partial (create_block_mask pads with False).
    (100, 128, [50, 90], None, None),
])
def test_direct_block_mask_on_uniform_query_tiles(s, block, anchors, valid, second_doc):
    """Tiles whose state hangs on one key: the end of the context interval (strictly before the
    anchor), the last key of a block, the start of a document and the empty context of padding
    blocks."""
    from train.objective import build_blocks

    ids = torch.randint(0, 90, (1, s), generator=torch.Generator().manual_seed(0))
    lm, doc, pos = torch.ones(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long), torch.arange(s)[None]
    if second_doc is not None:
        doc[:, second_doc:] = 1
        pos[:, second_doc:] -= second_doc
    a = torch.tensor([anchors])
    v = torch.ones_like(a, dtype=torch.bool) if valid is None else torch.tensor([valid])
    blocks = build_blocks(ids, lm, doc, pos, a, v, block, 95)
    _same_as_create_block_mask(blocks, doc, block)
    partial, full = tile_states(a, v, doc, block)
    if s == 400 and second_doc is None:  # the states themselves, not only agreement with the generic builder
        assert full[0, 0, 0, :3].tolist() == [True, False, False]
        assert partial[0, 0, 1, :3].tolist() == [False, True, False] and full[0, 0, 1, 0]
        assert full[0, 0, 2, :3].tolist() == [True, True, False] and not partial[0, 0, 2, 2]
    if second_doc is not None:  # query tile 0 (anchor 200) sees no context tile, tile 1 (300) sees 200..299
        assert not (partial[0, 0, 0, :3] | full[0, 0, 0, :3]).any()
        assert partial[0, 0, 1, :3].tolist() == [False, True, True] and not full[0, 0, 1, :3].any()
    if block == 128:
        assert partial[0, 0, 1, 2] and not full[0, 0, 1].any()


def _same_as_create_block_mask(blocks, doc, block: int) -> None:
    b, s = doc.shape
    n = blocks.num_blocks
    q_anchor = blocks.anchors.repeat_interleave(block, 1)
    q_doc = blocks.doc.repeat_interleave(block, 1)

    def mask_mod(bi, h, q, kv):
        kc = torch.clamp(kv, max=s - 1)
        ctx = (kv < s) & (kc < q_anchor[bi, q]) & (doc[bi, kc] == q_doc[bi, q])
        return ctx | ((kv >= s) & (torch.clamp(kv - s, min=0) // block == q // block))

    ref = create_block_mask(mask_mod, B=b, H=None, Q_LEN=n * block, KV_LEN=s + n * block, device="cpu")
    fast = direct_block_mask(blocks.anchors, blocks.valid, doc, block, mask_mod)
    for a, z, what in zip(_tiles(fast), _tiles(ref), ("partial", "full")):
        assert torch.equal(a, z), f"{what} tiles differ at {(a != z).nonzero()[:5].tolist()}"
    assert fast.seq_lengths == ref.seq_lengths
    assert torch.equal(fast.to_dense(), ref.to_dense())


def test_block_mask_falls_back_when_documents_repeat():
    """A document id that comes back after another one is not an interval: the generic builder runs."""
    ids, lm, doc, pos = _packed_rows(2, 200, seed=3)
    doc[0, 150:] = 0
    doc[0, 100:150] = 1
    assert not documents_contiguous(doc)
    blocks = draw_blocks(ids, lm, doc, pos, 16, 8, 95, torch.Generator().manual_seed(0))
    assert direct_block_mask(blocks.anchors, blocks.valid, doc, 8, lambda *a: None) is None
    bm = flex_block_mask(blocks, doc)  # still right: built the generic way
    partial, full = tile_states(blocks.anchors, blocks.valid, torch.zeros_like(doc), 8)
    assert bm.kv_num_blocks.shape == partial.sum(-1).shape
    # the trainer's answer from the host copy decides the same way, without looking at doc
    assert torch.equal(flex_block_mask(blocks, doc, contiguous=False).to_dense(), bm.to_dense())


def test_the_trainer_checks_document_runs_on_the_host_and_the_mask_agrees(monkeypatch):
    """draw_step records documents_contiguous of the token batch's host copy; the mask built with it
    equals the one that checks the device copy itself, and that check is not made again."""
    import train.block_mask as bm_module
    from train.objective import attention_masks

    ids, lm, doc, pos = _packed_rows(2, 200, seed=4)
    assert documents_contiguous(doc)
    blocks = draw_blocks(ids, lm, doc, pos, 16, 8, 95, torch.Generator().manual_seed(0))

    class Cfg:
        use_sliding_window = False

    checked = attention_masks(Cfg, blocks, doc, pos, True)
    calls = []
    real = bm_module.documents_contiguous
    monkeypatch.setattr(bm_module, "documents_contiguous", lambda d: calls.append(1) or real(d))
    given = attention_masks(Cfg, blocks, doc, pos, True, contiguous=True)
    assert calls == [] and torch.equal(given.to_dense(), checked.to_dense())



def test_causal_block_mask_has_no_full_tile_inside_a_block():
    """Blocks of 128 slots fill whole tiles: bidirectional, a block's own tile is full; causal inside the
    block, it is only partial, so flex_block_mask must build the tiles from the causal rule too."""
    ids, lm, doc, pos = _packed_rows(1, 256, seed=5)
    blocks = draw_blocks(ids, lm, doc, pos, 2, 128, 95, torch.Generator().manual_seed(0))
    for causal in (False, True):
        bm = flex_block_mask(blocks, doc, block_causal=causal)
        ref = create_block_mask(bm.mask_mod, B=1, H=None, Q_LEN=2 * 128, KV_LEN=256 + 2 * 128, device="cpu")
        for a, z, what in zip(_tiles(bm), _tiles(ref), ("partial", "full")):
            assert torch.equal(a, z), f"causal={causal}: {what} tiles differ"
        assert bool(_tiles(bm)[1][0, 0, 0, 2]) != causal  # block 0's own keys start at 256: tile 2

# ----------------------------------------------------------------------------- static loop (graphs off on CPU)
PROMPT = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
NEW, B = 24, 8
MISTAKES = {len(PROMPT) + k for k in (3, 4, 12, 17, 19)}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_5_moe"])
def test_static_loop_equals_eager_loop(tiny_targets, arch):
    """Same tokens and acceptance lengths as the eager loop: planted mistakes (exact acceptance known)
    and a random drafter through the static drafter pass (same drafts as the eager drafter)."""
    from conftest import ReferenceProposer, expected_acceptance, tiny_drafter_config
    from inference.static_loop import (StaticDrafterProposer, StaticTarget, static_dflash_generate,
                                       static_target_generate)
    from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
    from models.drafter import DFlashDraftModel

    target = tiny_targets(arch)
    ref = target_generate(target, PROMPT, 28, eos_token_ids=[])
    seq = PROMPT + ref.tokens
    torch.manual_seed(1)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(PROMPT) + NEW + 2 * B, block_size=B)
    assert not st.graphs  # CPU: the same static buffers, run eagerly

    base = static_target_generate(st, PROMPT, NEW, eos_token_ids=[])
    assert base.tokens == ref.tokens[:NEW]
    proposer = ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES)
    res = static_dflash_generate(st, proposer, PROMPT, NEW, eos_token_ids=[])
    assert res.tokens == ref.tokens[:NEW]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), NEW, B, MISTAKES)

    eager = dflash_generate(target, DrafterProposer(drafter, target), PROMPT, NEW, eos_token_ids=[])
    parts: dict[str, float] = {}
    static = static_dflash_generate(st, StaticDrafterProposer(drafter, target, max_len=st.max_len), PROMPT, NEW,
                                    eos_token_ids=[], parts=parts)
    assert static.tokens == eager.tokens == ref.tokens[:NEW]
    assert static.acceptance_lengths == eager.acceptance_lengths
    assert set(parts) == {"draft", "verify", "accept", "host"}

    # The drafts themselves, cycle by cycle with uneven commits: static pass == eager drafter.
    p_e, p_s = DrafterProposer(drafter, target), StaticDrafterProposer(drafter, target, max_len=st.max_len)
    feats = target.forward(torch.tensor([seq]), drafter.config.target_layer_ids, with_logits=False).features
    start, new = len(PROMPT), feats[:, :len(PROMPT)]
    for keep in (3, 1, 8, 2, 5):
        a, b = p_e.propose(seq[start], new, start, B), p_s.propose(seq[start], new, start, B)
        assert torch.equal(a, b) and p_s.context_length() == p_e.context_length() == start
        new, start = feats[:, start:start + keep], start + keep


def test_grouped_attention_of_the_static_draft_pass_equals_repeated_heads():
    """Query heads packed per K/V head (no repeated cache) give what repeating K/V gives, per head and
    position, with a mask that differs by query row."""
    from inference.grouped_attention import attend_grouped
    from models.drafter import attend

    g = torch.Generator().manual_seed(0)
    for hq, hkv in ((8, 2), (6, 3), (4, 4)):
        q, k, v = (torch.randn(1, h, n, 16, generator=g) for h, n in ((hq, 5), (hkv, 11), (hkv, 11)))
        mask = torch.rand(1, 1, 5, 11, generator=g) > 0.4
        mask[..., 0] = True  # every row sees at least one key
        torch.testing.assert_close(attend_grouped(q, k, v, mask), attend(q, k, v, mask), rtol=1e-6, atol=1e-6)
        broadcast = mask[:, :, :1].expand(1, 1, 5, 11)  # the static pass's mask: one row for all queries
        torch.testing.assert_close(attend_grouped(q, k, v, broadcast), attend(q, k, v, broadcast), rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_static_loop_on_a_target_with_eager_attention(arch):
    """attn_implementation 'eager' adds its mask to the scores: the static passes hand it an additive mask
    (stale and later slots at the dtype's lowest), so the tokens and acceptance lengths are the eager loop's."""
    from conftest import ReferenceProposer, expected_acceptance
    from inference.static_loop import StaticTarget, static_dflash_generate, static_target_generate
    from inference.torch_loop import target_generate
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer

    model = tiny_target(arch, seed=0)
    model.set_attn_implementation("eager")
    target = TargetModel(model, tiny_tokenizer())
    assert target.model.config._attn_implementation == "eager"
    ref = target_generate(target, PROMPT, NEW + 2 * B, eos_token_ids=[])
    st = StaticTarget(target, [1, 3, 5], max_len=len(PROMPT) + NEW + 2 * B, block_size=B)
    assert st._additive_mask
    assert static_target_generate(st, PROMPT, NEW, eos_token_ids=[]).tokens == ref.tokens[:NEW]
    proposer = ReferenceProposer(PROMPT + ref.tokens, [1, 3, 5], B, 288, MISTAKES)
    res = static_dflash_generate(st, proposer, PROMPT, NEW, eos_token_ids=[])
    assert res.tokens == ref.tokens[:NEW]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), NEW, B, MISTAKES)


def test_static_drafter_fills_its_cache_to_the_last_slot(tiny_targets):
    """A drafter cache of ``max_len`` positions takes context up to exactly ``max_len``, and refuses one more."""
    from conftest import tiny_drafter_config
    from inference.static_loop import StaticDrafterProposer
    from models.drafter import DFlashDraftModel

    target = tiny_targets("qwen3")
    torch.manual_seed(1)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    feats = target.forward(torch.tensor([PROMPT]), drafter.config.target_layer_ids, with_logits=False).features
    p = StaticDrafterProposer(drafter, target, max_len=len(PROMPT))
    p.propose(PROMPT[-1], feats[:, :len(PROMPT) - B], len(PROMPT) - B, B)  # 12 positions, then 8 more: 20
    p.propose(PROMPT[-1], feats[:, len(PROMPT) - B:], len(PROMPT), B)
    assert p.context_length() == len(PROMPT)
    with pytest.raises(ValueError, match="drafter cache holds 20 positions"):
        p.propose(PROMPT[-1], feats[:, :1], len(PROMPT) + 1, B)  # a block of 8 more would run past them


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_static_target_passes_attend_grouped_and_leave_the_attention_setting_as_it_was(tiny_targets, arch,
                                                                                     monkeypatch):
    """The 1-token and B-token passes run the grouped attention (no repeated K/V), the prefill HF's own,
    and the target's attention setting is its own again after every pass (the eager loop shares it)."""
    from inference import grouped_attention
    from inference.static_loop import StaticTarget, static_target_generate

    target = tiny_targets(arch)
    lengths = []
    real = grouped_attention.attend_grouped
    monkeypatch.setattr(grouped_attention, "attend_grouped",
                        lambda q, *a, **k: lengths.append(q.shape[2]) or real(q, *a, **k))
    st = StaticTarget(target, [1], max_len=len(PROMPT) + 8 + 2 * B, block_size=B)
    assert st._attn_configs
    # K/V buffers for the attention layers only (a GatedDeltaNet layer keeps its own states)
    assert sorted(st.kv.keys) == [i for i, kind in enumerate(target.layer_types) if kind == "full_attention"]
    static_target_generate(st, PROMPT, 4, eos_token_ids=[])
    st.forward(torch.tensor([PROMPT[:B]]), len(PROMPT) + 3)  # after the decode steps at +0, +1, +2
    full = sum(kind == "full_attention" for kind in target.layer_types)
    assert lengths == [1] * (3 * full) + [B] * full  # 3 decode steps, then one verify; the prompt not
    assert {c._attn_implementation for c in st._attn_configs} == {"sdpa"}
    assert target.model.config._attn_implementation == "sdpa"


def test_static_target_takes_the_configs_head_dim():
    """Qwen3 configs set head_dim on their own (0.6B: 128, where hidden / heads is 64): the K/V buffers take it."""
    from transformers import AutoModelForCausalLM

    from inference.static_loop import StaticTarget, static_target_generate
    from inference.torch_loop import target_generate
    from models.target import TargetModel
    from models.tiny import TINY_VOCAB, tiny_config, tiny_tokenizer

    config = tiny_config("qwen3", TINY_VOCAB, 2)
    config.head_dim = 32  # hidden 64 over 4 heads would say 16
    torch.manual_seed(0)
    target = TargetModel(AutoModelForCausalLM.from_config(config).eval(), tiny_tokenizer())
    st = StaticTarget(target, [1], max_len=len(PROMPT) + 8, block_size=B)
    assert st.kv.keys[0].shape[-1] == 32
    assert (static_target_generate(st, PROMPT, 6, eos_token_ids=[]).tokens
            == target_generate(target, PROMPT, 6, eos_token_ids=[]).tokens)


def test_static_loop_runs_again_on_its_caches_and_stops_at_the_targets_eos(tiny_targets, monkeypatch):
    """A second generation on the same static caches gives the first one's tokens (the drafter cache and the
    GatedDeltaNet states start over); without eos_token_ids the target's own EOS ends the output, not emitted."""
    from conftest import tiny_drafter_config
    from inference.static_loop import build_static_loop, static_dflash_generate
    from models.drafter import DFlashDraftModel

    target = tiny_targets("qwen3_5")
    torch.manual_seed(1)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    st, proposer = build_static_loop(target, drafter, max_len=len(PROMPT) + NEW + 2 * B)
    first = static_dflash_generate(st, proposer, PROMPT, NEW, eos_token_ids=[])
    again = static_dflash_generate(st, proposer, PROMPT, NEW, eos_token_ids=[])
    assert again.tokens == first.tokens and again.acceptance_lengths == first.acceptance_lengths
    short = torch.tensor([PROMPT[:5]])  # within one block: the pass starts from the cleared state, no prefill
    assert_close(st.forward(short, 0)[1], target.forward(short, [1], with_logits=True).logits, atol=1e-4,
                 what="a new short sequence's logits on used static caches")
    cut = next(i for i in range(2, NEW) if first.tokens[i] not in first.tokens[:i])
    monkeypatch.setattr(target, "eos_token_ids", lambda: [first.tokens[cut]])
    stopped = static_dflash_generate(st, proposer, PROMPT, NEW)
    assert stopped.tokens == first.tokens[:cut] and stopped.stop_reason == "eos"


def test_static_baseline_counts_the_eos_step_as_emitting_nothing(tiny_targets):
    """The static baseline's steps count as the eager one's: 1 per token, 0 for the step that produced the EOS."""
    from inference.static_loop import StaticTarget, static_target_generate
    from inference.torch_loop import target_generate

    target = tiny_targets("qwen3")
    gen = target_generate(target, PROMPT, NEW, eos_token_ids=[]).tokens
    cut = next(i for i in range(2, NEW) if gen[i] not in gen[:i])
    eager = target_generate(target, PROMPT, NEW, eos_token_ids=[gen[cut]])
    static = static_target_generate(StaticTarget(target, [1, 3], max_len=len(PROMPT) + NEW + B, block_size=B),
                                    PROMPT, NEW, eos_token_ids=[gen[cut]])
    assert static.tokens == eager.tokens == gen[:cut] and static.stop_reason == "eos"
    assert static.acceptance_lengths == eager.acceptance_lengths == [1] * (cut - 1) + [0]
    assert static.block_size == eager.block_size == 1  # one token per step in generate --json


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_graph_warm_up_leaves_the_state_the_replay_starts_from(tiny_targets, arch, monkeypatch):
    """On CUDA a graphed pass runs twice untimed (warm-up) before the capture, then once per replay.
    GatedDeltaNet passes rewrite the state they start from, so the warm-up advanced it: the first
    1-token and B-token passes of a Qwen3.5 target started two passes ahead (wrong tokens). Here the
    capture is emulated on the CPU: the same warm-up, then the pass itself for each replay."""
    from conftest import tiny_drafter_config
    from inference import static_loop
    from inference.static_greedy import greedy_cycle, greedy_decode
    from inference.static_loop import (StaticDrafterProposer, StaticTarget, static_dflash_generate,
                                       static_target_generate)
    from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
    from models.drafter import DFlashDraftModel

    def emulated_capture(self):
        if not self.use_graph:
            return self.fn()
        if self.graph is None:
            self.warm_up()
            self.graph = "captured"
        return self.fn()

    monkeypatch.setattr(static_loop._Graphed, "__call__", emulated_capture)
    target = tiny_targets(arch)
    torch.manual_seed(1)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(PROMPT) + NEW + 2 * B, block_size=B,
                      graphs=True)
    ref = target_generate(target, PROMPT, NEW, eos_token_ids=[]).tokens
    for resident in (True, False):  # the one-graph greedy step and cycle, and the two-graph ones
        assert static_target_generate(st, PROMPT, NEW, eos_token_ids=[], resident=resident).tokens == ref
    eager = dflash_generate(target, DrafterProposer(drafter, target), PROMPT, NEW, eos_token_ids=[])
    proposer = StaticDrafterProposer(drafter, target, max_len=st.max_len, graphs=True)
    for resident in (True, False):
        graphed = static_dflash_generate(st, proposer, PROMPT, NEW, eos_token_ids=[], resident=resident)
        assert graphed.tokens == eager.tokens and graphed.acceptance_lengths == eager.acceptance_lengths
    resident_graphs = [greedy_cycle(st, proposer)._graph, greedy_decode(st)._graph]
    assert all(p.graph == "captured" for p in [*st._passes.values(), proposer.graphed_pass(), *resident_graphs])


def test_graph_warm_up_runs_twice_each_from_the_saved_state():
    """Both untimed runs before a capture start from the committed state, and leave it as it was."""
    from inference.static_loop import _Graphed

    state, seen = torch.zeros(1), []

    def step():  # a pass that reads its state and advances it, as a GatedDeltaNet pass does
        seen.append(state.item())
        state.add_(1)

    _Graphed(step, use_graph=False, mutable=[state]).warm_up()
    assert seen == [0.0, 0.0] and state.item() == 0.0


def test_qwen35_on_cuda_without_fla_warns_once_with_the_install_command(monkeypatch, caplog):
    import importlib.util

    from models.target import warn_if_slow_linear_attention

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real(name, *a))
    warn_if_slow_linear_attention("qwen3_5", torch.device("cuda"))
    warn_if_slow_linear_attention("qwen3", torch.device("cuda"))  # no GatedDeltaNet: nothing to say
    warn_if_slow_linear_attention("qwen3_5", torch.device("cpu"))  # the CPU has no such kernels anyway
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pip install 'draftsmith[cuda]'" in lines[0] and "\n" not in lines[0]


# ----------------------------------------------------------------------------- overlapped extraction
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_background_shard_writers_give_the_same_store(tiny_targets, tmp_path, dtype):
    """1 or 3 writer threads (shards finishing in any order): byte-identical shards and index, and
    each shard's recorded sha256 (hashed from the serialised bytes) is the file's."""
    from data.bench import random_data
    from data.extract import extract
    from data.store import FeatureStore, sha256_file

    target, data = tiny_targets("qwen3"), random_data(12, 40, 250)
    stores = {}
    for writers in (1, 3):
        out = tmp_path / f"w{writers}"
        report = extract(target, data, out, layer_ids=[1, 3], dtype=dtype, batch_size=2, shard_tokens=100,
                         progress=False, writers=writers)
        assert report.shards_written == report.shards >= 4 and report.complete
        stores[writers] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        for name, info in FeatureStore(out).index["shards"].items():
            assert sha256_file(out / name) == info["sha256"]
        FeatureStore(out).verify_all()
    assert stores[1] == stores[3]


def test_writers_count_the_final_drain_apart():
    """The wait at exit for shards still being written is the job's drain; a report carries it."""
    import time

    from data.extract import ShardWriters

    class SlowWriter:
        def write_shard(self, k, rows):
            time.sleep(0.2)
            return {"tokens": 1, "bytes": 1}

    written = []
    with ShardWriters(SlowWriter(), 2, written.append) as pool:
        pool.submit(0, [], None)
        pool.submit(1, [], None)
        assert pool.drain_seconds == 0.0
    assert len(written) == 2 and pool.drain_seconds >= 0.15  # both writes were still sleeping at exit


def test_writers_hold_at_most_their_count_of_shards():
    """A full pool makes submit wait for the oldest shard: host memory holds ``threads`` shards, not more."""
    from data.extract import ShardWriters

    class Writer:
        def write_shard(self, k, rows):
            return {"tokens": k, "bytes": 1}

    written = []
    with ShardWriters(Writer(), 2, written.append) as pool:
        for k in range(5):
            pool.submit(k, [], None)
            assert len(pool.pending) <= 2
    assert [w["tokens"] for w in written] == [0, 1, 2, 3, 4]


def test_extract_report_drain_is_part_of_its_seconds(tiny_targets, tmp_path):
    from data.bench import random_data
    from data.extract import extract

    report = extract(tiny_targets("qwen3"), random_data(6, 40, 250), tmp_path / "s", layer_ids=[1, 3],
                     batch_size=2, shard_tokens=80, progress=False, writers=2)
    assert 0.0 <= report.drain_seconds <= report.seconds + 1e-3
    assert '"drain_seconds"' in report.line()


def test_data_bench_extract_figures():
    """Overheads against the forward, the tapped forward and whichever ceiling binds, with and without the drain."""
    from data.bench import extract_figures

    f = extract_figures(tokens=1000, seconds=2.0, drain=0.5, forward_tps=1000.0, tapped_tps=800.0, disk_tps=600.0)
    assert f["tokens_per_s"] == 500.0 and f["overhead_pct_vs_forward"] == 100.0
    assert f["overhead_pct_vs_tapped_forward"] == 60.0 and f["drain_s"] == 0.5
    assert f["steady_tokens_per_s"] == 666.7 and f["steady_overhead_pct_vs_tapped_forward"] == 20.0
    assert f["bound"] == "disk" and f["disk_bound_tokens_per_s"] == 600.0
    assert f["steady_overhead_pct_vs_bound"] == -10.0  # faster than this disk's measured write: its cache
    fast_disk = extract_figures(1000, 2.0, 0.0, 1000.0, 800.0, 5000.0)
    assert fast_disk["bound"] == "forward" and fast_disk["steady_overhead_pct_vs_bound"] == 60.0


def test_direct_safetensors_writer_is_read_back_by_safetensors(tmp_path):
    """Shards are written from the rows' memory (no ``save`` copy): any safetensors reader loads the
    same tensors, a list is its parts laid end to end, and the returned size and sha256 are the file's."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from data.store import sha256_file
    from data.store_writer import write_safetensors

    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, 6, generator=g).to(torch.bfloat16) for n in (3, 5, 1)]
    tensors = {"row_offsets": torch.tensor([0, 3, 8, 9]), "input_ids": torch.arange(9, dtype=torch.int32),
               "loss_mask": torch.tensor([0, 1] * 4 + [1], dtype=torch.int8), "features": rows,
               "fp8": torch.randn(9, 6, generator=g).to(torch.float8_e4m3fn), "scales": torch.rand(9, 2).half()}
    with open(tmp_path / "s.safetensors", "wb") as f:
        size, digest = write_safetensors(f, tensors)
    back = load_file(tmp_path / "s.safetensors")
    assert sorted(back) == sorted(tensors)
    assert torch.equal(back["features"], torch.cat(rows))
    for name in ("row_offsets", "input_ids", "loss_mask", "scales"):
        assert back[name].dtype == tensors[name].dtype and torch.equal(back[name], tensors[name])
    assert torch.equal(back["fp8"].view(torch.uint8), tensors["fp8"].view(torch.uint8))
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as h:
        assert h.get_slice("features").get_shape() == [9, 6]
    assert size == (tmp_path / "s.safetensors").stat().st_size and digest == sha256_file(tmp_path / "s.safetensors")


def test_direct_safetensors_writer_bytes_do_not_depend_on_the_order_tensors_are_given(tmp_path):
    """Tensors are written by sorted name, so equal shards are equal bytes (and equal sha256) whichever order a
    writer built them in; a 0-dim tensor keeps its empty shape."""
    from safetensors.torch import load_file

    from data.store_writer import write_safetensors

    tensors = {"b": torch.arange(4, dtype=torch.int32), "a": torch.ones(2, 3), "step": torch.tensor(7)}
    written = []
    for order in (tensors, dict(reversed(tensors.items()))):
        with open(tmp_path / "s.safetensors", "wb") as f:
            written.append((write_safetensors(f, order), (tmp_path / "s.safetensors").read_bytes()))
    assert written[0] == written[1]
    assert load_file(tmp_path / "s.safetensors")["step"].shape == ()


# ----------------------------------------------------------------------------- loop choice of generate / validate
def test_session_static_loop_equals_eager_loop(tmp_path):
    """generate / validate --loop static (the default on a GPU for full-attention targets): same tokens,
    acceptance lengths and baseline as the eager loop; auto stays eager off CUDA."""
    from inference.bench import tiny_folders
    from inference.generate import Session

    target, draft = tiny_folders("qwen3", str(tmp_path))
    prompt = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64]
    runs = {}
    for loop in ("eager", "static", "auto"):
        session = Session("torch", target, draft, "cpu", "float32", loop=loop)
        result, base = session.run(prompt, baseline=True, max_new_tokens=24, eos_token_ids=[])
        runs[loop] = (session.describe()["loop"], result.tokens, result.acceptance_lengths, base.tokens)
    assert runs["static"][0] == "static" and runs["eager"][0] == runs["auto"][0] == "eager"
    assert runs["static"][1:] == runs["eager"][1:] == runs["auto"][1:]
    assert runs["static"][1] == runs["static"][3]  # lossless in fp32
    # A smaller block than the drafter's: DFlash once ran eager against the static loop's baseline (a
    # speedup of two different loops, reported as "static"). Both run eager now, and the report says so.
    session = Session("torch", target, draft, "cpu", "float32", loop="static")
    result, base = session.run(prompt, baseline=True, block_size=2, max_new_tokens=24, eos_token_ids=[])
    assert session.describe()["loop"] == "eager" and session._static is None
    assert result.tokens == base.tokens == runs["eager"][3]


def test_session_static_loop_on_a_hybrid_target_and_what_auto_picks(tmp_path, caplog):
    """--loop static runs Qwen3.5 (GatedDeltaNet) with the eager loop's tokens; auto on a GPU picks static for
    full-attention targets and keeps hybrid ones eager (their graph replay is checked in test_cuda.py)."""
    from inference.bench import tiny_folders
    from inference.generate import Session, pick_torch_loop

    target, draft = tiny_folders("qwen3_5", str(tmp_path))
    hybrid = Session("torch", target, draft, "cpu", "float32", loop="eager")
    static = Session("torch", target, draft, "cpu", "float32", loop="static")
    block = static.proposer.drafter.config.block_size
    assert static.describe()["loop"] == "static" and len(PROMPT) > block
    # Prompts of one token, one block (both through the fixed-shape passes from the zero state) and longer.
    for prompt in (PROMPT[:1], PROMPT[:block], PROMPT):
        (a, a_base), (b, b_base) = (s.run(prompt, baseline=True, max_new_tokens=20, eos_token_ids=[])
                                    for s in (hybrid, static))
        assert b.tokens == a.tokens == b_base.tokens == a_base.tokens, len(prompt)  # lossless in fp32
        assert b.acceptance_lengths == a.acceptance_lengths
    dense = Session("torch", *tiny_folders("qwen3", str(tmp_path / "dense")), "cpu", "float32", loop="eager")

    class OnGpu:  # the real target, seen as if it were on a GPU (only .device differs)
        device = torch.device("cuda")

        def __init__(self, t):
            self.t = t

        def __getattr__(self, name):
            return getattr(self.t, name)

    assert pick_torch_loop("auto", OnGpu(hybrid.target), hybrid.proposer.drafter) == "eager"
    assert "--loop static runs the CUDA-graph loop" in caplog.text  # says what it left on the table
    assert pick_torch_loop("static", OnGpu(hybrid.target), hybrid.proposer.drafter) == "static"
    assert pick_torch_loop("auto", OnGpu(dense.target), dense.proposer.drafter) == "static"
    assert pick_torch_loop("auto", dense.target, dense.proposer.drafter) == "eager"  # CPU


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl"])
def test_compiled_target_layers_give_the_eager_taps(arch):
    """train.compile=true compiles the target's layers: the taps are unchanged, one graph serves every
    layer, varying row lengths stop recompiling after the first new length, and passes that fill a
    cache (held-out generation) stay eager."""
    from inference.torch_loop import target_generate
    from models.target import TargetModel
    from models.tiny import tiny_target

    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):  # the graphs dynamo hands to a compiler, run as traced
        graphs.append(gm)
        return gm.forward

    eager = TargetModel(tiny_target(arch))
    compiled = TargetModel(tiny_target(arch)).compile_layers(backend=counting_backend)
    # a whole full-attention layer; a GatedDeltaNet layer's two halves around its chunked kernel
    # (models.gated_deltanet)
    kinds = 3 if compiled.is_hybrid else 1
    joined = [getattr(m, "in_proj_joined", None) is not None for _, m in compiled.linear_attention_modules()]
    assert joined == [True] * len(joined) and (len(joined) > 0) == compiled.is_hybrid
    rows = [torch.randint(0, 250, (2, n), generator=torch.Generator().manual_seed(n)) for n in (17, 29, 40, 33)]
    for i, ids in enumerate(rows):
        for with_logits in (False, True):
            ref = eager.forward(ids, [1, 3, 5], with_logits=with_logits)
            got = compiled.forward(ids, [1, 3, 5], with_logits=with_logits)
            what = f"{arch} compiled taps, length {ids.shape[1]}"
            if not compiled.is_hybrid:
                assert_close(got.features, ref.features, atol=1e-5, what=what)
                if with_logits:
                    assert_close(got.logits, ref.logits, atol=1e-4, what=f"{arch} compiled logits")
                continue
            # The fused GatedDeltaNet conv sums its four taps in another order than the layer's conv (with
            # the layer's conv it is bit-exact): an fp32 rounding that these random layers grow ~2x each,
            # ~1e-4 at the sixth (taps up to |5|). Held to a relative error over the whole tensor
            # (measured <= 5.4e-6); a wrong tap, layer or gate is off by O(1) in that measure.
            pairs = [(got.features, ref.features)] + ([(got.logits, ref.logits)] if with_logits else [])
            for a, e in pairs:
                rel = ((a - e).double().norm() / e.double().norm()).item()
                assert a.shape == e.shape and rel < 3e-5, f"{what}: relative error {rel:.2e}"
        # First length: one static graph per kind of layer; second: one dynamic one; then none.
        assert len(graphs) == kinds * min(i + 1, 2), (arch, i, len(graphs))
    before = len(graphs)
    prompt = rows[0][0, :6].tolist()
    assert (target_generate(compiled, prompt, 6, eos_token_ids=[]).tokens
            == target_generate(eager, prompt, 6, eos_token_ids=[]).tokens)
    assert len(graphs) == before, "a pass with a cache was compiled"


def test_compiled_target_spread_over_devices_runs_each_layers_dispatch_hook(monkeypatch):
    """target.device_map with train.compile=true: accelerate's hook on each layer moves the layer's inputs to
    its GPU, and a fused GatedDeltaNet layer replaces the forward that ran the hook, so it runs the hook
    itself (CPU "devices" here, as in test_scale_out): once per pass and layer, before and after, and the
    taps and logits are the whole target's."""
    from accelerate import dispatch_model

    from models.target import TargetModel
    from models.tiny import tiny_target

    torch._dynamo.reset()
    whole = TargetModel(tiny_target("qwen3_5", num_layers=4))  # three GatedDeltaNet layers, one attention layer
    model = tiny_target("qwen3_5", num_layers=4)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(len(model.model.layers))}}
    dispatch_model(model, device_map=device_map, force_hooks=True)
    spread = TargetModel(model).compile_layers(backend=lambda gm, example_inputs: gm.forward)
    seen = []
    for i, _ in spread.linear_attention_modules():  # the attention layers' hooks run inside their compiled forward
        hook = spread.layers[i]._hf_hook
        for when in ("pre_forward", "post_forward"):
            def counted(*args, _real=getattr(hook, when), _tag=(i, when), **kwargs):
                seen.append(_tag)
                return _real(*args, **kwargs)
            monkeypatch.setattr(hook, when, counted)
    ids = torch.randint(0, 250, (2, 23), generator=torch.Generator().manual_seed(3))
    got, ref = spread.forward(ids, [0, 2]), whole.forward(ids, [0, 2])
    fused = [i for i, _ in spread.linear_attention_modules()]
    assert seen == [(i, when) for i in fused for when in ("pre_forward", "post_forward")]
    for a, e in ((got.features, ref.features), (got.logits, ref.logits)):
        rel = ((a - e).double().norm() / e.double().norm()).item()
        assert a.shape == e.shape and rel < 3e-5, f"relative error {rel:.2e}"


@pytest.mark.parametrize("mode,target_compiled", [("online", True), ("offline", False)])
def test_train_compile_compiles_the_target_only_with_online_features(mode, target_compiled):
    from train.config import load_config
    from train.distill import compile_models

    calls = []

    class Model:
        def __init__(self, name):
            self.name = name

        def compile_layers(self):
            calls.append(self.name)

    cfg = load_config(["recipe=tiny", "train.compile=true", f"features.mode={mode}", "features.store=/unused"])
    compile_models(cfg, "cuda", Model("drafter"), Model("target"))
    assert calls == ["drafter", "target"] if target_compiled else calls == ["drafter"]


@pytest.mark.parametrize("s,block,anchors", [
    (128, 4, list(range(1, 100, 3))),  # 33 blocks: the last query tile and the last key tile hold one block
    (256, 16, [130, 140, 150, 160, 170, 180, 190, 200, 210]),  # 9 blocks: 16 real queries in the last tile
])
def test_direct_block_mask_on_ragged_tiles(s, block, anchors):
    """A ragged last tile (queries or keys past the end) whose real pairs are all visible is still a
    partial tile for create_block_mask (it pads the mask with False), so the direct mask must not call
    it full. Both cases have such a tile: the last block against its own keys, and a last query tile
    whose one block sees all of context tile 0."""
    from train.objective import build_blocks

    ids = torch.randint(0, 90, (1, s), generator=torch.Generator().manual_seed(0))
    lm, doc, pos = torch.ones(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long), torch.arange(s)[None]
    a = torch.tensor([anchors])
    blocks = build_blocks(ids, lm, doc, pos, a, torch.ones_like(a, dtype=torch.bool), block, 95)
    _same_as_create_block_mask(blocks, doc, block)


# ----------------------------------------------------------------------------- --profile of the benches
def test_top_ops_counts_each_op_once_per_call():
    from models.profiling import top_ops

    a = torch.randn(64, 64)
    prof = top_ops(lambda: torch.mm(a, a).relu_(), n=2, calls=4)
    assert prof["clock"] == "cpu" and prof["calls"] == 4 and len(prof["ops"]) == 2
    mm = next(op for op in prof["ops"] if op["name"] == "aten::mm")
    assert mm["count_per_call"] == 1.0 and 0 < mm["share"] <= 1
    assert [op["ms_per_call"] for op in prof["ops"]] == sorted((op["ms_per_call"] for op in prof["ops"]), reverse=True)
    assert sum(op["ms_per_call"] for op in prof["ops"]) <= prof["total_ms_per_call"] + 1e-3


def bench_lines(capsys, module: str, argv: list[str]) -> list[dict]:
    import importlib
    import json

    importlib.import_module(f"{module}.bench").main(argv)
    return [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]


def test_inference_bench_profiles_each_pass_of_the_static_loop(capsys):
    lines = bench_lines(capsys, "inference", ["--random-target", "tiny", "--loop", "static", "--max-new-tokens", "8",
                                              "--prompts", "x", "--prompt-tokens", "8", "--profile", "100"])
    profiles = {x["what"]: x for x in lines if x["bench"] == "profile"}
    assert list(profiles) == ["decode", "verify", "draft"]
    for prof in profiles.values():
        assert prof["loop"] == "static" and prof["calls"] == 10 and 1 <= len(prof["ops"]) <= 100
        assert prof["total_ms_per_call"] > 0 and all(0 <= op["share"] <= 1 for op in prof["ops"])
    # the tiny drafter's block pass: per layer the q|k|v, o, gate|up and down matmuls, then fc and the head.
    # Every op of the pass is listed (N=100), so this does not hang on how the ops rank by time.
    assert any(op["name"] == "aten::mm" for op in profiles["draft"]["ops"])


def test_inference_bench_times_both_cycles_of_a_static_loop_on_one_build(capsys, monkeypatch):
    """--cycle both: per prompt a device-resident and a two-graph line (same tokens and tau), one loop build."""
    from inference import static_loop

    builds = []
    real = static_loop.build_static_loop
    monkeypatch.setattr(static_loop, "build_static_loop", lambda *a, **k: builds.append(1) or real(*a, **k))
    lines = bench_lines(capsys, "inference", ["--random-target", "tiny", "--loop", "static", "--max-new-tokens", "12",
                                              "--prompts", "x", "y", "--prompt-tokens", "8", "--cycle", "both"])
    decode = [x for x in lines if x["bench"] == "decode"]
    assert [(x["prompt"], x["cycle"]) for x in decode] == [(0, "resident"), (0, "two-graph"), (1, "resident"),
                                                           (1, "two-graph")]
    for a, b in (decode[:2], decode[2:]):
        assert a["tokens"] == b["tokens"] == 12 and a["tau"] == b["tau"] and a["cycle_cost"] > 0
    assert builds == [1]


def test_train_bench_profiles_one_more_step(capsys):
    lines = bench_lines(capsys, "train", ["--e2e", "tiny", "--steps", "1", "--warmup", "0", "--seq", "64",
                                          "--anchors", "4", "--profile", "2"])
    assert [x["bench"] for x in lines] == ["train_e2e", "train_parts", "profile"]
    assert lines[-1]["what"] == "train_e2e" and len(lines[-1]["ops"]) == 2
    prof, step_ms = lines[-1], lines[0]["step_s"] * 1e3
    # step_s is rounded to 0.1 ms in its row
    assert prof["busy_share"] == pytest.approx(prof["total_ms_per_call"] / step_ms, rel=0.05)


def test_train_bench_steps_the_optimizer_once_per_grad_accum_micro_batches(capsys, monkeypatch):
    """--grad-accum 3: three forward + backward passes per AdamW step, each with its own blocks (the
    FLOPs and tokens count all three); --e2e takes the recipe's train.grad_accum unless given."""
    import data.bench
    from models.drafter import DFlashDraftModel

    seen = {"steps": 0, "forwards": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(torch.optim.AdamW, "step", counted("steps", torch.optim.AdamW.step))
    monkeypatch.setattr(DFlashDraftModel, "forward", counted("forwards", DFlashDraftModel.forward))
    argv = ["--e2e", "tiny", "--steps", "2", "--warmup", "0", "--seq", "64", "--anchors", "4"]
    one = bench_lines(capsys, "train", argv)[0]
    assert one["grad_accum"] == 1 and seen == {"steps": 2 + 1, "forwards": 2 + 1}  # + the parts line's one step
    seen.update(steps=0, forwards=0)
    three = bench_lines(capsys, "train", argv + ["--grad-accum", "3"])[0]
    assert three["grad_accum"] == 3 and seen == {"steps": 2 + 1, "forwards": 6 + 1}
    assert three["tflops"] > 0 and three["anchors_per_s"] > 0

    recipe = data.bench.recipe_spec("tiny")
    recipe["train"]["grad_accum"] = 2
    monkeypatch.setattr(data.bench, "recipe_spec", lambda name: recipe)
    assert bench_lines(capsys, "train", argv)[0]["grad_accum"] == 2


@pytest.mark.parametrize("mixer,fused", [("fused", True), ("own", False)])
def test_train_bench_compiles_a_hybrid_target_with_the_mixer_asked_for(capsys, monkeypatch, mixer, fused):
    """--target-mixer: the before/after of the fused GatedDeltaNet mixer in one flag, named in the row."""
    import data.bench
    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import tiny_target

    asked = []
    monkeypatch.setattr(data.bench, "recipe_target", lambda *a, **k: TargetModel(tiny_target("qwen3_5")))
    monkeypatch.setattr(TargetModel, "compile_layers", lambda self, fuse_mixer=True: asked.append(fuse_mixer))
    monkeypatch.setattr(DFlashDraftModel, "compile_layers", lambda self: self)
    lines = bench_lines(capsys, "train", ["--e2e", "tiny", "--steps", "1", "--warmup", "0", "--seq", "64",
                                          "--anchors", "4", "--compile", "--target-mixer", mixer])
    assert asked == [fused] and lines[0]["target_mixer"] == mixer


# ------------------------------------------------------------------ flex attention's backward tiles
def test_flex_backward_settings_become_backward_only_kernel_options(monkeypatch):
    """auto: the measured tiles for (capability, head_dim) where there are some, else torch's; the
    options carry the bwd_ prefix so the forward keeps torch's tiles; a CPU run never gets options."""
    from models import flex_options as fo

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fo, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(fo, "TUNED", {((9, 0), 256): (32, 64, 64, 32, 2, 4)})
    assert fo.resolve_tiles("auto", cuda, 256) == (32, 64, 64, 32, 2, 4)
    assert fo.resolve_tiles("auto", cuda, 128) is None  # not measured: torch's choice
    assert fo.resolve_tiles("torch", cuda, 256) is None
    assert fo.resolve_tiles(fo.parse_flex_backward("64,128,128,64,3,8"), cuda, 256) == (64, 128, 128, 64, 3, 8)
    assert fo.resolve_tiles(fo.parse_flex_backward("64,128,128,64,3,8"), torch.device("cpu"), 256) is None
    assert fo.kernel_options((32, 64, 64, 32, 2, 4)) == {
        "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 2,
        "bwd_num_warps": 4}
    assert fo.kernel_options(None) is None
    assert fo.format_tiles((32, 64, 64, 32, 2, 4)) == "32,64,64,32,2,4" and fo.format_tiles(None) == "torch"


def test_the_drafter_hands_its_tiles_to_every_attention_layer(monkeypatch):
    from models import flex_options as fo
    from models.config import DFlashConfig
    from models.drafter import DFlashDraftModel

    monkeypatch.setattr(fo, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(fo, "TUNED", {((9, 0), 16): (16, 32, 32, 16, 1, 4)})
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=40, num_target_layers=4, target_layer_ids=[1],
                       mask_token_id=39, block_size=4)
    d = DFlashDraftModel(cfg)
    assert d.flex_backward == "auto"
    d._set_flex_tiles(torch.device("cuda", 0))
    assert [layer.self_attn.flex_kernel_options["bwd_BLOCK_N1"] for layer in d.layers] == [32, 32, 32]
    d.set_flex_backward("torch")._set_flex_tiles(torch.device("cuda", 0))
    assert [layer.self_attn.flex_kernel_options for layer in d.layers] == [None, None, None]
    assert d.set_flex_backward("64,64,64,64,2,8").flex_backward == (64, 64, 64, 64, 2, 8)


def test_flex_sweep_picks_the_fastest_candidate_with_torchs_gradients():
    from train.flex_sweep import best, candidates_for

    rows = [{"tiles": "torch", "fwd_bwd_ms": 10.0, "same_grads": True},
            {"tiles": "16,16,16,16,1,4", "fwd_bwd_ms": 5.0, "same_grads": False},  # faster, but wrong
            {"tiles": "32,64,64,32,1,4", "error": "OutOfResources: shared memory"},
            {"tiles": "64,64,64,64,1,8", "fwd_bwd_ms": 8.0, "same_grads": True}]
    assert best(rows) == {"bench": "flex_sweep_best", "tiles": "64,64,64,64,1,8", "fwd_bwd_ms": 8.0,
                          "torch_fwd_bwd_ms": 10.0, "speedup_vs_torch": 1.25}
    assert best(rows[1:3]) is None
    # torch's tiles come first (the gradients' reference), once; given lists replace the built-in ones
    assert candidates_for(128, ["32,64,64,32,3,4", "torch"]) == [None, (32, 64, 64, 32, 3, 4)]
    large, small = candidates_for(256, []), candidates_for(128, [])
    assert large[0] is None and small[0] is None and large != small and len(set(large)) == len(large)


def test_flex_sweep_takes_the_recipe_shape_without_building_its_target():
    """--e2e qwen35-9b --flex-sweep needs only the shapes: the 9B target is built on the meta device."""
    import argparse

    from data.bench import recipe_spec
    from train.bench import _e2e_setup

    a = argparse.Namespace(e2e="qwen35-9b", taps=3, target_layers=None, layers=2, seq=256, anchors=[32], block=8,
                           grad_accum=None)
    target = _e2e_setup(a, ["--e2e", "qwen35-9b"], recipe_spec("qwen35-9b"), "meta")
    assert next(target.model.parameters()).device.type == "meta"
    assert (a.hidden, a.heads, a.kv_heads, a.head_dim) == (4096, 16, 4, 256)
    assert (a.seq, a.anchors, a.block, a.layers, a.taps, a.grad_accum) == (3072, [512], 16, 5, 5, 4)


def test_causal_conv_silu_equals_a_padded_depthwise_conv():
    """The fused mixer's conv (shifted multiply-adds on [batch, time, channels]) against nn.Conv1d's
    own padded depthwise conv on [batch, channels, time], kernel 4 and 2, with and without a bias."""
    import torch.nn.functional as F

    from models.gated_deltanet import causal_conv_silu

    g = torch.Generator().manual_seed(0)
    for kernel, bias in ((4, False), (2, True)):
        conv = torch.nn.Conv1d(12, 12, kernel, groups=12, padding=kernel - 1, bias=bias)
        x = torch.randn(3, 9, 12, generator=g)
        ref = F.silu(conv(x.transpose(1, 2))[:, :, :9]).transpose(1, 2)
        assert_close(causal_conv_silu(x, conv.weight, conv.bias), ref, atol=1e-6, what=f"kernel {kernel}")
        # causal: the first output sees only the first input
        moved = x.clone()
        moved[:, 1:] += 1
        assert_close(causal_conv_silu(moved, conv.weight, conv.bias)[:, 0], ref[:, 0], atol=1e-6, what="causal")


@pytest.mark.parametrize("arch,dtype,atol", [("qwen3_5", torch.float32, 5e-6), ("qwen3_5", torch.bfloat16, 3e-2),
                                             ("qwen3_5_moe", torch.float32, 5e-6)])
def test_fused_gated_deltanet_layer_equals_the_layer(arch, dtype, atol, caplog, monkeypatch):
    """models.gated_deltanet's two halves around the chunked kernel give the transformers decoder layer's
    output, grouped value heads (2 q/k heads for 4 v heads) and a padding mask included, with the four
    input projections separate and joined into one weight; a pass with a cache or packed sequences runs
    the layer's own forward."""
    from models import gated_deltanet as gdn
    from models.tiny import tiny_target

    target = tiny_target(arch).to(dtype)
    layer = target.model.layers[0]
    mixer = layer.linear_attn
    assert mixer.num_v_heads == 2 * mixer.num_k_heads and gdn.fusable(layer)
    x = torch.randn(2, 70, target.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :9] = 0  # left padding
    call = dict(position_embeddings=None)  # a linear-attention layer takes them and ignores them
    refs = {m is not None: layer(x, attention_mask=m, **call) for m in (None, mask)}
    for joined in (False, True):
        if joined:
            assert gdn.join_input_projections(mixer) and mixer.in_proj_joined.shape[0] == sum(
                p.out_features for p in (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a))
            # the layer's own forward (a pass with a cache) reads the same weights, now views of the joined one
            start = mixer.in_proj_joined.data_ptr()
            assert mixer.in_proj_a.weight.data_ptr() > mixer.in_proj_qkv.weight.data_ptr() == start
            assert "in_proj_joined" not in layer.state_dict()
            assert torch.equal(layer(x, attention_mask=mask, **call), refs[True])
        fused = gdn.uncached_forward(layer, gdn.layer_inputs, gdn.layer_output)
        for m in (None, mask):
            got = fused(x, attention_mask=m, use_cache=False, cache=None, position_ids=None)
            assert_close(got.float(), refs[m is not None].float(), atol=atol,
                         what=f"{dtype} fused layer, mask {m is not None}, joined {joined}")
            assert got.dtype == x.dtype
        # with the layer's own conv in place of the shifted sums the rest is the layer's math to the bit; the
        # joined matmul's products are the same, but the CPU's GEMM blocks a wider weight another way
        own = gdn.uncached_forward(layer, _with_conv1d(gdn.layer_inputs), gdn.layer_output)(x, attention_mask=mask)
        if joined:
            assert_close(own.float(), refs[True].float(), atol=atol, what=f"{dtype} joined, the layer's conv")
        else:
            assert torch.equal(own, refs[True])

    calls = []
    layer.forward = lambda *a, **k: calls.append(sorted(k)) or "own"
    fused = gdn.uncached_forward(layer, gdn.layer_inputs, gdn.layer_output)
    monkeypatch.setattr(gdn, "_SAID", set())  # said once per process: this test's own count
    with caplog.at_level(logging.WARNING, logger="models.gated_deltanet"):
        assert fused(hidden_states=x, cache=object()) == "own"
        assert fused(x, past_key_values=object()) == "own"
        assert not caplog.records  # a cached pass is expected to take the layer's own forward: nothing said
        for _ in range(2):
            assert fused(hidden_states=x, cu_seq_lens_q=torch.tensor([0, 70])) == "own"
            assert fused(x, object()) == "own"
    assert len(calls) == 6
    # said once per kind of call, naming what sent it there
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "cu_seq_lens_q" in said[0] and "2 positional arguments" in said[1], said


def test_input_projections_are_joined_only_when_plain_linears():
    """A quantized or biased projection keeps its four matmuls (join_input_projections says False and
    changes nothing); joining twice keeps the first joined weight."""
    from models import gated_deltanet as gdn
    from models.tiny import tiny_target

    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    before = mixer.in_proj_b.weight
    mixer.in_proj_b = torch.nn.Linear(before.shape[1], before.shape[0], bias=True)
    assert not gdn.join_input_projections(mixer) and getattr(mixer, "in_proj_joined", None) is None

    class Quantized(torch.nn.Linear):  # a subclass (bitsandbytes' Linear4bit is one) computes its own way
        pass

    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    mixer.in_proj_a.__class__ = Quantized
    assert not gdn.join_input_projections(mixer)
    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    mixer.in_proj_z.to(torch.bfloat16)
    assert not gdn.join_input_projections(mixer)
    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    assert gdn.join_input_projections(mixer)
    first = mixer.in_proj_joined
    assert gdn.join_input_projections(mixer) and mixer.in_proj_joined is first


def _with_conv1d(inputs):
    """``layer_inputs`` whose conv is the layer's own ``F.conv1d`` on the transposed projection."""
    import torch.nn.functional as F

    from models import gated_deltanet as gdn

    def conv(x, weight, bias=None):
        t, k = x.shape[1], weight.shape[-1]
        out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, bias, padding=k - 1, groups=weight.shape[0])
        return F.silu(out[:, :, :t]).transpose(1, 2).to(x.dtype)

    def patched(layer, x, mask):
        original, gdn.causal_conv_silu = gdn.causal_conv_silu, conv
        try:
            return inputs(layer, x, mask)
        finally:
            gdn.causal_conv_silu = original
    return patched


@pytest.mark.parametrize("version,grouped", [("0.6.0", True), ("0.5.1", False), ("0.4", False)])
def test_older_fla_gets_its_q_k_heads_repeated(monkeypatch, version, grouped):
    """flash-linear-attention takes q/k with fewer heads than v from 0.6 on; older versions get them
    repeated per value head, which gives the grouped math (checked on the torch reference)."""
    import sys
    import types

    from models import gated_deltanet as gdn
    from models.tiny import tiny_target

    mixer = tiny_target("qwen3_5").model.layers[0].linear_attn
    reference = gdn.chunk_kernel(mixer)  # CPU: transformers' torch reference
    seen = []

    def kernel(q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2], v.shape[2]))
        return reference(q, k, v, **kwargs)

    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__=version))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", types.SimpleNamespace(chunk_gated_delta_rule=kernel))
    fla = gdn.fla_kernel()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 10, 2, 8, generator=g)
    v = torch.randn(1, 10, 4, 8, generator=g)
    gate, beta = -torch.rand(1, 10, 4, generator=g), torch.rand(1, 10, 4, generator=g)
    kw = dict(g=gate, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    got, _ = fla(q, k, v, **kw)
    assert seen == [(2, 2, 4) if grouped else (4, 4, 4)]
    assert_close(got, reference(q, k, v, **kw)[0], atol=1e-6, what=f"fla {version}")


def test_fused_layer_needs_its_parts_and_a_kernel():
    """A layer whose mixer lacks the parts (another transformers layout) or has another activation, a layer
    without its MLP, one offloaded to meta, or an attention layer is not run by models.gated_deltanet."""
    from models import gated_deltanet as gdn
    from models.tiny import tiny_target

    layer = tiny_target("qwen3_5").model.layers[0]
    mixer = layer.linear_attn
    assert gdn.fusable(layer)
    mixer.activation = "gelu"
    assert not gdn.fusable(layer)
    mixer.activation = "silu"
    del mixer.in_proj_z
    assert not gdn.fusable(layer)
    other = tiny_target("qwen3_5").model.layers[0]
    assert gdn.fusable(other)
    other.mlp.to("meta")
    assert not gdn.fusable(other)
    del other.mlp
    assert not gdn.fusable(other)
    attention = tiny_target("qwen3_5").model.layers[3]
    assert not hasattr(attention, "linear_attn") and not gdn.fusable(attention)
