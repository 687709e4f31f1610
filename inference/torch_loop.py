"""The DFlash decoding loop in PyTorch (CUDA, and CPU for tests); the MLX twin is ``mlx_loop.py``.

One cycle (docs/design.md, "Decoding cycle"): draft a block from the bonus token, verify the whole block in one
target pass, accept the longest prefix where draft == target token plus the target's own token
at the first mismatch, roll the target cache back to the committed length, and carry the target's
features at the committed positions into the next draft. Drafts are greedy; the target's tokens
are sampled at the requested temperature, so every committed token is a sample from the
target's own distribution (greedy: identical to target-only greedy decoding).
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from inference.checks import check_generation_args, check_proposer_binding
from inference.rollback_torch import CacheRollback
from inference.stats import GenerationResult, commit_tokens, resolve_block_size
from models.drafter import DFlashDraftModel, DraftCache
from models.target import TargetModel


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Greedy at temperature 0, else a draw from softmax(logits / T). ``[..., V] -> [...]``."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


class Proposer(Protocol):
    """Anything that drafts a block: the real drafter, or test stand-ins."""

    layer_ids: list[int]
    block_size: int

    def reset(self) -> None: ...

    def propose(self, bonus: int, new_features: torch.Tensor, start: int, block_size: int) -> torch.Tensor | list[int]:
        """Draft tokens for block slots 1..B-1 (a ``[B-1]`` tensor on the target's device, or a list).
        ``new_features`` are the target's features at positions ``start - c .. start - 1`` (not yet seen);
        the bonus token sits at position ``start``."""
        ...

    def context_length(self) -> int: ...


class DrafterProposer:
    """The drafter with its committed-context cache, bound to the target's embedding and LM head."""

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel):
        check_proposer_binding(drafter.config, target)
        drafter.bind_target(target.embed_tokens, target.lm_head)
        self.drafter = drafter
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.block_size = drafter.config.block_size
        self.mask_id = drafter.config.mask_token_id
        self.cache = DraftCache(drafter.config.num_hidden_layers)

    def reset(self) -> None:
        self.cache = DraftCache(self.drafter.config.num_hidden_layers)

    @torch.no_grad()
    def propose(self, bonus: int, new_features: torch.Tensor, start: int, block_size: int) -> torch.Tensor:
        device = new_features.device
        c = new_features.shape[1]
        block = torch.tensor([[bonus] + [self.mask_id] * (block_size - 1)], device=device)
        positions = torch.arange(start - c, start + block_size, device=device)[None]
        feats = new_features.to(self.drafter.fc.weight.dtype)
        logits = self.drafter.draft(block, feats, positions, cache=self.cache)
        return logits[0].argmax(-1)  # stays on the device: the loop syncs once per cycle

    def context_length(self) -> int:
        return len(self.cache)


@torch.no_grad()
def dflash_generate(target: TargetModel, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int = 256,
                    temperature: float = 0.0, block_size: int | None = None, eos_token_ids: list[int] | None = None,
                    seed: int = 0, on_cycle: Callable[[object, int], None] | None = None,
                    parts: dict[str, float] | None = None) -> GenerationResult:
    """Speculative generation with a DFlash drafter; lossless with respect to the target.

    ``on_cycle(cache, committed)`` is called after every cycle's rollback (tests inspect the cache).
    ``parts`` (a dict): accumulate seconds per part (draft, verify, accept, rollback, host) with a
    device sync around each, which slows the loop: for a profiling run, not the timed one.
    """
    check_generation_args(prompt_ids, max_new_tokens, temperature)
    B = resolve_block_size(block_size, proposer.block_size)
    eos = set(target.eos_token_ids() if eos_token_ids is None else eos_token_ids)
    device = target.device
    gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    rollback = CacheRollback(target)
    cache = target.new_cache()
    proposer.reset()
    result = GenerationResult(tokens=[], block_size=B, position_accepts=[0] * (B - 1))

    t0 = time.perf_counter()
    out = target.forward(torch.tensor([prompt_ids], device=device), proposer.layer_ids, cache=cache,
                         logits_slice=slice(-1, None))
    first = int(sample(out.logits[0, -1], temperature, gen))
    _sync(device)
    result.prefill_s = time.perf_counter() - t0
    committed = len(prompt_ids)  # tokens whose keys/values (and features) exist
    new_features = out.features
    stop = commit_tokens([first], result.tokens, eos, max_new_tokens)

    clock = Clock(device, parts)
    t1 = time.perf_counter()
    try:  # an error between the verify pass and commit must not leave rollback hooks on the target
        while stop is None:
            clock.start()
            drafts, block = draft_block(proposer, result.tokens[-1], new_features, committed, B, device)
            clock.lap("draft")
            positions = torch.arange(committed, committed + B, device=device)[None]
            with rollback.recording(cache):
                verify = target.forward(block, proposer.layer_ids, cache=cache, position_ids=positions)
            clock.lap("verify")
            both = torch.cat([drafts, sample(verify.logits[0], temperature, gen)]).tolist()  # the one sync per cycle
            clock.lap("accept")
            drafts, target_tokens = both[:B - 1], both[B - 1:]
            check_draft_cache(proposer, committed)
            keep, stop = result.record_cycle(drafts, target_tokens, eos, max_new_tokens)
            clock.lap("host")
            rollback.commit(cache, keep=keep, block_len=B)
            committed += keep
            rollback.check(cache, committed)
            clock.lap("rollback")
            if on_cycle is not None:
                on_cycle(cache, committed)
            new_features = verify.features[:, :keep]
    finally:
        rollback.close()
    _sync(device)
    result.decode_s = time.perf_counter() - t1
    result.stop_reason = stop
    return result


