"""The eager torch loop (CUDA, and CPU for tests): the reference the static loops are held to.

The dynamic-cache state adapters of the one cycle (``inference.cycle``): the target over a transformers
cache that grows with each pass and is rolled back after it (attention layers cropped, GatedDeltaNet
layers restored from a snapshot and replayed: ``rollback_torch.CacheRollback``), and the drafter over
its committed-context ``DraftCache``. ``dflash_generate`` runs the cycle with the drafter,
``target_generate`` (the baseline) the same cycle without one. The MLX twin is ``mlx_loop.py``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from inference.checks import check_proposer_binding
from inference.cycle import NoDrafter, Proposal, Proposer, generate, propose_block, samples_drafts
from inference.rollback_torch import CacheRollback
from inference.stats import GenerationResult
from models.drafter import DFlashDraftModel, DraftCache
from models.target import TargetModel


class DynamicTarget:
    """The target's state in a transformers cache (``cycle.TargetState``), rolled back after each verify pass."""

    rollback_part = "rollback"

    def __init__(self, target: TargetModel):
        self.target, self.device = target, target.device
        self.cache, self.rollback, self.layer_ids = None, None, []
        self._features, self._block_len = None, 0

    def prefill(self, prompt_ids: list[int], layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self.cache, self.rollback = self.target.new_cache(), CacheRollback(self.target)
        out = self.target.forward(torch.tensor([prompt_ids], device=self.device), self.layer_ids, cache=self.cache,
                                  logits_slice=slice(-1, None))
        return out.features, out.logits[0, -1]

    def verify(self, block: torch.Tensor, start: int) -> torch.Tensor:
        T = block.shape[1]
        positions = torch.arange(start, start + T, device=self.device)[None]
        # A one-token block (the baseline's) is always kept whole: no GatedDeltaNet snapshot to take.
        with self.rollback.recording(self.cache) if T > 1 else nullcontext():
            out = self.target.forward(block, self.layer_ids, cache=self.cache, position_ids=positions)
        self._features, self._block_len = out.features, T
        return out.logits[0]

    def commit(self, keep: int) -> None:
        self.rollback.commit(self.cache, keep=keep, block_len=self._block_len)

    def features(self, keep: int) -> torch.Tensor:
        return self._features[:, :keep]

    def check(self, committed: int) -> None:
        self.rollback.check(self.cache, committed)

    def close(self) -> None:
        if self.rollback is not None:
            self.rollback.close()


class DrafterProposer:
    """The drafter (either generation) with its committed-context cache, bound to the target's embedding and LM
    head; its proposal is ``cycle.propose_block`` (v1 argmax, DFlash2 the selector walk)."""

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel):
        check_proposer_binding(drafter.config, target)
        drafter.bind_target(target.embed_tokens, target.lm_head)
        self.drafter = drafter
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.block_size = drafter.config.block_size
        self.mask_id = drafter.config.mask_token_id
        self.cache = DraftCache(drafter.config.num_hidden_layers)
        self.temperature, self.generator = 0.0, None

    def reset(self, temperature: float = 0.0, generator: torch.Generator | None = None) -> None:
        self.cache = DraftCache(self.drafter.config.num_hidden_layers)
        self.temperature, self.generator = temperature, generator

    @torch.no_grad()
    def propose(self, bonus: int, new_features: torch.Tensor, start: int, block_size: int) -> Proposal:
        device = new_features.device
        c = new_features.shape[1]
        block = torch.tensor([[bonus] + [self.mask_id] * (block_size - 1)], device=device)
        positions = torch.arange(start - c, start + block_size, device=device)[None]
        feats = new_features.to(self.drafter.fc.weight.dtype)
        hidden = self.drafter(self.drafter.embed(block), feats, positions, cache=self.cache)
        uniform = None
        if samples_drafts(self.drafter, self.temperature):  # the walk's draws, from the generation's stream
            uniform = torch.rand(1, block_size - 1, device=device, generator=self.generator)
        # stays on the device: one sync per cycle
        return propose_block(self.drafter, hidden[:, 1:], block[:, 0], self.temperature, uniform)

    def context_length(self) -> int:
        return len(self.cache)


def dflash_generate(target: TargetModel, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int = 256,
                    temperature: float = 0.0, block_size: int | None = None, eos_token_ids: list[int] | None = None,
                    seed: int = 0, on_cycle: Callable[[object, int], None] | None = None,
                    parts: dict[str, float] | None = None) -> GenerationResult:
    """Speculative generation with a DFlash drafter on the eager loop; lossless with respect to the target.

    ``on_cycle(cache, committed)`` is called after every cycle's rollback (tests inspect the cache).
    ``parts`` (a dict): seconds per part (draft, verify, accept, host, rollback) with a device sync around
    each, which slows the loop: for a profiling run, not the timed one.
    """
    return generate(DynamicTarget(target), proposer, prompt_ids, max_new_tokens, temperature, block_size,
                    eos_token_ids, seed, on_cycle, parts)


def target_generate(target: TargetModel, prompt_ids: list[int], max_new_tokens: int = 256, temperature: float = 0.0,
                    eos_token_ids: list[int] | None = None, seed: int = 0) -> GenerationResult:
    """The baseline: the same cycle without a drafter, one token per target pass, same stop rules and timers."""
    return generate(DynamicTarget(target), NoDrafter(target.device), prompt_ids, max_new_tokens, temperature,
                    eos_token_ids=eos_token_ids, seed=seed)
