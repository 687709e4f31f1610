"""Speed paths of this stage held to their plain counterparts (same results, CPU): no timing is checked."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close

PROMPT = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]


NEW, B = 24, 8


MISTAKES = {len(PROMPT) + k for k in (3, 4, 12, 17, 19)}


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_5_moe", "glm4_moe"])
def test_static_loop_equals_eager_loop(tiny_targets, arch):
    """Same tokens and acceptance lengths as the eager loop: planted mistakes (exact acceptance known)
    and a random drafter through the static drafter pass (same drafts as the eager drafter)."""
    from inference.static_loop import (
        StaticDrafterProposer,
        StaticTarget,
        static_dflash_generate,
        static_target_generate,
    )
    from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
    from models.drafter import DFlashDraftModel
    from tests.helpers import ReferenceProposer, expected_acceptance, tiny_drafter_config

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
        assert torch.equal(a.drafts, b.drafts) and p_s.context_length() == p_e.context_length() == start
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
    from inference.static_loop import StaticTarget, static_dflash_generate, static_target_generate
    from inference.torch_loop import target_generate
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer
    from tests.helpers import ReferenceProposer, expected_acceptance

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
    from inference.static_loop import StaticDrafterProposer
    from models.drafter import DFlashDraftModel
    from tests.helpers import tiny_drafter_config

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
    from inference.static_loop import build_static_loop, static_dflash_generate
    from models.drafter import DFlashDraftModel
    from tests.helpers import tiny_drafter_config

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
    from inference import static_target
    from inference.static_loop import (
        StaticDrafterProposer,
        StaticTarget,
        resident_cycle,
        static_dflash_generate,
        static_target_generate,
    )
    from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
    from models.drafter import DFlashDraftModel
    from tests.helpers import tiny_drafter_config

    def emulated_capture(self):
        if not self.use_graph:
            return self.fn()
        if self.graph is None:
            self.warm_up()
            self.graph = "captured"
        return self.fn()

    monkeypatch.setattr(static_target.GraphedPass, "__call__", emulated_capture)
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
    resident_graphs = [resident_cycle(st, proposer)._graph, resident_cycle(st, None)._graph]
    assert all(p.graph == "captured" for p in [*st._passes.values(), proposer.graphed_pass(), *resident_graphs])


def test_graph_warm_up_runs_twice_each_from_the_saved_state():
    """Both untimed runs before a capture start from the committed state, and leave it as it was."""
    from inference.static_target import GraphedPass

    state, seen = torch.zeros(1), []

    def step():  # a pass that reads its state and advances it, as a GatedDeltaNet pass does
        seen.append(state.item())
        state.add_(1)

    GraphedPass(step, use_graph=False, mutable=[state]).warm_up()
    assert seen == [0.0, 0.0] and state.item() == 0.0


def test_session_static_loop_equals_eager_loop(tmp_path):
    """generate / validate --loop static (the default on a GPU for full-attention targets): same tokens,
    acceptance lengths and baseline as the eager loop; auto stays eager off CUDA."""
    from inference.bench import tiny_folders
    from inference.session import Session

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
    session = Session("torch", target, draft, "cpu", "float32", loop="static", block_size=2)
    result, base = session.run(prompt, baseline=True, block_size=2, max_new_tokens=24, eos_token_ids=[])
    assert session.describe()["loop"] == "eager" and session._static is None
    assert result.tokens == base.tokens == runs["eager"][3]


def test_session_static_loop_on_a_hybrid_target_and_what_auto_picks(tmp_path, caplog):
    """--loop static runs Qwen3.5 (GatedDeltaNet) with the eager loop's tokens; auto on a GPU picks static for
    full-attention targets and keeps hybrid ones eager (their graph replay is checked in test_cuda.py)."""
    from inference.bench import tiny_folders
    from inference.session import Session, choose_loop

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

    assert choose_loop("auto", OnGpu(hybrid.target), hybrid.proposer.drafter) == "eager"
    assert "--loop static runs the CUDA-graph loop" in caplog.text  # says what it left on the table
    assert choose_loop("static", OnGpu(hybrid.target), hybrid.proposer.drafter) == "static"
    assert choose_loop("auto", OnGpu(dense.target), dense.proposer.drafter) == "static"
    assert choose_loop("auto", dense.target, dense.proposer.drafter) == "eager"  # CPU


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
