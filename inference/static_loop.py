"""The static and compiled torch loops: the one cycle (``inference.cycle``) over static buffers.

The state adapters are ``static_target.StaticTarget`` (K/V buffers and GatedDeltaNet states, rollback a
length reset, graphed 1-token and B-token passes) and ``static_drafter.StaticDrafterProposer`` (context
buffers, graphed block pass ending in the proposal step); ``compile`` puts torch.compile'd layers inside
the graphs. The eager loop (``torch_loop.py``) stays the reference: CPU tests check that this loop (graphs
off) gives its tokens, drafts and acceptance lengths, and ``tests/test_cuda.py`` checks graph replay.

Their fast path at temperature 0, **the device-resident cycle**. Between the two graphed passes the
host runs a dozen small steps (the drafter's counters, its bonus token and new features, the block to
verify, the target's argmax, the read, the features kept for the next cycle). Each is a launch, and on
an H200 a compiled Qwen3-8B-shaped cycle took 0.8-0.9 ms longer than its two passes' GPU time (a
target-only step ~0.6 ms longer than its pass). At temperature 0 each of those steps is a function of
device tensors, so ``ResidentCycle`` does them all in one function: verify the block, take the target's
tokens, count the accepted drafts (the longest prefix equal to the target's tokens), then advance the
counters (target start, GatedDeltaNet keep, drafter context) and propose the next block from the
features just committed, with the target's token after them as its bonus. On CUDA that function is one
graph. The cycle replays it and reads one small tensor (the block's drafts, the target's tokens, the
accepted count) to record the cycle as every loop does (EOS and the token budget stay on the host), and
checks the device's count against its own. The baseline gets the same (``ResidentDecode``): one replay
(decode, argmax, the token fed back as the next input) and one read per token. The drafts are the same
computation as the two-graph cycle's (same passes, buffers and order). Sampling (temperature > 0) and
the per-part timing (``parts``) run the cycle's separate passes, each graphed, with the host between.
"""

from __future__ import annotations

import torch

from inference.cycle import NoDrafter, Proposer, as_proposal, generate
from inference.static_drafter import StaticDrafterProposer
from inference.static_target import GraphedPass, StaticLoopUnsupported, StaticTarget
from inference.stats import GenerationResult, resolve_block_size
from models.drafter import DFlashDraftModel
from models.target import TargetModel


class ResidentCycle:
    """Verify + accept + next proposal as one function of static buffers (one CUDA graph on a GPU):
    the static adapters' ``cycle.FusedCycle`` for greedy DFlash."""

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
        self._graph = GraphedPass(self._cycle, target.graphs, mutable)

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
        next_drafts = as_proposal(p.block_pass(p._feats)).drafts
        p._ctx_len.add_(keep)
        self._ids[:, :1].copy_(p._block[:, :1])
        self._ids[0, 1:].copy_(next_drafts)
        return self._out

    @torch.no_grad()
    def begin(self, first: int, features: torch.Tensor, committed: int) -> None:
        """The first block's proposal (from the prompt's features: the drafter's own pass) and the counters."""
        t, p, B = self.target, self.proposer, self.B
        drafts = as_proposal(p.propose(first, features, committed, B)).drafts
        self._ids[0, 0] = first
        self._ids[0, 1:].copy_(drafts)
        t._start.fill_(committed)
        p._ctx_len.fill_(p.ctx_len)
        if t.gdn:
            t._commit(committed, B)

    def step(self, committed: int) -> torch.Tensor:
        room = min(self.target.max_len, self.proposer.max_len)  # the verify and the next draft each write B
        if committed + self.B > room:  # positions from `committed`
            raise ValueError(f"static caches hold {room} positions; a block at {committed} does not fit: "
                             "raise max_len (prompt + max_new_tokens + block size)")
        return self._graph()

    def commit(self, keep: int, committed: int, stop: str | None) -> None:
        self.proposer.ctx_len += keep
        if self.target.gdn and stop is None:
            self.target.advance(committed, self.B)  # the host's record of the next verify, whose start the device set


