"""The DFlash decoding cycle of the torch backend, written once: propose -> verify -> accept -> commit.

Every torch loop (eager, static, compiled) and every baseline runs ``generate`` below over two state
adapters; the MLX twin is ``mlx_loop.py``. Outline (docs/design.md, "Decoding cycle"):

    TargetState              eager: torch_loop.DynamicTarget        static: static_target.StaticTarget
      prefill(prompt, taps) -> (features, logits)  a new cache          buffers from position 0
      verify(block, start)  -> logits [T, V]       tapped cached pass   graphed pass (T = 1 or B)
      commit(keep)          roll back to start+keep: crop + GatedDeltaNet snapshot/replay | length reset
      features(keep)        -> [1, keep, taps*H]   the kept positions' taps, for the next proposal
      check(committed)      every cache holds exactly the committed positions (static: nothing moves)
      close()               no rollback hook left on the target, also after an error
    Proposer                 eager: torch_loop.DrafterProposer      static: static_drafter.StaticDrafterProposer
      reset(); propose(bonus, features, start, B) -> Proposal (or drafts); context_length()
      NoDrafter             proposes nothing: B = 1, the baseline is this same cycle without a drafter
    propose_block(drafter, hidden, bonus) -> Proposal   THE proposal step: both drafter adapters call it
                            (the static one inside its graphed pass). v1: argmax of each slot's logits
    accept(logits, proposal, T, gen) -> tokens [B]      the target's token after each block position

    features, logits = target.prefill(prompt, proposer.taps); first = sample(logits)
    while not stopped:
        proposal = proposer.propose(bonus, features, committed, B)        # the draft pass
        logits = target.verify([bonus, *proposal.drafts], committed)      # the target pass
        read = [*drafts, *accept(logits, proposal)].tolist()              # the one host sync
        keep, stop = result.record_cycle(drafts, tokens, ...)             # acceptance, EOS, budget (host)
        target.commit(keep); committed += keep; target.check(committed)
        features = target.features(keep)

``fused`` (the static adapter's fast path at temperature 0, ``static_loop.resident_cycle``) replaces the
draft pass, the target pass and ``accept`` by one function of device buffers that verifies, accepts and
proposes the next block (one CUDA graph replay), and ``target.commit`` by its host records; the read,
the recording of the cycle and the checks stay here.

Drafts are greedy (v1); the target's tokens are sampled at the requested temperature, so every
committed token is a sample from the target's own distribution (greedy: identical to target-only
greedy decoding). A drafter generation that samples its drafts (DFlash2's selector walk) returns its
per-slot distribution ``q`` in the ``Proposal``, and ``accept`` is where rejection sampling reads it.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Protocol

import torch

from inference.checks import check_draft_context, check_generation_args
from inference.stats import GenerationResult, commit_tokens, resolve_block_size


class Proposal(NamedTuple):
    """A drafter's proposal for block slots 1..B-1, on the device (no host read)."""

    drafts: torch.Tensor  # [B-1] token ids
    q: torch.Tensor | None = None  # [B-1, K] draft probabilities over ``candidates`` when drafts are sampled
    candidates: torch.Tensor | None = None  # [B-1, K] the token ids ``q`` is over


def propose_block(drafter, hidden: torch.Tensor, bonus: torch.Tensor) -> Proposal:
    """The proposal step, the one place a drafter generation decides its drafts.

    ``hidden``: the drafter's final-norm hidden states at block slots 1..B-1 (``[1, B-1, H]``); ``bonus``:
    the block's first token (``[1]``, on the device), where a selector walk starts. DFlash v1: the argmax
    of each slot's logits through the target's LM head. The static drafter calls this inside its graphed
    pass: it must stay a function of device tensors (no host read, fixed shapes).
    """
    return Proposal(drafts=drafter.logits(hidden)[0].argmax(-1))


