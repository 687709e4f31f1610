"""Greedy static loops with the whole cycle on the device: one graph replay and one read per cycle.

Between ``static_loop``'s two graphed passes the host runs a dozen small steps (the drafter's
counters, its bonus token and new features, the block to verify, the target's argmax, the read,
the features kept for the next cycle). Each is a launch, and on an H200 a compiled Qwen3-8B-shaped
cycle took 0.8-0.9 ms longer than its two passes' GPU time (a target-only step ~0.6 ms longer than
its pass). At temperature 0 each of those steps is a function of device tensors, so here one
function does them all: verify the block, take the target's tokens, count the accepted drafts
(the longest prefix equal to the target's tokens), then advance the counters (target start,
GatedDeltaNet keep, drafter context) and draft the next block from the features just committed,
with the target's token after them as its bonus. On CUDA that function is one graph. The host
replays it and reads one small tensor (the block's drafts, the target's tokens, the accepted count)
to record the cycle as ``static_dflash_generate`` does (EOS and the token budget stay on the host),
and checks the device's count against its own. The baseline gets the same: one replay (decode,
argmax, the token fed back as the next input) and one read per token.

The drafts of a cycle are the same computation as ``static_loop``'s (same passes, same buffers,
same order), so the tokens and acceptance lengths are the eager loop's; CPU tests check it with
graphs off, ``tests/test_cuda.py`` with graphs on. Sampling (temperature > 0) and the per-part
timing (``parts``) use ``static_loop``'s two-graph cycle.
"""

from __future__ import annotations

import time

import torch

from inference.static_loop import (StaticDrafterProposer, StaticLoopUnsupported, StaticTarget, _Graphed, _sync,
                                   prefill)
from inference.stats import GenerationResult, commit_tokens


class GreedyCycle:
    """Verify + accept + next draft as one function of static buffers (one CUDA graph on a GPU)."""

    def __init__(self, target: StaticTarget, proposer: StaticDrafterProposer):
        B = proposer.block_size
        if target.block_size != B:
            raise StaticLoopUnsupported(f"the target's static passes are built for blocks of {target.block_size}, "
                                        f"the drafter's for {B}")
        self.target, self.proposer, self.B = target, proposer, B
        dev = target.target.device
        self._ids = torch.zeros(1, B, dtype=torch.long, device=dev)  # the block to verify: bonus, then drafts
        # Read by the host each cycle: the verified drafts (B-1), the target's tokens (B), the accepted count.
        self._out = torch.zeros(2 * B, dtype=torch.long, device=dev)
        mutable = [*target.gdn_buffers, target._start, target._keep, proposer._feats, proposer._block,
                   proposer._ctx_len, proposer._n_new, self._ids]
        self._graph = _Graphed(self._cycle, target.graphs, mutable)

    @torch.no_grad()  # the drafter's weights require grad: no autograd record of a pass, also in a capture
    def _cycle(self) -> torch.Tensor:
        t, p, B = self.target, self.proposer, self.B
        feats, logits = t._pass(self._ids, t.graph_layers, t.graph_steps)
        tokens = logits[0].argmax(-1)  # [B]: the target's token after each block position
        drafts = self._ids[0, 1:]
        accepted = (drafts == tokens[:-1]).long().cumprod(0).sum().reshape(1)
        keep = accepted + 1  # block positions now committed: the bonus and the accepted drafts
        self._out[:B - 1].copy_(drafts)
        self._out[B - 1:2 * B - 1].copy_(tokens)
        self._out[2 * B - 1:].copy_(accepted)
        # The next cycle: the target resumes after the committed positions (GatedDeltaNet layers from the
        # state after the last of them), the drafter takes their features, the target's token after them
        # is the next bonus.
        t._start.add_(keep)
        t._keep.copy_(keep)
        p._feats.copy_(feats)
        p._n_new.copy_(keep)
        p._block[:, :1].copy_(tokens.index_select(0, accepted)[None])
        next_drafts = p.block_pass(p._feats)
        p._ctx_len.add_(keep)
        self._ids[:, :1].copy_(p._block[:, :1])
        self._ids[0, 1:].copy_(next_drafts)
        return self._out

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos: set[int]) -> GenerationResult:
        t, p, B = self.target, self.proposer, self.B
        device = t.target.device
        p.reset()
        result = GenerationResult(tokens=[], block_size=B, position_accepts=[0] * (B - 1))
        feats, first, stop = prefill(t, prompt_ids, result, eos, max_new_tokens)
        committed = len(prompt_ids)
        t1 = time.perf_counter()
        if stop is None:  # the first draft, from the prompt's features: static_loop's pass
            drafts = p.propose(first, feats, committed, B)
            self._ids[0, 0] = first
            self._ids[0, 1:].copy_(drafts)
            t._start.fill_(committed)
            p._ctx_len.fill_(p.ctx_len)
            if t.gdn:
                t._commit(committed, B)
        room = min(t.max_len, p.max_len)  # the verify and the next draft each write B positions from `committed`
        while stop is None:
            if committed + B > room:
                raise ValueError(f"static caches hold {room} positions; a block at {committed} does not fit: "
                                 "raise max_len (prompt + max_new_tokens + block size)")
            out = self._graph().tolist()  # the one sync per cycle
            drafts, target_tokens, accepted = out[:B - 1], out[B - 1:2 * B - 1], out[-1]
            keep, stop = result.record_cycle(drafts, target_tokens, eos, max_new_tokens)
            if keep != accepted + 1:
                raise RuntimeError(f"the device accepted {accepted} drafts, the host {keep - 1}: the cycle's "
                                   "acceptance on the device is wrong (a bug in inference/static_greedy.py)")
            committed += keep
            p.ctx_len += keep
            if t.gdn and stop is None:
                t.advance(committed, B)  # the host's record of the next verify, whose start the device set
        _sync(device)
        result.decode_s = time.perf_counter() - t1
        result.stop_reason = stop
        return result


