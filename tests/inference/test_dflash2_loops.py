"""DFlash2 drafters in the torch loops: the selector walk at the cycle's proposal seam (eager, static with graphs
off, device-resident), lossless and with the same drafts, tokens and acceptance lengths in every loop; rejection
sampling against the walk's q; DFlash2 folders (ours and the published layout) in generate, validate and bench.
The MLX twin is tested in test_mlx_loop.py."""

import json

import numpy as np
import pytest
import torch

from inference.cycle import Proposal, accept, propose_block
from inference.static_loop import StaticDrafterProposer, StaticTarget, static_dflash_generate
from inference.stats import GenerationResult
from inference.torch_loop import DrafterProposer, dflash_generate, target_generate
from models.drafter import DFlashDraftModel
from tests.helpers import ReferenceProposer, expected_acceptance, reference_drafts, tiny_drafter_config
from tests.helpers.dflash2 import (REJECTION_P, REJECTION_T, bigram_dflash2, check_rejection_trials,
                                   published_folder, random_dflash2, rejection_trials, tiny_v2_config)

ARCHS = ["qwen3", "llama", "qwen3_5"]
PROMPT = [257, 85, 82, 68, 81, 198, 72, 68, 75, 75, 78, 258, 198, 257, 64, 82, 82, 72, 82, 83]
NEW, B = 40, 8
MISTAKES = {len(PROMPT) + k for k in (3, 4, 12, 17, 19, 30)}


@pytest.fixture(scope="module")
def runs(tiny_targets):
    """Per architecture: the target, its greedy continuation (prompt + NEW + slack), a random DFlash2 drafter (convs
    off identity, the selector on, every layer sliding with a window of 24 < the context) and a bigram one."""
    built = {}

    def get(arch):
        if arch not in built:
            target = tiny_targets(arch)
            seq = PROMPT + target_generate(target, PROMPT, NEW + 2 * B, eos_token_ids=[]).tokens
            built[arch] = (target, seq, random_dflash2(tiny_v2_config(target), seed=0), bigram_dflash2(target, seq))
        return built[arch]

    return get


def cycles_of(monkeypatch) -> list:
    """Every cycle's (drafts, target tokens) as the host records them, whatever the loop."""
    seen, real = [], GenerationResult.record_cycle

    def record(self, drafts, tokens, *a, **k):
        seen.append((list(drafts), list(tokens)))
        return real(self, drafts, tokens, *a, **k)

    monkeypatch.setattr(GenerationResult, "record_cycle", record)
    return seen


def every_loop(target, drafter, prompt, new, monkeypatch, **kw) -> dict:
    """The eager loop, the static loop's two-graph cycle and its device-resident cycle (graphs off on the CPU):
    result and the recorded cycles of each."""
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(prompt) + new + 2 * B, block_size=B)
    proposer = StaticDrafterProposer(drafter, target, max_len=st.max_len)
    assert not st.graphs and not proposer.graphs
    out = {}
    for name, run in (("eager", lambda: dflash_generate(target, DrafterProposer(drafter, target), prompt, new, **kw)),
                      ("static", lambda: static_dflash_generate(st, proposer, prompt, new, resident=False, **kw)),
                      ("resident", lambda: static_dflash_generate(st, proposer, prompt, new, **kw))):
        if name == "resident" and kw.get("temperature", 0) > 0:
            continue
        seen = cycles_of(monkeypatch)
        out[name] = (run(), seen)
        monkeypatch.undo()
    return out


# ------------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("arch", ARCHS)
def test_a_random_dflash2_drafter_is_lossless_with_the_same_drafts_in_every_loop(runs, arch, monkeypatch):
    """Greedy: the walk's drafts cycle by cycle, the target's tokens and the acceptance lengths are the same in
    the eager, static and resident loops, and the output is the target's own greedy continuation."""
    target, seq, drafter, _ = runs(arch)
    loops = every_loop(target, drafter, PROMPT, NEW, monkeypatch, eos_token_ids=[])
    (eager, eager_cycles), *others = loops.values()
    assert eager.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    for name, (res, cycles) in zip(list(loops)[1:], others):
        assert cycles == eager_cycles, name
        assert res.tokens == eager.tokens and res.acceptance_lengths == eager.acceptance_lengths, name
        assert res.position_accepts == eager.position_accepts, name


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bigram_walk_gives_multi_token_acceptance_equal_in_every_loop(runs, arch, monkeypatch):
    """A drafter whose selector walk follows the continuation's bigrams (its predecessors are its own picks):
    blocks accepted in part and in whole, the same in every loop, lossless."""
    target, seq, _, drafter = runs(arch)
    loops = every_loop(target, drafter, PROMPT, NEW, monkeypatch, eos_token_ids=[])
    (eager, eager_cycles), *others = loops.values()
    assert eager.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    assert max(eager.acceptance_lengths) >= 3 and min(eager.acceptance_lengths) == 1
    for name, (res, cycles) in zip(list(loops)[1:], others):
        assert cycles == eager_cycles and res.acceptance_lengths == eager.acceptance_lengths, name