@torch.no_grad()
def target_generate(target: TargetModel, prompt_ids: list[int], max_new_tokens: int = 256, temperature: float = 0.0,
                    eos_token_ids: list[int] | None = None, seed: int = 0) -> GenerationResult:
    """The baseline: target-only decoding, one token per forward, same stop rules and timers."""
    check_generation_args(prompt_ids, max_new_tokens, temperature)
    eos = set(target.eos_token_ids() if eos_token_ids is None else eos_token_ids)
    device = target.device
    gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    cache = target.new_cache()
    result = GenerationResult(tokens=[], block_size=1)
    t0 = time.perf_counter()
    out = target.forward(torch.tensor([prompt_ids], device=device), cache=cache, logits_slice=slice(-1, None))
    tok = int(sample(out.logits[0, -1], temperature, gen))
    _sync(device)
    result.prefill_s = time.perf_counter() - t0
    stop = commit_tokens([tok], result.tokens, eos, max_new_tokens)
    t1 = time.perf_counter()
    while stop is None:
        out = target.forward(torch.tensor([[tok]], device=device), cache=cache)
        tok = int(sample(out.logits[0, -1], temperature, gen))
        stop = commit_tokens([tok], result.tokens, eos, max_new_tokens)
        result.acceptance_lengths.append(int(stop != "eos"))  # the EOS step emits nothing
    _sync(device)
    result.decode_s = time.perf_counter() - t1
    result.stop_reason = stop
    return result


def draft_block(proposer: Proposer, bonus: int, new_features, committed: int, B: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One cycle's drafts (``B - 1`` tokens) and the block the target verifies, ``[[bonus, *drafts]]``."""
    drafts = torch.as_tensor(proposer.propose(bonus, new_features, committed, B), device=device)
    # torch.full, not torch.tensor([bonus]): a host list copied to the GPU waits for the draft pass to
    # finish, which leaves the GPU idle while the host then launches the verify.
    return drafts, torch.cat([torch.full((1,), bonus, dtype=drafts.dtype, device=device), drafts])[None]


def check_draft_cache(proposer: Proposer, committed: int) -> None:
    """The drafter's context cache must hold exactly the committed positions (-1: a proposer without one)."""
    held = proposer.context_length()
    if held not in (committed, -1):
        raise RuntimeError(f"draft cache holds {held} positions but {committed} are committed: the proposer "
                           "appended features the loop did not commit (a bug in the proposer)")


class Clock:
    """Per-part wall time with a device sync at each lap; does nothing without a ``parts`` dict."""

    def __init__(self, device: torch.device, parts: dict[str, float] | None):
        self.device, self.parts, self.t = device, parts, 0.0

    def start(self) -> None:
        if self.parts is not None:
            _sync(self.device)
            self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.parts is not None:
            _sync(self.device)
            now = time.perf_counter()
            self.parts[name] = self.parts.get(name, 0.0) + now - self.t
            self.t = now


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
