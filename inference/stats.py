"""What every generator reports: tokens, acceptance per cycle and per position, timings.

tau = committed tokens per verify cycle, bonus included, averaged over the cycles of one
generation (the token from the prefill is not a cycle). Shared by the torch and MLX loops so
both report the same numbers under the same names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1, per cycle
    position_accepts: list[int] = field(default_factory=list)  # cycles in which draft slot k (1..B-1) was accepted
    block_size: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = "max_new_tokens"  # or "eos"

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # Tokens produced by the decode phase: all but the one that came out of the prefill.
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "num_tokens": len(self.tokens),
            "acceptance_lengths": self.acceptance_lengths,
            "tau": self.tau,
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
