"""The DFlash decoding loop in MLX (Metal on a Mac, CPU on Linux); the twin of ``inference/cycle.py``.

One cycle, written once (``dflash_generate``), with the torch cycle's steps and semantics (docs/design.md,
"Decoding cycle"): propose a block from the bonus token (``propose_block``: the proposal step, DFlash v1
the argmax of each slot's logits, DFlash2 the selector walk), verify the whole block in one target pass,
accept the longest prefix where draft == target token plus the target's own token at the first mismatch
(``accept``), roll the target cache back to the committed length (``rollback_mlx``) and carry the
target's features at the committed positions into the next proposal. Every committed token is a sample
from the target's own distribution (greedy: identical to target-only greedy decoding): greedy drafts
(v1; DFlash2 at temperature 0) are compared with the target's draws, DFlash2's sampled drafts go through
rejection sampling against their q (``rejection_sample``). Results are ``inference.stats.GenerationResult``,
as in torch.
The baseline (``target_generate``) is the same cycle without a drafter (``NoDrafter``: blocks of one token).

MLX is lazy: the draft pass and the verify pass of a cycle are one graph, evaluated once when
the acceptance count is read (the only host sync of a cycle). Long prompts are prefilled in
chunks; ``memory_limit_gb`` sets ``mx.set_memory_limit`` for the call and the buffer cache is
cleared every ``clear_cache_every`` cycles, so long runs do not grow without bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import NamedTuple, Protocol

import mlx.core as mx

from inference.checks import (
    check_draft_context,
    check_dtype,
    check_generation_args,
    check_proposer_binding,
)
from inference.rollback_mlx import CacheRollback
from inference.stats import GenerationResult, commit_tokens, resolve_block_size
from models.drafter2_mlx import load_drafter
from models.drafter_mlx import DFlashDraftModel, DraftCache
from models.target_mlx import TargetModel

PREFILL_STEP = 2048


class Proposal(NamedTuple):
    """A drafter's proposal for block slots 1..B-1 (unevaluated arrays: no extra sync)."""

    drafts: mx.array  # [B-1] token ids
    q: mx.array | None = None  # [B-1, K] draft probabilities over ``candidates`` when drafts are sampled
    candidates: mx.array | None = None  # [B-1, K] the token ids ``q`` is over


def propose_block(drafter: DFlashDraftModel, hidden: mx.array, bonus: mx.array, temperature: float = 0.0,
                  uniform: mx.array | None = None) -> Proposal:
    """The proposal step, the one place a drafter generation decides its drafts (twin of
    ``cycle.propose_block``). ``hidden``: the drafter's final-norm hidden states at block slots 1..B-1
    (``[1, B-1, H]``); ``bonus``: the block's first token (``[1]``), where a selector walk starts. DFlash v1:
    the argmax of each slot's logits through the target's LM head. DFlash2: the selector walk
    (``models.drafter2_mlx.select``), greedy at temperature 0, else sampled by inverse CDF of ``uniform``
    (``[1, B-1]``) with its q over the K candidates kept for ``accept``."""
    if drafter.variant == "dflash2":
        p = drafter.propose(hidden, bonus, temperature, uniform)
        return Proposal(drafts=p.tokens[0], q=None if p.q is None else p.q[0], candidates=p.candidates[0])
    return Proposal(drafts=mx.argmax(drafter.logits(hidden)[0], axis=-1))


def samples_drafts(drafter, temperature: float) -> bool:
    """Whether ``propose_block`` samples this drafter's drafts (DFlash2 above temperature 0): twin of
    ``cycle.samples_drafts``."""
    return temperature > 0 and getattr(drafter, "variant", "dflash") == "dflash2"


def as_proposal(drafts) -> Proposal:
    """A proposer's answer as a ``Proposal``: drafts alone (an array or a list) are greedy drafts."""
    if isinstance(drafts, Proposal):
        return drafts
    return Proposal(drafts=drafts if isinstance(drafts, mx.array) else mx.array(drafts, dtype=mx.int32))


