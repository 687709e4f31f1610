"""The torch DFlash loop is lossless, accepts exactly what it should, and rolls caches back exactly."""

import pytest
import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from inference.cycle import sample
from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
from models.drafter import DFlashDraftModel
from models.target import cache_kwarg
from models.tiny import MOE_FAMILY_ARCHS
from tests.helpers import ReferenceProposer, assert_close, expected_acceptance, tiny_drafter_config

ARCHS = ["qwen3", "llama", "qwen3_5"]
# gpt-oss (sliding windows of 8 with sinks), Gemma 4 31B-like, the multimodal 26B-A4B-like, E-model (KV sharing)
FAMILIES = ["gpt_oss", "gemma4_text", "gemma4", "gemma4_e"]
PROMPT = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
NEW, B = 64, 8
MISTAKES = {len(PROMPT) + k for k in (3, 4, 12, 30, 31, 33, 47, 50, 58)}


@pytest.fixture(scope="module")
def runs(tiny_targets):
    """Per architecture (built on first use): the target, its greedy reference (with slack past NEW)
    and a random drafter."""
    built = {}

    def get(arch):
        if arch not in built:
            target = tiny_targets(arch)
            ref = target_generate(target, PROMPT, NEW + 2 * B, eos_token_ids=[])
            torch.manual_seed(1)
            drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
            built[arch] = (target, PROMPT + ref.tokens, drafter)
        return built[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS + ["qwen3_moe", "qwen3_5_moe", *MOE_FAMILY_ARCHS, "gpt_oss", "gemma4",
                                  "gemma4_e"])
def test_random_drafter_is_lossless(runs, arch):
    target, seq, drafter = runs(arch)
    res = dflash_generate(target, DrafterProposer(drafter, target), PROMPT, NEW, eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    assert 1.0 <= res.tau < 1.5  # a random drafter is (almost) never right
    assert sum(res.acceptance_lengths) + 1 >= NEW


@pytest.mark.parametrize("arch", ARCHS)
def test_perfect_stand_in_accepts_whole_blocks(runs, arch):
    target, seq, drafter = runs(arch)
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, NEW,
                          eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    *full, last = res.acceptance_lengths  # the last cycle is cut by the token budget: it counts what it emitted
    assert full == [B] * len(full) and last == (NEW - 1) % B == 7 and sum(res.acceptance_lengths) == NEW - 1
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), NEW, B, set())
    assert res.tau == (NEW - 1) / len(res.acceptance_lengths)
    assert res.position_accepts == [len(full) + (k < last) for k in range(B - 1)]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_baseline_is_the_cycle_without_a_drafter(tiny_targets, monkeypatch, arch):
    """target_generate (eager) and static_target_generate (two-graph and device-resident) are the one cycle with
    NoDrafter: every block is the bonus token alone (one target pass of one token per cycle), the tokens are the
    target's greedy ones (full forwards without a cache: an independent reference) and every cycle commits
    exactly one token."""
    from inference import cycle, static_loop, torch_loop
    from inference.static_loop import StaticTarget, static_target_generate

    target = tiny_targets(arch)
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(24):
            seq.append(int(target.model(torch.tensor([seq])).logits[0, -1].argmax()))
    cycles, blocks = [], []
    real_generate, real_verify = cycle.generate, torch_loop.DynamicTarget.verify
    for loop in (torch_loop, static_loop):
        monkeypatch.setattr(loop, "generate", lambda t, proposer, *a, **k: cycles.append(proposer)
                            or real_generate(t, proposer, *a, **k))
    monkeypatch.setattr(torch_loop.DynamicTarget, "verify", lambda self, block, start: blocks.append(
        (tuple(block.shape), start)) or real_verify(self, block, start))
    eager = target_generate(target, PROMPT, 24, eos_token_ids=[])
    assert [type(p) for p in cycles] == [cycle.NoDrafter]
    assert blocks == [((1, 1), len(PROMPT) + k) for k in range(23)]  # one one-token pass per cycle
    st = StaticTarget(target, [1, 3], max_len=len(PROMPT) + 24 + 2 * B, block_size=B)
    for res in (eager, *(static_target_generate(st, PROMPT, 24, eos_token_ids=[], resident=r) for r in (False, True))):
        assert res.tokens == seq[len(PROMPT):]
        assert res.acceptance_lengths == [1] * 23 and res.block_size == 1 and res.position_accepts == []
    assert [type(p) for p in cycles] == [cycle.NoDrafter] * 3