def test_the_walk_decides_the_drafts(runs):
    """The selector is active in these tests: its walk differs from each slot's unary argmax, and its first
    predecessor is the bonus token (another bonus, other drafts from the bigram walk)."""
    target, seq, drafter, bigram = runs("qwen3")
    feats = target.forward(torch.tensor([seq[:len(PROMPT)]]), drafter.config.target_layer_ids,
                           with_logits=False).features
    differ = 0
    for d in (drafter, bigram):
        proposer = DrafterProposer(d, target)
        block = torch.tensor([[seq[len(PROMPT)]] + [d.config.mask_token_id] * (B - 1)])
        with torch.no_grad():
            hidden = d(d.embed(block), feats, torch.arange(len(PROMPT) + B)[None])
        walk = propose_block(d, hidden[:, 1:], block[:, 0]).drafts
        differ += int((walk != d.logits(hidden[:, 1:])[0].argmax(-1)).sum())
        if d is bigram:  # its first pick is the bonus token's successor
            assert not torch.equal(walk, propose_block(d, hidden[:, 1:], (block[:, 0] + 1) % 250).drafts)
        assert torch.equal(proposer.propose(seq[len(PROMPT)], feats, len(PROMPT), B).drafts, walk)
    assert differ >= 4


def test_a_block_smaller_than_the_drafters_is_one_shorter_block_of_the_convs(runs, tmp_path):
    """``--block-size`` below the trained one (the eager loop, DFlash and baseline): the convs take the shorter block
    as one block (their taps stop at its start), lossless; the session says it runs the eager loop."""
    from inference.session import Session
    from models.tiny import save_tiny_target

    target, seq, drafter, bigram = runs("qwen3")
    for d in (drafter, bigram):
        for block in (2, 5):
            res = dflash_generate(target, DrafterProposer(d, target), PROMPT, 24, block_size=block, eos_token_ids=[])
            assert res.tokens == seq[len(PROMPT):len(PROMPT) + 24] and max(res.acceptance_lengths) <= block
    target_dir = save_tiny_target(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "draft")
    session = Session("torch", str(target_dir), str(tmp_path / "draft"), "cpu", "float32", loop="static", block_size=4)
    result, base = session.run(PROMPT, baseline=True, block_size=4, max_new_tokens=16, eos_token_ids=[])
    assert session.describe()["loop"] == "eager" and result.tokens == base.tokens


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_resident_cycle_with_a_dflash2_drafter_gives_the_planted_acceptance_lengths(runs, arch):
    """The device-resident cycle with a DFlash2 static pass: its next-block proposal is the graphed pass (walk
    included); a pass that drafts the reference with planted mistakes gives the planted acceptance lengths,
    and the real pass the eager loop's (the test above)."""
    target, seq, drafter, _ = runs(arch)
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(PROMPT) + NEW + 2 * B, block_size=B)
    proposer = StaticDrafterProposer(drafter, target, max_len=st.max_len)
    reference_drafts(proposer, seq, MISTAKES)
    res = static_dflash_generate(st, proposer, PROMPT, NEW, eos_token_ids=[])
    assert res.tokens == seq[len(PROMPT):len(PROMPT) + NEW]
    assert res.acceptance_lengths == expected_acceptance(len(PROMPT), NEW, B, MISTAKES)
    # and the eager loop with the planted stand-in agrees on the same target
    eager = dflash_generate(target, ReferenceProposer(seq, drafter.config.target_layer_ids, B, 288, MISTAKES),
                            PROMPT, NEW, eos_token_ids=[])
    assert eager.acceptance_lengths == res.acceptance_lengths