def sample(logits: mx.array, temperature: float, key: mx.array | None = None) -> mx.array:
    """Greedy at temperature 0, else a draw from softmax(logits / T). ``[..., V] -> [...]``."""
    if temperature <= 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits.astype(mx.float32) / temperature, axis=-1, key=key)


def accept(logits: mx.array, proposal: Proposal, temperature: float, key: mx.array | None = None) -> mx.array:
    """The target's token after each block position (``[T, V] -> [T]``), matched against the drafts on the
    host (twin of ``cycle.accept``): a draw from the target at each position for greedy drafts (``q`` None),
    speculative rejection sampling (``rejection_sample``) for drafts sampled from a ``q``."""
    if proposal.q is None or temperature <= 0:
        return sample(logits, temperature, key)
    return rejection_sample(logits, proposal, temperature, key)


def rejection_sample(logits: mx.array, proposal: Proposal, temperature: float, key: mx.array) -> mx.array:
    """Twin of ``cycle.rejection_sample``: position j returns draft x_j when u_j q_j(x_j) < p_j(x_j), else a draw
    from norm(max(0, p_j - q_j)) (0 at x_j, so the first token that differs from the draft marks the first
    rejection; p without x_j if the residual rounds to zero); the last position a draw from p (the bonus)."""
    n = proposal.drafts.shape[0]
    p = mx.softmax(logits.astype(mx.float32) / temperature, axis=-1)  # [B, V]
    drafts = proposal.drafts[:, None]
    q = mx.put_along_axis(mx.zeros(p[:n].shape), proposal.candidates, proposal.q.astype(mx.float32), axis=-1)
    k_accept, k_draw = mx.random.split(key)
    u = mx.random.uniform(shape=(n,), key=k_accept)
    accepted = u * mx.take_along_axis(q, drafts, -1)[:, 0] < mx.take_along_axis(p[:n], drafts, -1)[:, 0]
    zero = mx.zeros(drafts.shape)
    residual = mx.put_along_axis(mx.maximum(p[:n] - q, 0), drafts, zero, axis=-1)
    fallback = mx.put_along_axis(p[:n], drafts, zero, axis=-1)
    residual = mx.where(residual.sum(-1, keepdims=True) > 0, residual, fallback)
    drawn = mx.random.categorical(mx.log(mx.concatenate([residual, p[n:]])), axis=-1, key=k_draw)
    return mx.concatenate([mx.where(accepted, proposal.drafts, drawn[:n].astype(proposal.drafts.dtype)),
                           drawn[n:].astype(proposal.drafts.dtype)])


class Proposer(Protocol):
    """The drafter's state: anything that drafts a block (the real drafter, ``NoDrafter``, test stand-ins)."""

    layer_ids: list[int]
    block_size: int

    def reset(self, temperature: float = 0.0, key: mx.array | None = None) -> None:
        """A new generation: no context yet. Drafts sampled at ``temperature`` (DFlash2) draw from ``key``'s
        stream (the generation's drafter key, from its seed)."""
        ...

    def propose(self, bonus: int, new_features: mx.array | None, start: int,
                block_size: int) -> Proposal | mx.array | list[int]:
        """Drafts for block slots 1..B-1 (unevaluated arrays are best: no extra sync).
        ``new_features`` are the target's features at positions ``start - c .. start - 1`` (not yet
        seen); the bonus token sits at position ``start``."""
        ...

    def context_length(self) -> int: ...


class NoDrafter:
    """The baseline's proposer: nothing proposed, so each block is the bonus token alone (B = 1) and the cycle
    is target-only decoding through the same code."""

    block_size = 1

    def __init__(self):
        self.layer_ids: list[int] = []

    def reset(self, temperature: float = 0.0, key: mx.array | None = None) -> None:
        pass

    def propose(self, bonus: int, new_features, start: int, block_size: int) -> Proposal:
        return Proposal(drafts=mx.zeros((0,), dtype=mx.int32))

    def context_length(self) -> int:
        return -1