def test_a_cycle_cut_by_eos_counts_only_what_it_emitted(runs):
    """The first EOS inside an accepted block is never emitted nor counted: tau x cycles = tokens decoded."""
    target, seq, drafter = runs("qwen3")
    gen = seq[len(PROMPT):len(PROMPT) + NEW]
    cut = next(i for i in range(B + 4, NEW) if gen[i] not in gen[:i])  # inside the second block or later
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, NEW,
                          eos_token_ids=[gen[cut]])
    assert res.tokens == gen[:cut] and res.stop_reason == "eos"
    *full, last = res.acceptance_lengths
    assert full == [B] * len(full) and last == (cut - 1) - B * len(full) < B
    assert res.tau * len(res.acceptance_lengths) == pytest.approx(cut - 1)
    base = target_generate(target, PROMPT, NEW, eos_token_ids=[gen[cut]])  # its steps count the same way
    assert base.tokens == gen[:cut] and sum(base.acceptance_lengths) == cut - 1 == len(base.acceptance_lengths) - 1


@pytest.mark.parametrize("arch", ARCHS + list(MOE_FAMILY_ARCHS) + FAMILIES)
def test_planted_mistakes_give_exact_acceptance_lengths(runs, arch):
    target, seq, drafter = runs(arch)
    proposer = ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES)
    res = dflash_generate(target, proposer, PROMPT, NEW, eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), NEW, B, MISTAKES)
    # Each draft got the target's features of exactly the positions committed since the last one
    # (prompt, then bonus + accepted drafts), as a full forward over the sequence computes them.
    full = target.forward(torch.tensor([seq]), drafter.config.target_layer_ids, with_logits=False).features
    assert [start for start, _ in proposer.received][:2] == [len(PROMPT), len(PROMPT) + res.acceptance_lengths[0]]
    for start, feats in proposer.received:
        assert_close(feats, full[:, start - feats.shape[1]:start], 1e-4, f"features handed over at {start}")


def test_hybrid_state_equals_a_fresh_prefill_after_every_cycle():
    # Tolerance 1e-4: a fresh prefill takes other kernel paths (chunked vs recurrent GatedDeltaNet, fp32
    # inside even for fp64 weights), which alone moves conv inputs (magnitude ~3) by up to 4.4e-5 with no
    # rollback involved at all. A wrong rollback is off by O(1); the exact mechanism test is below.
    from models.target import TargetModel
    from models.tiny import tiny_target, tiny_tokenizer

    target = TargetModel(tiny_target("qwen3_5"), tiny_tokenizer())
    seq = PROMPT + target_generate(target, PROMPT, 40 + 2 * B, eos_token_ids=[]).tokens
    checked = []

    def compare(cache, committed):
        fresh = target.new_cache()
        target.forward(torch.tensor([seq[:committed]]), cache=fresh, with_logits=False)
        for i, (layer, ref) in enumerate(zip(cache.layers, fresh.layers)):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                assert_close(layer.recurrent_states[0], ref.recurrent_states[0], 1e-4, f"layer {i} recurrent state")
                assert_close(layer.conv_states[0], ref.conv_states[0], 1e-4, f"layer {i} conv state")
            else:
                assert layer.get_seq_length() == committed
                assert_close(layer.keys, ref.keys, 1e-4, f"layer {i} keys")
        checked.append(committed)

    proposer = ReferenceProposer(seq, [1, 3, 5], B, 288, MISTAKES)
    res = dflash_generate(target, proposer, PROMPT, 40, eos_token_ids=[], on_cycle=compare)
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + 40]
    assert len(checked) == len(res.acceptance_lengths) and min(res.acceptance_lengths) < B  # partial blocks rolled back