class GreedyDecode:
    """The baseline's step as one function: decode one token, take its argmax, feed it back."""

    def __init__(self, target: StaticTarget):
        self.target = target
        self._tok = torch.zeros(1, 1, dtype=torch.long, device=target.target.device)
        mutable = [*target.gdn_buffers, target._start, target._keep, self._tok]
        self._graph = _Graphed(self._step, target.graphs, mutable)

    @torch.no_grad()
    def _step(self) -> torch.Tensor:
        t = self.target
        _, logits = t._pass(self._tok, t.graph_layers, t.graph_steps)
        self._tok.copy_(logits[0, -1:].argmax(-1)[None])
        t._start.add_(1)
        t._keep.fill_(1)  # after the first step (which may follow a short prompt's pass), one position a step
        return self._tok

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos: set[int]) -> GenerationResult:
        t = self.target
        device = t.target.device
        result = GenerationResult(tokens=[], block_size=1)
        _, tok, stop = prefill(t, prompt_ids, result, eos, max_new_tokens)
        pos = len(prompt_ids)
        t1 = time.perf_counter()
        if stop is None:
            self._tok.fill_(tok)
            t._start.fill_(pos)
            if t.gdn:
                t._commit(pos, 1)
        while stop is None:
            if pos + 1 > t.max_len:
                raise ValueError(f"static cache holds {t.max_len} positions; a pass to {pos + 1} does not fit: "
                                 "raise max_len (prompt + max_new_tokens + block size)")
            tok = int(self._graph().item())
            pos += 1
            stop = commit_tokens([tok], result.tokens, eos, max_new_tokens)
            result.acceptance_lengths.append(int(stop != "eos"))  # the EOS step emits nothing
            if t.gdn and stop is None:
                t.advance(pos, 1)  # the host's record of the next step, whose start the device set
        _sync(device)
        result.decode_s = time.perf_counter() - t1
        result.stop_reason = stop
        return result


def greedy_cycle(target: StaticTarget, proposer: StaticDrafterProposer) -> GreedyCycle:
    """The proposer's cycle over ``target``, built (and on CUDA captured) once and kept on the proposer."""
    cycles = proposer.__dict__.setdefault("_greedy_cycles", {})
    if target not in cycles:
        cycles[target] = GreedyCycle(target, proposer)
    return cycles[target]


def greedy_decode(target: StaticTarget) -> GreedyDecode:
    """The target's one-token step, built once and kept on the target."""
    if "_greedy_decode" not in target.__dict__:
        target._greedy_decode = GreedyDecode(target)
    return target._greedy_decode