class ResidentDecode:
    """The baseline's step as one function: decode one token, take its argmax, feed it back (the
    ``cycle.FusedCycle`` of the cycle without a drafter)."""

    def __init__(self, target: StaticTarget):
        self.target = target
        self._tok = torch.zeros(1, 1, dtype=torch.long, device=target.target.device)
        mutable = [*target.gdn_buffers, target._start, target._keep, self._tok]
        self._graph = GraphedPass(self._step, target.graphs, mutable)

    @torch.no_grad()
    def _step(self) -> torch.Tensor:
        t = self.target
        _, logits = t._pass(self._tok, t.graph_layers, t.graph_steps)
        self._tok.copy_(logits[0, -1:].argmax(-1)[None])
        t._start.add_(1)
        t._keep.fill_(1)  # after the first step (which may follow a short prompt's pass), one position a step
        return self._tok

    @torch.no_grad()
    def begin(self, first: int, features, committed: int) -> None:
        t = self.target
        self._tok.fill_(first)
        t._start.fill_(committed)
        if t.gdn:
            t._commit(committed, 1)

    def step(self, committed: int) -> torch.Tensor:
        t = self.target
        if committed + 1 > t.max_len:
            raise ValueError(f"static cache holds {t.max_len} positions; a pass to {committed + 1} does not fit: "
                             "raise max_len (prompt + max_new_tokens + block size)")
        return self._graph().view(-1)  # the target's token: the read's tokens, no drafts

    def commit(self, keep: int, committed: int, stop: str | None) -> None:
        if self.target.gdn and stop is None:
            self.target.advance(committed, 1)  # the host's record of the next step, whose start the device set


def resident_cycle(target: StaticTarget, proposer: StaticDrafterProposer | None) -> ResidentCycle | ResidentDecode:
    """The device-resident cycle of ``proposer`` over ``target`` (None: the baseline's step), built (and on CUDA
    captured) once and kept on the proposer, or on the target for the baseline."""
    if proposer is None:
        if "_resident_decode" not in target.__dict__:
            target._resident_decode = ResidentDecode(target)
        return target._resident_decode
    cycles = proposer.__dict__.setdefault("_resident_cycles", {})
    if target not in cycles:
        cycles[target] = ResidentCycle(target, proposer)
    return cycles[target]


@torch.no_grad()
def build_static_loop(target: TargetModel, drafter: DFlashDraftModel, max_len: int, block_size: int | None = None,
                      compile: bool = False) -> tuple[StaticTarget, StaticDrafterProposer]:
    """The target and drafter halves of the static loop, sharing one ``max_len`` (what
    ``static_dflash_generate`` takes; ``static_target_generate`` uses the first)."""
    B = block_size or drafter.config.block_size
    return (StaticTarget(target, drafter.config.target_layer_ids, max_len, B, compile=compile),
            StaticDrafterProposer(drafter, target, max_len, compile=compile))


def static_dflash_generate(target: StaticTarget, proposer: Proposer, prompt_ids: list[int],
                           max_new_tokens: int = 256, temperature: float = 0.0, block_size: int | None = None,
                           eos_token_ids: list[int] | None = None, seed: int = 0,
                           parts: dict[str, float] | None = None, resident: bool | None = None) -> GenerationResult:
    """The cycle on static caches: ``torch_loop.dflash_generate``'s result, rollback = length reset.

    ``parts`` (a dict): accumulate seconds per part (draft, verify, accept, host), with a device
    sync around each, which slows the loop: a profiling run, not the timed one.
    ``resident``: the whole greedy cycle as one function on the device (``ResidentCycle``); None (default)
    takes it where it applies (temperature 0, no ``parts``, the static drafter), False keeps the two
    graphed passes with the acceptance on the host between them.
    """
    applies = temperature == 0 and parts is None and isinstance(proposer, StaticDrafterProposer)
    if resident and not applies:
        raise ValueError("the device-resident cycle is greedy, untimed by parts and needs the static drafter: "
                         "use resident=None or False with temperature > 0, parts or another proposer")
    fused = None
    if applies and resident is not False:
        proposer.check_block_size(resolve_block_size(block_size, proposer.block_size))
        fused = resident_cycle(target, proposer)
    return generate(target, proposer, prompt_ids, max_new_tokens, temperature, block_size, eos_token_ids, seed,
                    parts=parts, fused=fused)


def static_target_generate(target: StaticTarget, prompt_ids: list[int], max_new_tokens: int = 256,
                           temperature: float = 0.0, eos_token_ids: list[int] | None = None,
                           seed: int = 0, resident: bool | None = None) -> GenerationResult:
    """The baseline: the same cycle without a drafter, on the same static cache and graphed 1-token pass.

    ``resident``: at temperature 0, the step (decode, argmax, the token fed back) as one function on the
    device, as the DFlash loop's cycle (None: where it applies; False: the argmax read before each step).
    """
    if resident and temperature != 0:
        raise ValueError("the device-resident step is greedy: use resident=None or False with temperature > 0")
    fused = resident_cycle(target, None) if temperature == 0 and resident is not False else None
    return generate(target, NoDrafter(target.device), prompt_ids, max_new_tokens, temperature,
                    eos_token_ids=eos_token_ids, seed=seed, fused=fused)


__all__ = ["StaticTarget", "StaticDrafterProposer", "StaticLoopUnsupported", "ResidentCycle", "ResidentDecode",
           "build_static_loop", "resident_cycle", "static_dflash_generate", "static_target_generate"]