@pytest.mark.parametrize("arch, keep", [("qwen3_5", 1), ("qwen3_5", 3), ("qwen3_5", 7), ("qwen3_next", 3)])
def test_rollback_restores_exactly_what_the_committed_tokens_give(tiny_targets, arch, keep):
    """Snapshot + replay vs feeding only the committed tokens: layer 0 sees identical inputs (embeddings),
    so it must agree to rounding; deeper layers within the noise of different kernel shapes. Qwen3-Next's
    GatedDeltaNet (fused projections) rolls back by the same snapshot + replay: transformers' own recording crop
    cuts its conv window but not its recurrent state (2.7 off in the logits), so it is never used."""
    from inference.rollback_torch import CacheRollback

    target = tiny_targets(arch)
    block = [11, 12, 13, 14, 15, 16, 17, 18]
    rolled, ref = target.new_cache(), target.new_cache()
    for cache in (rolled, ref):
        target.forward(torch.tensor([PROMPT]), cache=cache, with_logits=False)
    rollback = CacheRollback(target)
    with rollback.recording(rolled):
        target.forward(torch.tensor([block]), cache=rolled, with_logits=False)
    rollback.commit(rolled, keep=keep, block_len=len(block))
    target.forward(torch.tensor([block[:keep]]), cache=ref, with_logits=False)
    for i, (a, b) in enumerate(zip(rolled.layers, ref.layers)):
        tol = 1e-6 if i == 0 else 1e-4
        if isinstance(a, LinearAttentionCacheLayerMixin):
            assert_close(a.recurrent_states[0], b.recurrent_states[0], tol, f"layer {i} recurrent state")
            assert_close(a.conv_states[0], b.conv_states[0], tol, f"layer {i} conv state")
        else:
            assert a.get_seq_length() == b.get_seq_length() == len(PROMPT) + keep
    rollback.check(rolled, len(PROMPT) + keep)  # the state holds its snapshot + the keep committed tokens


@pytest.mark.parametrize("broken", ["no restore", "no replay", "replays the block", "replays without restoring",
                                    "replays too few"])
def test_check_sees_a_gated_delta_net_state_left_at_the_wrong_length(tiny_targets, broken):
    """The per-cycle check covers GatedDeltaNet states too (it once looked at attention caches only): a
    commit that crops attention but leaves the recurrent state at the verified block, restores it
    without replaying, or replays all of the block is caught, not turned into silently other tokens."""
    from inference.rollback_torch import CacheRollback

    target = tiny_targets("qwen3_5")
    block, keep = [11, 12, 13, 14, 15, 16, 17, 18], 3
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPT]), cache=cache, with_logits=False)
    rollback = CacheRollback(target)
    with rollback.recording(cache):
        target.forward(torch.tensor([block]), cache=cache, with_logits=False)
    whole = dict(rollback._inputs)
    if broken == "replays without restoring":  # crops attention, replays the kept tokens on the verified state
        rollback._kept = keep
        for layer in cache.layers:
            if not isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.crop(-(len(block) - keep))
        for i, module in rollback.linear:
            module(hidden_states=whole[i][:, :keep], attention_mask=None,
                   **{cache_kwarg(module, "cache_params"): cache})
        rollback.close()
    else:
        rollback.linear = {
            "no restore": [],  # commit crops the attention caches and skips the GatedDeltaNet layers
            "no replay": [(i, lambda **kw: None) for i, _ in rollback.linear],
            "replays the block": [(i, lambda m=m, i=i, **kw: m(**{**kw, "hidden_states": whole[i]}))
                                  for i, m in rollback.linear],
            "replays too few": rollback.linear,  # the recorded inputs lost the last kept token
        }[broken]
        if broken == "replays too few":
            rollback._inputs = {i: x[:, :keep - 1] for i, x in whole.items()}
        rollback.commit(cache, keep=keep, block_len=len(block))
    with pytest.raises(AssertionError, match="GatedDeltaNet"):
        rollback.check(cache, len(PROMPT) + keep)