def as_proposal(drafts, device: torch.device | None = None) -> Proposal:
    """A proposer's answer as a ``Proposal``: drafts alone (a tensor or a list, as test stand-ins give) are
    greedy drafts without a distribution."""
    if isinstance(drafts, Proposal):
        return drafts
    if not isinstance(drafts, torch.Tensor):
        drafts = torch.as_tensor(drafts, dtype=torch.long, device=device)
    return Proposal(drafts=drafts)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Greedy at temperature 0, else a draw from softmax(logits / T). ``[..., V] -> [...]``."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def accept(logits: torch.Tensor, proposal: Proposal, temperature: float,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """The target's token after each block position (``[T, V] -> [T]``), which the host matches against the
    drafts: the longest matching prefix is accepted, and the token at the first mismatch is the target's own.

    Greedy drafts (``q`` is None): a draw from the target at each position (its argmax at temperature 0), so a
    draft is accepted only when it equals the target's draw and every committed token is the target's sample.
    A proposal with ``q`` is where rejection sampling against the drafts' distribution belongs.
    """
    return sample(logits, temperature, generator)


class Proposer(Protocol):
    """The drafter's state adapter: anything that drafts a block (the real drafter, the baseline's
    ``NoDrafter``, or test stand-ins)."""

    layer_ids: list[int]
    block_size: int

    def reset(self) -> None: ...

    def propose(self, bonus: int, new_features: torch.Tensor | None, start: int,
                block_size: int) -> Proposal | torch.Tensor | list[int]:
        """Drafts for block slots 1..B-1 on the target's device (a ``Proposal``, a ``[B-1]`` tensor or a list).
        ``new_features`` are the target's features at positions ``start - c .. start - 1`` (not yet seen);
        the bonus token sits at position ``start``."""
        ...

    def context_length(self) -> int:
        """Positions of context the proposer holds (-1: it keeps none, not checked)."""
        ...


class NoDrafter:
    """The baseline's proposer: it proposes nothing, so each block is the bonus token alone (B = 1) and the
    cycle is target-only decoding, one target pass and one read per token, through the same code."""

    block_size = 1

    def __init__(self, device: torch.device):
        self.layer_ids: list[int] = []
        self._drafts = torch.empty(0, dtype=torch.long, device=device)

    def reset(self) -> None:
        pass

    def propose(self, bonus: int, new_features, start: int, block_size: int) -> Proposal:
        return Proposal(drafts=self._drafts)

    def context_length(self) -> int:
        return -1


class TargetState(Protocol):
    """The target's state adapter: its caches, and how they go back to the committed length."""

    target: object  # the TargetModel (EOS ids)
    device: torch.device
    cache: object  # what ``on_cycle`` is shown
    rollback_part: str  # the ``parts`` entry that times commit and check

    def prefill(self, prompt_ids: list[int], layer_ids: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A new sequence: the prompt's features ``[1, P, taps*H]`` (None without taps), last logits ``[V]``."""
        ...

    def verify(self, block: torch.Tensor, start: int) -> torch.Tensor:
        """One target pass over ``block`` (``[1, T]``) at positions ``start .. start+T-1``: logits ``[T, V]``."""
        ...

    def commit(self, keep: int) -> None:
        """Keep the first ``keep`` positions of the block just verified."""
        ...

    def features(self, keep: int) -> torch.Tensor:
        """The verified block's features at its first ``keep`` positions (valid until the next pass)."""
        ...

    def check(self, committed: int) -> None:
        """Raise unless every cache holds exactly ``committed`` positions."""
        ...

    def close(self) -> None: ...


class FusedCycle(Protocol):
    """A state adapter's fast path: verify + accept + the next block's proposal as one device function."""

    def begin(self, first: int, features: torch.Tensor | None, committed: int) -> None:
        """After the prefill: the first block's proposal and the device's counters."""
        ...

    def step(self, committed: int) -> torch.Tensor:
        """One cycle on the device; what the host reads: drafts (B-1), target tokens (B), accepted count."""
        ...

    def commit(self, keep: int, committed: int, stop: str | None) -> None:
        """The host's records of what the device committed (it has moved on by itself)."""
        ...


@torch.no_grad()
def generate(target: TargetState, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int = 256,
             temperature: float = 0.0, block_size: int | None = None, eos_token_ids: list[int] | None = None,
             seed: int = 0, on_cycle: Callable[[object, int], None] | None = None,
             parts: dict[str, float] | None = None, fused: FusedCycle | None = None) -> GenerationResult:
    """Speculative generation, lossless with respect to the target; ``NoDrafter`` gives the baseline.

    ``on_cycle(cache, committed)`` is called after every cycle's rollback (tests inspect the cache).
    ``parts`` (a dict): accumulate seconds per part (draft, verify, accept, host, and the adapter's
    ``rollback_part``) with a device sync around each, which slows the loop: a profiling run, not the timed
    one. ``fused``: the adapter's one-function cycle (see the module docstring).
    """
    check_generation_args(prompt_ids, max_new_tokens, temperature)
    B = resolve_block_size(block_size, proposer.block_size)
    eos = set(target.target.eos_token_ids() if eos_token_ids is None else eos_token_ids)
    device = target.device
    gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    proposer.reset()
    result = GenerationResult(tokens=[], block_size=B, position_accepts=[0] * (B - 1))

    t0 = time.perf_counter()
    features, logits = target.prefill(prompt_ids, proposer.layer_ids)
    first = int(sample(logits, temperature, gen))
    sync(device)
    result.prefill_s = time.perf_counter() - t0
    committed = len(prompt_ids)  # positions whose keys/values (and features) exist
    stop = commit_tokens([first], result.tokens, eos, max_new_tokens)

    clock = Clock(device, parts)
    t1 = time.perf_counter()
    try:  # an error between the verify pass and commit must not leave rollback hooks on the target
        if fused is not None and stop is None:
            fused.begin(first, features, committed)
        while stop is None:
            clock.start()
            bonus = result.tokens[-1]
            if fused is None:
                proposal = as_proposal(proposer.propose(bonus, features, committed, B), device)
                clock.lap("draft")
                logits = target.verify(with_bonus(bonus, proposal.drafts), committed)
                clock.lap("verify")
                read = joined(proposal.drafts, accept(logits, proposal, temperature, gen))
            else:
                read = fused.step(committed)
            drafts, tokens, accepted = split_read(read.tolist(), B)  # the one host sync of the cycle
            clock.lap("accept")
            check_draft_context(proposer.context_length(), committed)
            keep, stop = result.record_cycle(drafts, tokens, eos, max_new_tokens)
            if accepted is not None and keep != accepted + 1:
                raise RuntimeError(f"the device accepted {accepted} drafts, the host {keep - 1}: the cycle's "
                                   "acceptance on the device is wrong (a bug in the adapter's fused cycle)")
            clock.lap("host")
            committed += keep
            if fused is None:
                target.commit(keep)
                features = target.features(keep) if stop is None and proposer.layer_ids else None
            else:
                fused.commit(keep, committed, stop)
            target.check(committed)
            clock.lap(target.rollback_part)
            if on_cycle is not None:
                on_cycle(target.cache, committed)
    finally:
        target.close()
    sync(device)
    result.decode_s = time.perf_counter() - t1
    result.stop_reason = stop
    return result


def with_bonus(bonus: int, drafts: torch.Tensor) -> torch.Tensor:
    """The block the target verifies, ``[[bonus, *drafts]]``, built on the device."""
    # torch.full, not torch.tensor([bonus]): a host list copied to the GPU waits for the draft pass to
    # finish, which leaves the GPU idle while the host then launches the verify.
    if drafts.numel() == 0:  # the baseline: the bonus token alone
        return torch.full((1, 1), bonus, dtype=drafts.dtype, device=drafts.device)
    return torch.cat([torch.full((1,), bonus, dtype=drafts.dtype, device=drafts.device), drafts])[None]


def joined(drafts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Drafts and target tokens in one tensor: one read for both."""
    return tokens if drafts.numel() == 0 else torch.cat([drafts, tokens])


def split_read(read: list[int], B: int) -> tuple[list[int], list[int], int | None]:
    """A cycle's read: drafts (B-1), the target's tokens (B) and, from a fused cycle, the device's accepted count."""
    return read[:B - 1], read[B - 1:2 * B - 1], (read[2 * B - 1] if len(read) > 2 * B - 1 else None)


class Clock:
    """Per-part wall time with a device sync at each lap; does nothing without a ``parts`` dict."""

    def __init__(self, device: torch.device, parts: dict[str, float] | None):
        self.device, self.parts, self.t = device, parts, 0.0

    def start(self) -> None:
        if self.parts is not None:
            sync(self.device)
            self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.parts is not None:
            sync(self.device)
            now = time.perf_counter()
            self.parts[name] = self.parts.get(name, 0.0) + now - self.t
            self.t = now


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
