"""What every generator reports: tokens, acceptance per cycle and per position, timings.

tau = committed tokens per verify cycle, bonus included, averaged over the cycles of one
generation (the token from the prefill is not a cycle). Shared by the torch and MLX loops so
both report the same numbers under the same names.

The cycle that ends a generation counts what it emitted: the token budget or the first EOS may cut it
short (``tau``, budget-cut). ``tau_uncut`` counts that cycle's full acceptance instead (accepted drafts
+ 1, as if nothing had cut it): how earlier DFlash loops counted, behind many published figures.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from models.mask_token import mask_problem

log = logging.getLogger("inference")


@dataclass
class GenerationResult:
    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # committed per cycle: accepted + 1, fewer at a stop
    position_accepts: list[int] = field(default_factory=list)  # cycles in which draft slot k (1..B-1) was accepted
    block_size: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = "max_new_tokens"  # or "eos"
    # the last cycle's full acceptance (accepted drafts + 1) before the budget or an EOS cut it; None: not
    # recorded (a result of an earlier version, read back from validate's partial.jsonl)
    last_cycle_uncut: int | None = None

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def committed_uncut(self) -> int:
        """Committed tokens with the last cycle counted in full (``tau_uncut`` x cycles)."""
        total = sum(self.acceptance_lengths)
        if not self.acceptance_lengths or self.last_cycle_uncut is None:
            return total
        return total - self.acceptance_lengths[-1] + self.last_cycle_uncut

    @property
    def tau_uncut(self) -> float:
        """tau with the last cycle's full acceptance (see the module docstring); = tau when nothing cut it."""
        return self.committed_uncut / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # Tokens produced by the decode phase: all but the one that came out of the prefill.
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def record_cycle(self, drafts: list[int], target_tokens: list[int], eos_ids: set[int],
                     max_new_tokens: int) -> tuple[int, str | None]:
        """Accept the longest prefix where draft == target token, plus the target's own token.

        Returns ``(keep, stop)``: ``keep`` = accepted drafts + 1 block positions now committed (the
        previous bonus and the accepted drafts), ``stop`` = why generation ends, or None. The cycle's
        acceptance length is the tokens it committed: a cycle cut by the first EOS (never emitted) or by
        the token budget counts only what it emitted, so tau x cycles = tokens produced by decoding.
        """
        accepted = leading_matches(drafts, target_tokens)
        before = len(self.tokens)
        stop = commit_tokens(drafts[:accepted] + [target_tokens[accepted]], self.tokens, eos_ids, max_new_tokens)
        committed = len(self.tokens) - before
        self.acceptance_lengths.append(committed)
        self.last_cycle_uncut = accepted + 1  # what this cycle accepted, before any cut (the last one's stays)
        for k in range(min(accepted, committed)):
            self.position_accepts[k] += 1
        return accepted + 1, stop

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "num_tokens": len(self.tokens),
            "acceptance_lengths": self.acceptance_lengths,
            "tau": self.tau,
            "tau_uncut": self.tau_uncut,
            "acceptance_histogram": {str(k): v for k, v in self.histogram().items()},
            "position_accepts": self.position_accepts,
            "block_size": self.block_size,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "stop_reason": self.stop_reason,
        }


def leading_matches(draft: list[int], target: list[int]) -> int:
    """Length of the longest prefix where the draft equals the target's own tokens."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


def commit_tokens(new: list[int], out: list[int], eos_ids: set[int], max_new_tokens: int) -> str | None:
    """Append a cycle's tokens to ``out``; stop at the first EOS (never emitted) or at the token budget."""
    for tok in new:
        if tok in eos_ids:
            return "eos"
        out.append(tok)
        if len(out) >= max_new_tokens:
            return "max_new_tokens"
    return None


def resolve_block_size(requested: int | None, trained: int) -> int:
    """A smaller block than the drafter was trained with is fine; a larger one has no trained slots."""
    if requested is None:
        return trained
    if not 2 <= requested <= trained:
        raise ValueError(f"--block-size {requested} must be between 2 and the drafter's trained block size {trained}")
    return requested


def warn_if_mask_is_emitted(mask_id: int, tokenizer) -> None:
    """A drafter whose mask is a token the target produces (EOS, pad, a chat-control or text token) still
    runs losslessly, so warn rather than refuse. A reserved/unused special token (Llama 3.x's choice, as
    training resolves it in ``models.mask_token``) is a proper mask and gets no warning."""
    why = mask_problem(tokenizer, mask_id) if tokenizer is not None else None
    if why:
        log.warning("the drafter's mask_token_id %d (%r) is %s for the target's tokenizer; drafts stay lossless "
                    "but acceptance may suffer", mask_id, tokenizer.convert_ids_to_tokens(mask_id), why)