def test_an_error_inside_a_cycle_leaves_no_hook_on_the_target(runs):
    """The rollback's hooks stay from the verify pass through commit; an error in between (a Ctrl-C at
    the host sync, a proposer out of step) once left them on the target's modules for good."""
    target, seq, _ = runs("qwen3_5")

    class OutOfStep(ReferenceProposer):
        def context_length(self) -> int:
            return 3

    with pytest.raises(RuntimeError, match="draft cache holds 3 positions"):
        dflash_generate(target, OutOfStep(seq, [1, 3, 5], B, 288), PROMPT, 16, eos_token_ids=[])
    assert all(not m._forward_pre_hooks for _, m in target.linear_attention_modules())


def test_a_rollback_that_leaves_the_target_cache_long_stops_the_loop(runs, monkeypatch):
    """The loop checks the rollback every cycle: a commit that crops nothing is an error at the first partial
    block (3 of 8 positions kept), not a generation that goes on from the wrong cache."""
    from inference import rollback_torch

    target, seq, drafter = runs("qwen3")
    monkeypatch.setattr(rollback_torch.CacheRollback, "commit", lambda self, cache, keep, block_len: None)
    proposer = ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES)
    with pytest.raises(AssertionError, match=f"layer 0 holds {len(PROMPT) + B} positions, committed length is "
                                             f"{len(PROMPT) + 3}"):
        dflash_generate(target, proposer, PROMPT, 16, eos_token_ids=[])


def test_a_proposer_without_a_context_count_is_not_checked(runs):
    """context_length() == -1 means the proposer keeps no context of its own: the loop runs it as any other."""
    target, seq, drafter = runs("qwen3")

    class Untracked(ReferenceProposer):
        def context_length(self) -> int:
            return -1

    res = dflash_generate(target, Untracked(seq, drafter.config.target_layer_ids, B, 288, MISTAKES), PROMPT, 24,
                          eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + 24]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), 24, B, MISTAKES)


def test_parts_add_each_part_up_over_the_cycles(runs, monkeypatch):
    """With a clock that ticks once per reading, every part of every cycle lasts one tick: each part's total is
    the number of cycles (each lap starts where the previous one ended, and adds to what the part had)."""
    import itertools
    import types

    from inference import cycle

    ticks = itertools.count()
    monkeypatch.setattr(cycle, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    target, seq, drafter = runs("qwen3")
    parts: dict[str, float] = {}
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES), PROMPT,
                          24, eos_token_ids=[], parts=parts)
    cycles = len(res.acceptance_lengths)
    assert cycles > 3 and parts == dict.fromkeys(["draft", "verify", "accept", "host", "rollback"], float(cycles))


def test_eos_inside_an_accepted_block_ends_generation_without_emitting_it(runs):
    target, seq, drafter = runs("qwen3")
    generated = seq[len(PROMPT):]
    eos = generated[21]
    cut = generated.index(eos)
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, NEW,
                          eos_token_ids=[eos])
    assert res.tokens == generated[:cut] and res.stop_reason == "eos"
    assert eos not in res.tokens


def test_eos_as_the_first_token_gives_nothing(runs):
    target, seq, drafter = runs("llama")
    res = dflash_generate(target, DrafterProposer(drafter, target), PROMPT, NEW, eos_token_ids=[seq[len(PROMPT)]])
    assert res.tokens == [] and res.acceptance_lengths == [] and res.stop_reason == "eos"


@pytest.mark.parametrize("max_new", [1, 2, 9, 37])
def test_max_new_tokens_is_exact(runs, max_new):
    target, seq, drafter = runs("qwen3")
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, max_new,
                          eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + max_new]


def test_smaller_block_than_trained_is_lossless(runs):
    target, seq, drafter = runs("qwen3_5")
    res = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES),
                          PROMPT, 30, block_size=4, eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + 30]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), 30, 4, MISTAKES)
    with pytest.raises(ValueError, match="between 2 and the drafter's trained block size 8"):
        dflash_generate(target, DrafterProposer(drafter, target), PROMPT, 5, block_size=9)