@pytest.mark.parametrize("variant", ["dflash2", "dflash2 sampled", "v1 sliding causal"])
def test_the_static_pass_proposes_what_the_eager_drafter_proposes(runs, variant):
    """Cycle by cycle with uneven commits (so the sliding window of 24, or of 4, cuts the context): the same drafts,
    candidates and q from the static pass (convs and walk written out, uniforms from its buffer) as from the eager
    drafter, with the same generator seed."""
    target, seq, drafter, _ = runs("qwen3")
    T = 0.7 if variant.endswith("sampled") else 0.0
    if variant.startswith("v1"):  # window smaller than the block, causal inside it
        torch.manual_seed(2)
        drafter = DFlashDraftModel(tiny_drafter_config(target, layer_types=["sliding_attention", "full_attention"],
                                                       sliding_window=4, sliding_block_attention="causal")).eval()
    eager, static = DrafterProposer(drafter, target), StaticDrafterProposer(drafter, target, max_len=len(seq))
    eager.reset(T, torch.Generator().manual_seed(3))
    static.reset(T, torch.Generator().manual_seed(3))
    feats = target.forward(torch.tensor([seq]), drafter.config.target_layer_ids, with_logits=False).features
    start, new = len(PROMPT), feats[:, :len(PROMPT)]
    for keep in (3, 1, 8, 2, 5, 8, 4):
        a, b = eager.propose(seq[start], new, start, B), static.propose(seq[start], new, start, B)
        assert torch.equal(a.drafts, b.drafts), start
        assert (a.q is None) == (b.q is None) == (T == 0 or variant.startswith("v1"))
        if a.q is not None:
            assert torch.equal(a.candidates, b.candidates)
            torch.testing.assert_close(a.q, b.q, atol=1e-6, rtol=0)
        assert static.context_length() == eager.context_length() == start
        new, start = feats[:, start:start + keep], start + keep


# ------------------------------------------------------------------------------------------ sampling
def test_rejection_sampling_commits_the_targets_distribution():
    """``accept`` with a q (speculative rejection sampling) on a hand-made block, 20,000 cycles: the committed
    tokens at each position are distributed as the target's row, and each slot accepts with probability
    sum(min(p, q)) (tolerances in ``check_rejection_trials``)."""
    logits = torch.tensor(REJECTION_T * np.log(REJECTION_P), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)

    def accept_block(drafts, q, candidates):
        proposal = Proposal(torch.tensor(drafts), torch.tensor(q, dtype=torch.float32), torch.tensor(candidates))
        return accept(logits, proposal, REJECTION_T, gen).tolist()

    check_rejection_trials(rejection_trials(accept_block))


