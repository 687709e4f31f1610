"""The device-resident greedy cycle and step (inference/static_loop.py: ResidentCycle, ResidentDecode) against
the eager loop and the two-graph static loop, graphs off (CPU): same tokens, acceptance lengths and stops."""

import pytest
import torch

from tests.helpers import expected_acceptance, reference_drafts, tiny_drafter_config

PROMPT = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
NEW, B = 24, 8
MISTAKES = {len(PROMPT) + k for k in (3, 4, 12, 17, 19)}


def _static(target, new=NEW, seed=1):
    from inference.static_loop import StaticDrafterProposer, StaticTarget
    from models.drafter import DFlashDraftModel

    torch.manual_seed(seed)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(PROMPT) + new + 2 * B, block_size=B)
    return drafter, st, StaticDrafterProposer(drafter, target, max_len=st.max_len)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_5_moe"])
def test_resident_cycle_gives_the_planted_acceptance_lengths(tiny_targets, arch):
    from inference.static_loop import static_dflash_generate
    from inference.torch_loop import target_generate

    target = tiny_targets(arch)
    ref = target_generate(target, PROMPT, NEW + 2 * B, eos_token_ids=[])
    _, st, proposer = _static(target)
    reference_drafts(proposer, PROMPT + ref.tokens, MISTAKES)
    want = expected_acceptance(len(PROMPT), NEW, B, MISTAKES)
    for resident in (True, False, True):  # the second resident run reuses the cycle and its buffers
        res = static_dflash_generate(st, proposer, PROMPT, NEW, eos_token_ids=[], resident=resident)
        assert res.tokens == ref.tokens[:NEW], resident
        assert res.acceptance_lengths == want, resident


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_resident_cycle_with_a_random_drafter_equals_the_eager_loop_and_stops_where_it_does(tiny_targets, arch):
    """A random drafter through the real static pass, with an EOS in the middle of the output and token
    budgets that end inside a block; prompts of 1 token, of one block and longer."""
    from inference.static_loop import static_dflash_generate
    from inference.torch_loop import DrafterProposer, dflash_generate, target_generate

    target = tiny_targets(arch)
    drafter, st, proposer = _static(target)
    ref = target_generate(target, PROMPT, NEW, eos_token_ids=[])
    runs = [(PROMPT, NEW, []), (PROMPT, 13, []), (PROMPT, NEW, [ref.tokens[9]]), (PROMPT[:1], 11, []),
            (PROMPT[:B], NEW, []), (PROMPT[:5], 3, [])]
    for prompt, new, eos in runs:
        eager = dflash_generate(target, DrafterProposer(drafter, target), prompt, new, eos_token_ids=eos)
        for resident in (True, False):
            got = static_dflash_generate(st, proposer, prompt, new, eos_token_ids=eos, resident=resident)
            assert got.tokens == eager.tokens, (len(prompt), new, eos, resident)
            assert got.acceptance_lengths == eager.acceptance_lengths, (len(prompt), new, eos, resident)
            assert got.stop_reason == eager.stop_reason
            assert got.position_accepts == eager.position_accepts


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_resident_step_equals_target_only_decoding(tiny_targets, arch):
    from inference.static_loop import static_target_generate
    from inference.torch_loop import target_generate

    target = tiny_targets(arch)
    _, st, _ = _static(target)
    ref = target_generate(target, PROMPT, NEW, eos_token_ids=[])
    for prompt, new, eos in [(PROMPT, NEW, []), (PROMPT, NEW, [ref.tokens[6]]), (PROMPT[:1], 9, []),
                             (PROMPT[:B], 9, []), (PROMPT[:3], 9, []), (PROMPT, 1, [])]:
        want = target_generate(target, prompt, new, eos_token_ids=eos)
        for resident in (True, False):
            got = static_target_generate(st, prompt, new, eos_token_ids=eos, resident=resident)
            assert got.tokens == want.tokens, (len(prompt), new, eos, resident)
            assert got.acceptance_lengths == want.acceptance_lengths
            assert got.stop_reason == want.stop_reason