def test_temperature_sampling_is_seeded_and_exact_in_length(runs):
    target, seq, drafter = runs("qwen3")
    a = dflash_generate(target, DrafterProposer(drafter, target), PROMPT, 30, temperature=0.8, seed=3, eos_token_ids=[])
    b = dflash_generate(target, DrafterProposer(drafter, target), PROMPT, 30, temperature=0.8, seed=3, eos_token_ids=[])
    assert a.tokens == b.tokens and len(a.tokens) == 30
    assert a.tokens != seq[len(PROMPT):len(PROMPT) + 30]  # sampling departs from greedy on a random target
    cold = dflash_generate(target, DrafterProposer(drafter, target), PROMPT, 30, temperature=1e-4, eos_token_ids=[])
    assert cold.tokens == seq[len(PROMPT):len(PROMPT) + 30]


def test_every_committed_token_is_drawn_at_the_temperature_from_the_seed(runs):
    """The prefill's token and every verify pass's tokens are draws at the requested temperature from the seeded
    generator: at a high temperature the first token moves with the seed, and what follows it is not the greedy
    continuation of it."""
    target, seq, drafter = runs("qwen3")
    out = {s: dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288), PROMPT, 12,
                              temperature=50.0, seed=s, eos_token_ids=[]).tokens for s in (0, 1, 2)}
    assert len({tuple(t) for t in out.values()}) == 3
    assert any(t[0] != seq[len(PROMPT)] for t in out.values())
    for tokens in out.values():
        assert len(tokens) == 12
        assert tokens[1:] != target_generate(target, PROMPT + tokens[:1], 11, eos_token_ids=[]).tokens


def test_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(40000, 4), temperature=0.7, generator=gen)
    freq = torch.bincount(draws, minlength=4).double() / 40000
    assert_close(freq, torch.softmax(logits.double() / 0.7, 0), atol=0.01, what="sample frequencies")
    greedy = torch.tensor([[[0.0, 1.0, 3.0], [3.0, 0.0, 1.0]]])  # row-wise argmax, the last id included
    assert sample(greedy, 0.0).tolist() == [[2, 0]] and sample(greedy, 1e-6, gen).tolist() == [[2, 0]]


def test_mismatched_drafter_and_target_is_refused(runs):
    target, _, _ = runs("qwen3")
    wrong = DFlashDraftModel(tiny_drafter_config(target, num_target_layers=12, target_layer_ids=[1, 5, 9]))
    with pytest.raises(ValueError, match="num_target_layers=12: the target has 8 decoder layers"):
        DrafterProposer(wrong, target)


def test_sliding_window_target_rolls_back_past_a_full_window():
    """A target with sliding-window layers (window 6 < prompt): its cache keeps full layers so the rollback
    can crop them once the window is full (transformers' sliding layer refused crop there), and the
    loop's tokens equal greedy decoding by full forwards without any cache, an independent reference."""
    from transformers import AutoModelForCausalLM

    from models.target import TargetModel
    from models.tiny import tiny_config

    cfg = tiny_config("qwen3", 288, 6)
    cfg.use_sliding_window, cfg.sliding_window, cfg.max_window_layers = True, 6, 0
    cfg.layer_types = ["sliding_attention", "full_attention"] * 3
    torch.manual_seed(0)
    target = TargetModel(AutoModelForCausalLM.from_config(cfg).eval())
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(40 + 2 * B):
            seq.append(int(target.model(torch.tensor([seq])).logits[0, -1].argmax()))
    res = dflash_generate(target, ReferenceProposer(seq, [1, 3, 5], B, 288, MISTAKES), PROMPT, 40,
                          eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + 40]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), 40, B, MISTAKES)
    assert target_generate(target, PROMPT, 40, eos_token_ids=[]).tokens == res.tokens


# ----------------------------------------------------------------------------- rollback, small cases
def _verified_block(target, block):
    """A cache holding PROMPT, and a CacheRollback that has recorded the verify pass of ``block``."""
    from inference.rollback_torch import CacheRollback

    cache = target.new_cache()
    target.forward(torch.tensor([PROMPT]), cache=cache, with_logits=False)
    rollback = CacheRollback(target)
    with rollback.recording(cache):
        target.forward(torch.tensor([block]), cache=cache, with_logits=False)
    return cache, rollback