def test_greedy_drafts_keep_todays_sampling_path():
    """A proposal without q (v1 drafts at any temperature) is verified as before: a draw from the target at each
    position, from the same generator draws, so v1's sampled outputs for a seed are what they were."""
    from inference.cycle import sample

    logits = torch.randn(8, 288, generator=torch.Generator().manual_seed(0))
    a = accept(logits, Proposal(torch.arange(7)), 0.8, torch.Generator().manual_seed(4))
    b = sample(logits, 0.8, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert torch.equal(accept(logits, Proposal(torch.arange(7)), 0.0), logits.argmax(-1))


def test_sampled_dflash2_generation_is_a_sample_of_the_tempered_target(runs):
    """End to end at T = 0.7 with the bigram walk (q nearly one-hot on the walk's pick): drafts are accepted and
    rejected, and each committed token is a draw from softmax(target logits / T) at its prefix: over the tokens of
    40 seeded generations, mean surprisal minus entropy is 0 within 4 standard errors, where committing the
    drafts unverified would sit far above it (``unverified``: the same statistic of the walk's drafts)."""
    target, seq, _, drafter = runs("qwen3")
    T, n_new = 0.7, 12
    gaps, unverified, accepted, rejected = [], [], 0, 0
    for s in range(40):
        cycles = []
        proposer = DrafterProposer(drafter, target)
        real = GenerationResult.record_cycle

        def record(self, drafts, tokens, *a, **k):
            cycles.append((drafts, tokens))
            return real(self, drafts, tokens, *a, **k)

        GenerationResult.record_cycle = record
        try:
            res = dflash_generate(target, proposer, PROMPT, n_new, temperature=T, seed=s, eos_token_ids=[])
        finally:
            GenerationResult.record_cycle = real
        ids = PROMPT + res.tokens
        with torch.no_grad():
            logits = target.model(torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits[len(PROMPT) - 1:-1] / T, dim=-1)  # row i: the distribution of token i
        entropy = -(logp.exp() * logp).sum(-1)
        for i, tok in enumerate(res.tokens[1:], 1):  # token 0 is the prefill's draw
            gaps.append((-logp[i, tok] - entropy[i]).item())
        pos = 1
        for drafts, tokens in cycles:  # each cycle's first draft against the target at its prefix
            if pos >= len(res.tokens):
                break
            unverified.append((-logp[pos, drafts[0]] - entropy[pos]).item())
            ok = drafts[0] == tokens[0]
            accepted, rejected = accepted + ok, rejected + (not ok)
            n = 0
            while n < len(drafts) and drafts[n] == tokens[n]:
                n += 1
            pos += n + 1
    gaps = np.array(gaps)
    bound = 4 * gaps.std() / np.sqrt(len(gaps))
    assert abs(gaps.mean()) < bound, f"surprisal - entropy {gaps.mean():.3f}, {len(gaps)} tokens (bound {bound:.3f})"
    assert np.mean(unverified) > 3 * bound, np.mean(unverified)
    assert accepted > 20 and rejected > 20, (accepted, rejected)


def test_sampled_dflash2_generation_follows_the_seed_in_both_loops(runs):
    """The walk's uniforms and the verifier's draws come from the generation's generator: the eager and static
    loops give the same tokens and acceptance lengths for a seed, another seed other tokens."""
    target, seq, drafter, _ = runs("qwen3")
    st = StaticTarget(target, drafter.config.target_layer_ids, max_len=len(PROMPT) + 24 + 2 * B, block_size=B)
    proposer = StaticDrafterProposer(drafter, target, max_len=st.max_len)
    runs_ = [(dflash_generate(target, DrafterProposer(drafter, target), PROMPT, 24, temperature=0.8, seed=s,
                              eos_token_ids=[]),
              static_dflash_generate(st, proposer, PROMPT, 24, temperature=0.8, seed=s, eos_token_ids=[]))
             for s in (5, 6)]
    for eager, static in runs_:
        assert eager.tokens == static.tokens and eager.acceptance_lengths == static.acceptance_lengths
    assert runs_[0][0].tokens != runs_[1][0].tokens
    # one graphed pass per temperature: the sampled walk's and (below) the greedy one's
    static_dflash_generate(st, proposer, PROMPT, 8, eos_token_ids=[], resident=False)
    assert sorted(proposer._passes) == [0.0, 0.8]


# ------------------------------------------------------------------------------------------ folders
def test_sessions_load_dflash2_folders_ours_and_the_published_layout(tmp_path):
    """A DFlash2 folder as we save it and one laid out as published (z-lab/Qwen3.8-27B-DFlash2's config keys, the
    codebooks without ``.weight``; the reference's ``.weight`` spelling too) run in the eager and static loops:
    lossless, the same tokens and acceptance lengths, the drafter a DFlash2 one."""
    from inference.session import Session
    from models.drafter2 import DFlash2DraftModel
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    target_dir = save_tiny_target(tmp_path / "target6", num_layers=6)  # the published fixture's target depth
    ours = tmp_path / "ours"
    random_dflash2(tiny_v2_config(TargetModel.from_pretrained(target_dir))).save_pretrained(ours)
    folders = [ours, published_folder(tmp_path / "published"), published_folder(tmp_path / "suffixed", "B", True)]
    assert "dflash_config" in json.loads((folders[1] / "config.json").read_text())
    for draft in folders:
        got = {}
        for loop in ("eager", "static"):
            session = Session("torch", str(target_dir), str(draft), "cpu", "float32", loop=loop)
            assert isinstance(session.proposer.drafter, DFlash2DraftModel) and session.describe()["loop"] == loop
            result, base = session.run(PROMPT, baseline=True, max_new_tokens=16, eos_token_ids=[])
            assert result.tokens == base.tokens, (draft.name, loop)
            got[loop] = (result.tokens, result.acceptance_lengths)
        assert got["eager"] == got["static"], draft.name


def test_generate_validate_and_bench_take_the_published_dflash2_layout(tmp_path, capsys):
    from inference import bench, generate, validate
    from models.tiny import save_tiny_target

    target = str(save_tiny_target(tmp_path / "target6", num_layers=6))
    draft = str(published_folder(tmp_path / "published"))
    generate.main(["--backend", "torch", "--target", target, "--draft", draft, "--prompt", "hi", "--max-new-tokens",
                   "8", "--device", "cpu", "--dtype", "float32", "--baseline", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["num_tokens"] == 8 and out["tau"] >= 1 and out["matches_baseline"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "chat", "messages": [{"role": "user", "content": "hi"}]}))
    report = validate.main(["--backend", "torch", "--target", target, "--draft", draft, "--prompts", str(prompts),
                            "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32", "--out",
                            str(tmp_path / "val"), "--no-progress"])
    assert report["block_size"] == 8 and report["identical_share"] == 1.0
    capsys.readouterr()
    bench.main(["--target", target, "--draft", draft, "--backend", "torch", "--device", "cpu", "--dtype", "float32",
                "--prompts", "hi", "--max-new-tokens", "8"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "decode" and line["matches_baseline"]