class DrafterProposer:
    """The MLX drafter (either generation) with its committed-context cache, bound to the target's embedding and
    LM head; its proposal is ``propose_block``.

    The drafter runs in the target's compute dtype (features and embeddings arrive in it).
    """

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel):
        check_proposer_binding(drafter.config, target)
        drafter.bind_target(target.embed_tokens, target.lm_head)
        drafter.to_dtype(target.dtype)
        self.drafter = drafter
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.block_size = drafter.config.block_size
        self.mask_id = drafter.config.mask_token_id
        self.cache = DraftCache(drafter.config.num_hidden_layers)
        self.temperature, self.key = 0.0, None

    def reset(self, temperature: float = 0.0, key: mx.array | None = None) -> None:
        self.cache = DraftCache(self.drafter.config.num_hidden_layers)
        self.temperature, self.key = temperature, key

    def propose(self, bonus: int, new_features: mx.array, start: int, block_size: int) -> Proposal:
        c = new_features.shape[1]
        block = mx.array([[bonus] + [self.mask_id] * (block_size - 1)])
        positions = mx.arange(start - c, start + block_size)[None]
        hidden = self.drafter(self.drafter.embed(block), new_features.astype(self.drafter.dtype), positions,
                              cache=self.cache)
        uniform = None
        if samples_drafts(self.drafter, self.temperature):  # the walk's draws, from the drafter's key stream
            self.key, sub = mx.random.split(self.key)
            uniform = mx.random.uniform(shape=(1, block_size - 1), key=sub)
        return propose_block(self.drafter, hidden[:, 1:], block[:, 0], self.temperature, uniform)

    def context_length(self) -> int:
        return len(self.cache)


@contextmanager
def memory_limit(gb: float | None):
    """``mx.set_memory_limit`` for the duration of a generation (None: leave MLX's default)."""
    if gb is None:
        yield
        return
    old = mx.set_memory_limit(int(gb * 2**30))
    try:
        yield
    finally:
        mx.set_memory_limit(old)


def prefill(target: TargetModel, prompt_ids: list[int], layer_ids: list[int], cache: list,
            step: int = PREFILL_STEP) -> tuple[mx.array | None, mx.array]:
    """Run the prompt through the target in chunks of ``step``; return all features and the last logits."""
    feats, logits = [], None
    for s in range(0, len(prompt_ids), step):
        chunk = mx.array([prompt_ids[s:s + step]])
        last = s + step >= len(prompt_ids)
        out = target.forward(chunk, layer_ids, cache=cache, with_logits=last, logits_slice=slice(-1, None))
        if layer_ids:
            feats.append(out.features)
        if last:
            logits = out.logits
        else:
            # Bound the graph (and the memory) per chunk.
            mx.eval([c.state for c in cache] + feats)
            mx.clear_cache()
    features = (feats[0] if len(feats) == 1 else mx.concatenate(feats, axis=1)) if feats else None
    return features, logits