def test_the_host_refuses_a_cycle_whose_device_acceptance_disagrees_with_its_own(tiny_targets, monkeypatch):
    from inference import static_loop
    from inference.static_loop import static_dflash_generate

    target = tiny_targets("qwen3")
    _, st, proposer = _static(target)
    real = static_loop.ResidentCycle._cycle

    def miscounted(self):
        out = real(self)
        out[-1] += 1  # one accepted draft more than the drafts and tokens show
        return out

    monkeypatch.setattr(static_loop.ResidentCycle, "_cycle", miscounted)
    with pytest.raises(RuntimeError, match="the device accepted 1 drafts, the host 0"):
        static_dflash_generate(st, proposer, PROMPT, NEW, eos_token_ids=[])


def test_resident_loops_stop_before_the_static_caches_overflow(tiny_targets):
    """A budget past the caches' positions ends in a clear error before a pass would write past them."""
    from inference.static_loop import static_dflash_generate, static_target_generate

    target = tiny_targets("qwen3")
    _, st, proposer = _static(target, new=4)  # max_len = prompt + 4 + 2 blocks
    with pytest.raises(ValueError, match="raise max_len"):
        static_dflash_generate(st, proposer, PROMPT, 200, eos_token_ids=[])
    with pytest.raises(ValueError, match="raise max_len"):
        static_target_generate(st, PROMPT, 200, eos_token_ids=[])
    # and the same objects run a generation that fits afterwards
    assert len(static_target_generate(st, PROMPT, 4, eos_token_ids=[]).tokens) == 4


def test_the_stacked_draft_weights_leave_the_drafter_usable_trainable_and_savable(tiny_targets, tmp_path):
    """The static pass stacks each layer's q|k|v and gate|up weights and re-points the drafter's own at
    them: the same Parameter objects (an optimizer's references stay live), the same values, sharing the
    stacked storage (no second copy), and a save afterwards writes and reloads the same weights."""
    from inference.static_loop import StaticDrafterProposer
    from models.drafter import DFlashDraftModel

    target = tiny_targets("qwen3")
    torch.manual_seed(3)
    drafter = DFlashDraftModel(tiny_drafter_config(target)).eval()
    params = dict(drafter.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    proposer = StaticDrafterProposer(drafter, target, max_len=64)
    after = dict(drafter.named_parameters())
    assert all(after[k] is params[k] for k in params)
    assert all(torch.equal(after[k], before[k]) for k in before)
    q = drafter.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().data_ptr() == proposer._qkv[0].untyped_storage().data_ptr()
    drafter.save_pretrained(tmp_path / "d")
    reloaded = DFlashDraftModel.from_pretrained(tmp_path / "d").state_dict()
    assert all(torch.equal(reloaded[k], before[k]) for k in before)


def test_resident_passes_record_no_autograd_graph(tiny_targets):
    """The drafter's weights require grad: a cycle or step run with autograd on would record every pass
    (memory, time; inside a CUDA graph capture too). Both run under no_grad whatever the caller's mode."""
    from inference.static_loop import static_dflash_generate, static_target_generate

    target = tiny_targets("qwen3")
    _, st, proposer = _static(target)
    modes, real_draft, real_pass = [], proposer.block_pass, st._pass
    proposer.block_pass = lambda feats: modes.append(torch.is_grad_enabled()) or real_draft(feats)
    st._pass = lambda *a, **k: modes.append(torch.is_grad_enabled()) or real_pass(*a, **k)
    assert torch.is_grad_enabled()
    res = static_dflash_generate(st, proposer, PROMPT, 12, eos_token_ids=[])
    static_target_generate(st, PROMPT, 6, eos_token_ids=[])
    assert res.tokens and len(modes) > 2 * len(res.acceptance_lengths) and not any(modes)