def test_a_fully_accepted_block_runs_no_gated_delta_net_layer_again(tiny_targets):
    """The verified states already hold every token of the block: no restore, no replay."""
    target = tiny_targets("qwen3_5")
    block = [11, 12, 13, 14, 15, 16, 17, 18]
    cache, rollback = _verified_block(target, block)
    calls = []
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for _, m in rollback.linear]
    try:
        rollback.commit(cache, keep=len(block), block_len=len(block))
    finally:
        for h in handles:
            h.remove()
    assert calls == [] and rollback.linear
    rollback.check(cache, len(PROMPT) + len(block))


@pytest.mark.parametrize("restored", ["conv window", "recurrent state"])
def test_check_sees_a_commit_that_restored_only_one_of_the_two_states(tiny_targets, restored):
    """The replay counts from zero only when both states were written since the verify pass; one of them
    left at the verified block is a state past the committed length."""
    target = tiny_targets("qwen3_5")
    block, keep = [11, 12, 13, 14, 15, 16, 17, 18], 3
    cache, rollback = _verified_block(target, block)
    inputs = dict(rollback._inputs)
    rollback._kept = keep
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.crop(-(len(block) - keep))
    for i, module in rollback.linear:
        conv, rec = rollback._snapshots[i]
        if restored == "conv window":
            cache.layers[i].conv_states[0].copy_(conv)
        else:
            cache.layers[i].recurrent_states[0].copy_(rec)
        module(hidden_states=inputs[i][:, :keep], attention_mask=None,
               **{cache_kwarg(module, "cache_params"): cache})
    rollback.close()
    with pytest.raises(AssertionError, match="GatedDeltaNet"):
        rollback.check(cache, len(PROMPT) + keep)


def test_an_error_in_the_verify_pass_leaves_no_hook_on_the_target(tiny_targets):
    from inference.rollback_torch import CacheRollback

    target = tiny_targets("qwen3_5")
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPT]), cache=cache, with_logits=False)
    rollback = CacheRollback(target)
    with pytest.raises(RuntimeError, match="verify pass failed"), rollback.recording(cache):
        raise RuntimeError("verify pass failed")
    folded = dict(rollback._folded)
    target.forward(torch.tensor([[11, 12]]), cache=cache, with_logits=False)
    assert rollback._folded == folded and all(not m._forward_pre_hooks for _, m in rollback.linear)


def test_check_names_an_attention_cache_at_another_length(tiny_targets):
    from inference.rollback_torch import CacheRollback

    target = tiny_targets("qwen3")
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPT]), cache=cache, with_logits=False)
    rollback = CacheRollback(target)
    rollback.check(cache, len(PROMPT))
    for committed in (len(PROMPT) - 1, len(PROMPT) + 1):  # a cache too long, and one too short
        with pytest.raises(AssertionError, match=f"layer 0 holds {len(PROMPT)} positions, committed length is "
                                                 f"{committed}"):
            rollback.check(cache, committed)