def dflash_generate(target: TargetModel, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int = 256,
                    temperature: float = 0.0, block_size: int | None = None, eos_token_ids: list[int] | None = None,
                    seed: int = 0, prefill_step_size: int = PREFILL_STEP, memory_limit_gb: float | None = None,
                    clear_cache_every: int = 64,
                    on_cycle: Callable[[list, int], None] | None = None) -> GenerationResult:
    """Speculative generation on MLX, lossless with respect to the target: the one cycle of this backend
    (``NoDrafter`` gives the baseline, ``target_generate``).

    ``on_cycle(cache, committed)`` is called after every cycle's rollback (tests use it to compare
    the rolled-back caches with a fresh prefill).
    """
    check_generation_args(prompt_ids, max_new_tokens, temperature)
    B = resolve_block_size(block_size, proposer.block_size)
    eos = set(target.eos_token_ids() if eos_token_ids is None else eos_token_ids)
    key = mx.random.key(seed) if temperature > 0 else None
    rollback = CacheRollback(target)
    cache = target.new_cache()
    proposer.reset(temperature, draft_key(seed) if temperature > 0 else None)
    result = GenerationResult(tokens=[], block_size=B, position_accepts=[0] * (B - 1))

    with memory_limit(memory_limit_gb):
        t0 = time.perf_counter()
        new_features, logits = prefill(target, prompt_ids, proposer.layer_ids, cache, prefill_step_size)
        key, sub = _split(key)
        first = sample(logits[0, -1], temperature, sub).item()
        result.prefill_s = time.perf_counter() - t0
        committed = len(prompt_ids)  # tokens whose keys/values (and features) exist
        stop = commit_tokens([first], result.tokens, eos, max_new_tokens)

        t1 = time.perf_counter()
        cycle = 0
        while stop is None:
            bonus = result.tokens[-1]
            proposal = as_proposal(proposer.propose(bonus, new_features, committed, B))  # the draft pass
            drafts = proposal.drafts
            block = mx.concatenate([mx.array([bonus], dtype=drafts.dtype), drafts])[None]
            # A one-token block (the baseline's) is always kept whole: nothing to snapshot or record.
            with rollback.recording(cache) if B > 1 else nullcontext():
                verify = target.forward(block, proposer.layer_ids, cache=cache)  # the target pass
            key, sub = _split(key)
            target_tokens = accept(verify.logits[0], proposal, temperature, sub)
            mx.eval(drafts, target_tokens)  # the one sync of the cycle
            drafts_l, target_l = drafts.tolist(), target_tokens.tolist()
            check_draft_context(proposer.context_length(), committed)
            keep, stop = result.record_cycle(drafts_l, target_l, eos, max_new_tokens)
            rollback.commit(cache, keep=keep, block_len=B)
            committed += keep
            rollback.check(cache, committed)
            if on_cycle is not None:
                on_cycle(cache, committed)
            new_features = verify.features[:, :keep] if proposer.layer_ids else None
            cycle += 1
            if clear_cache_every and cycle % clear_cache_every == 0:
                mx.clear_cache()
        mx.eval([c.state for c in cache])
        result.decode_s = time.perf_counter() - t1
    result.stop_reason = stop
    return result


def target_generate(target: TargetModel, prompt_ids: list[int], max_new_tokens: int = 256, temperature: float = 0.0,
                    eos_token_ids: list[int] | None = None, seed: int = 0, prefill_step_size: int = PREFILL_STEP,
                    memory_limit_gb: float | None = None) -> GenerationResult:
    """The baseline: the same cycle without a drafter, one token per target pass, same stop rules and timers."""
    return dflash_generate(target, NoDrafter(), prompt_ids, max_new_tokens, temperature, eos_token_ids=eos_token_ids,
                           seed=seed, prefill_step_size=prefill_step_size, memory_limit_gb=memory_limit_gb)


def load(target: str, drafter: str, revision: str | None = None, drafter_revision: str | None = None,
         dtype: str | mx.Dtype | None = None) -> tuple[TargetModel, DrafterProposer]:
    """Target (``mlx_lm.load``) and drafter (HF or MLX export folder, or Hub ids), ready for ``dflash_generate``.

    ``dtype`` ("float32", "bfloat16", "float16" or an ``mx.Dtype``) casts the target's floating weights
    (None: as stored); the drafter always runs in the target's compute dtype.
    """
    if isinstance(dtype, str):
        dtype = getattr(mx, check_dtype(dtype))
    t = TargetModel.from_pretrained(target, revision=revision, dtype=dtype)
    d = load_drafter(drafter, revision=drafter_revision)  # either generation (v1, DFlash2)
    return t, DrafterProposer(d, t)


def draft_key(seed: int) -> mx.array:
    """The drafter's own key stream for a seed: the third key split from ``mx.random.key(seed)``, which the cycle's
    own chain (``_split``: two at a time) never makes, so the walk's draws are independent of the target's."""
    return mx.random.split(mx.random.key(seed), 3)[2]


def _split(key: mx.array | None):
    if key is None:
        return None, None
    k, sub = mx.random.split(key)
    return k, sub
