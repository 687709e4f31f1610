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
      reset(T, gen); propose(bonus, features, start, B) -> Proposal (or drafts); context_length()
      NoDrafter             proposes nothing: B = 1, the baseline is this same cycle without a drafter
    propose_block(drafter, hidden, bonus, T, uniform) -> Proposal   THE proposal step: both drafter adapters
                            call it (the static one inside its graphed pass). v1: argmax of each slot's
                            logits; DFlash2: the selector walk (greedy, or sampled with its q above T = 0)
    accept(logits, proposal, T, gen) -> tokens [B]      the target's token after each block position
                            (rejection sampling against q when the proposal carries one)

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

Every committed token is a sample from the target's own distribution at the requested temperature
(greedy: identical to target-only greedy decoding). v1 drafts are greedy, and ``accept`` draws the
target's token at each position and lets the host compare. DFlash2 samples its drafts above temperature
0 (the selector walk's softmax over K candidates, with uniforms the proposer draws from the generation's
generator) and returns that ``q`` in the ``Proposal``; ``accept`` then does speculative rejection
sampling against it, on the device, returning tokens whose first mismatch with the drafts is the first
rejection, so the host's record of the cycle is the same code.
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


def propose_block(drafter, hidden: torch.Tensor, bonus: torch.Tensor, temperature: float = 0.0,
                  uniform: torch.Tensor | None = None) -> Proposal:
    """The proposal step, the one place a drafter generation decides its drafts.

    ``hidden``: the drafter's final-norm hidden states at block slots 1..B-1 (``[1, B-1, H]``); ``bonus``:
    the block's first token (``[1]``, on the device), where a selector walk starts.

    - DFlash v1: the argmax of each slot's logits through the target's LM head (greedy drafts at every
      temperature; ``q`` None).
    - DFlash2: the selector walk (``models.drafter2.select``) over each slot's top-K unary candidates from the
      bonus token: at temperature 0 the best-scoring candidate (``q`` None), above it a draw from
      softmax(score / T) over the K candidates, picked by inverse CDF of ``uniform`` (``[1, B-1]`` in [0, 1),
      drawn by the caller from the generation's generator), with that ``q`` and its ``candidates`` kept for
      the verifier's rejection sampling (``accept``).

    The static drafter calls this inside its graphed pass: it stays a function of device tensors (no host
    read, fixed shapes); ``temperature`` is a Python number, fixed for a captured pass.
    """
    if drafter.variant == "dflash2":
        p = drafter.propose(hidden, bonus, temperature, uniform)
        return Proposal(drafts=p.tokens[0], q=None if p.q is None else p.q[0], candidates=p.candidates[0])
    return Proposal(drafts=drafter.logits(hidden)[0].argmax(-1))


def samples_drafts(drafter, temperature: float) -> bool:
    """Whether ``propose_block`` samples this drafter's drafts at ``temperature`` (DFlash2 above 0), so its
    adapter must draw the walk's uniforms; v1 drafts are greedy and draw nothing (the generation's random
    stream, and so v1's sampled outputs, stay what they were)."""
    return temperature > 0 and getattr(drafter, "variant", "dflash") == "dflash2"


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
    All on the device, read with the drafts in the cycle's one ``.tolist()``.

    Greedy drafts (``q`` is None: v1 at any temperature, DFlash2 at 0): a draw from the target at each position
    (its argmax at temperature 0), so a draft is accepted only when it equals the target's draw and every
    committed token is the target's sample. This is rejection sampling with a one-hot q, exactly (accept x with
    probability p(x); on a rejection, a draw from p without x), and the random stream v1 always had.

    Sampled drafts (``q`` over ``candidates``, DFlash2 above 0): speculative rejection sampling, ``rejection_sample``.
    """
    if proposal.q is None or temperature <= 0:
        return sample(logits, temperature, generator)
    return rejection_sample(logits, proposal, temperature, generator)


def rejection_sample(logits: torch.Tensor, proposal: Proposal, temperature: float,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Speculative rejection sampling of sampled drafts, written so the host's prefix match reads it.

    p_j = softmax(logits_j / T) is the target's distribution after block position j; draft x_j was drawn from
    q_j (``proposal.q[j]`` over ``proposal.candidates[j]``, zero elsewhere). Position j accepts x_j when
    u_j q_j(x_j) < p_j(x_j) (probability min(1, p_j(x_j) / q_j(x_j))) and returns x_j; otherwise it returns a
    draw from norm(max(0, p_j - q_j)), which never is x_j (a rejection means p_j(x_j) < q_j(x_j), so the
    residual is 0 there; it is set to 0 explicitly against rounding). The last position returns a draw from p:
    the bonus after a fully accepted block. So the first position whose token differs from the draft is the
    first rejection, and the token there is the correction: the committed tokens are distributed as the
    target's own samples. A residual that rounds to all zeros (p = q) falls back to p without x_j.

    Fixed shapes, no host read: the draws are ``B-1`` uniforms and a ``[B, V]`` exponential race
    (argmax of r / E, E ~ Exp(1), picks index i with probability r_i / sum r; zero rows are never read).
    """
    n = proposal.drafts.shape[0]
    p = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    drafts = proposal.drafts[:, None]
    q = torch.zeros_like(p[:n]).scatter_(-1, proposal.candidates, proposal.q.float())  # [B-1, V]
    u = torch.rand(n, device=p.device, generator=generator)
    accepted = u * q.gather(-1, drafts).squeeze(-1) < p[:n].gather(-1, drafts).squeeze(-1)
    residual = (p[:n] - q).clamp_min(0).scatter_(-1, drafts, 0.0)
    fallback = p[:n].scatter(-1, drafts, 0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, fallback)
    race = torch.cat([residual, p[n:]]) / torch.empty_like(p).exponential_(generator=generator)
    drawn = race.argmax(-1)  # [B]: the correction at each draft position, the bonus at the last
    return torch.cat([torch.where(accepted, proposal.drafts, drawn[:n]), drawn[n:]])


class Proposer(Protocol):
    """The drafter's state adapter: anything that drafts a block (the real drafter, the baseline's
    ``NoDrafter``, or test stand-ins)."""

    layer_ids: list[int]
    block_size: int

    def reset(self, temperature: float = 0.0, generator: torch.Generator | None = None) -> None:
        """A new generation: no context yet. Drafts sampled at ``temperature`` (DFlash2) draw their randomness
        from ``generator``, the generation's own (seeded) stream, so a seed fixes drafts and tokens alike."""
        ...

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

    def reset(self, temperature: float = 0.0, generator: torch.Generator | None = None) -> None:
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
    proposer.reset(temperature, gen)
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