def test_rollback_counts_each_verify_pass_once_and_keeps_nothing_after_commit(tiny_targets):
    """Between a verify pass and its commit the states hold the whole block, and the check says so; a verify
    pass recorded again before any commit (the first one abandoned) counts its tokens once, not through two sets
    of hooks; a commit leaves no hook and no recorded input behind."""
    target = tiny_targets("qwen3_5")
    block = [11, 12, 13, 14, 15, 16, 17, 18]
    cache, rollback = _verified_block(target, block)
    rollback.check(cache, len(PROMPT) + len(block))  # nothing rolled back yet
    rollback.commit(cache, keep=3, block_len=len(block))
    rollback.check(cache, len(PROMPT) + 3)
    assert rollback._inputs == {} and all(not m._forward_pre_hooks for _, m in rollback.linear)
    committed = len(PROMPT) + 3
    for _ in range(2):  # the first of these two passes is never committed
        with rollback.recording(cache):
            target.forward(torch.tensor([block]), cache=cache, with_logits=False)
        committed += len(block)
        rollback.check(cache, committed)  # the last commit's keep (3) is not this pass's
    rollback.commit(cache, keep=len(block), block_len=len(block))
    rollback.check(cache, committed)
    assert rollback._inputs == {} and all(not m._forward_pre_hooks for _, m in rollback.linear)


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_k25"])
def test_latent_attention_cache_crops_to_what_the_committed_tokens_give(tiny_targets, arch):
    """Multi-head latent attention (DeepSeek-V3, Kimi K2.5's text tower) caches one compressed latent and one
    rope key per position: the rollback crops both, and the cropped cache holds what feeding only the committed
    tokens gives, and decodes the next token to the same logits."""
    from inference.rollback_torch import CacheRollback

    target = tiny_targets(arch)
    block, keep = [11, 12, 13, 14, 15, 16, 17, 18], 3
    rolled, ref = target.new_cache(), target.new_cache()
    for cache in (rolled, ref):
        target.forward(torch.tensor([PROMPT]), cache=cache, with_logits=False)
    rollback = CacheRollback(target)
    assert rollback.linear == []
    with rollback.recording(rolled):
        target.forward(torch.tensor([block]), cache=rolled, with_logits=False)
    rollback.commit(rolled, keep=keep, block_len=len(block))
    rollback.check(rolled, len(PROMPT) + keep)
    target.forward(torch.tensor([block[:keep]]), cache=ref, with_logits=False)
    latent = target.config.kv_lora_rank
    for i, (a, b) in enumerate(zip(rolled.layers, ref.layers)):
        assert a.keys.shape == b.keys.shape == (1, 1, len(PROMPT) + keep, latent)  # the latent, not per-head K
        assert_close(a.keys, b.keys, 1e-5, f"layer {i} latent")
        assert_close(a.values, b.values, 1e-5, f"layer {i} rope key")
    step = [[21]]
    assert_close(target.forward(torch.tensor(step), cache=rolled).logits,
                 target.forward(torch.tensor(step), cache=ref).logits, 1e-5, "next-token logits")


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma4", "gemma4_e"])
def test_the_new_families_decode_as_full_forwards_without_a_cache(runs, arch):
    """The loop's tokens equal greedy decoding by full forwards without any cache (an independent reference):
    the sliding windows of 8 are crossed (prompt 20 + 36 tokens; the loop tests above roll partial blocks back
    through them over 64), and the sinks, the KV-shared layers and the soft-capped logits are the model's own."""
    target, seq, drafter = runs(arch)
    ref = list(PROMPT)
    with torch.no_grad():
        for _ in range(36):
            ref.append(int(target.model(torch.tensor([ref])).logits[0, -1].argmax()))
    assert ref == seq[:len(PROMPT) + 36]


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma4"])
def test_the_static_loop_refuses_the_new_families_and_auto_runs_them_eager(runs, monkeypatch, arch):
    """gpt-oss (sinks, which the static loop's SDPA would drop) and Gemma 4 are refused in one line by the static
    loop; --loop auto picks the eager loop for them, also on a GPU."""
    import types

    from inference.session import choose_loop
    from inference.static_loop import StaticTarget
    from inference.static_target import StaticLoopUnsupported, check_static_target

    target, _, drafter = runs(arch)
    word = "attention sinks" if arch == "gpt_oss" else "sliding-window layers"
    refused = f"cannot run {target.model_type}: .*{word}.*--loop eager"
    with pytest.raises(StaticLoopUnsupported, match=refused):
        check_static_target(target)
    with pytest.raises(StaticLoopUnsupported, match="cannot run"):
        StaticTarget(target, [1, 3], max_len=64, block_size=B)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda"), is_hybrid=False, layer_types=target.layer_types,
                                   model_type=target.model_type, model=target.model, family=target.family)
    assert choose_loop("auto", on_gpu, drafter) == "eager"
    with pytest.raises(StaticLoopUnsupported, match="cannot run"):
        choose_loop("static", on_gpu, drafter)
