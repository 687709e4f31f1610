"""Shared test helpers: an assert_close that reports the size of a mismatch, stand-in proposers, tiny configs."""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository
FIXTURES = ROOT / "tests" / "fixtures"


def assert_close(actual, expected, atol: float = 1e-5, what: str = "values", rtol: float = 0.0) -> None:
    """``|a - e| <= atol + rtol |e|`` elementwise; failures print the max and mean absolute difference."""
    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    diff = (a - e).abs()
    assert bool((diff <= atol + rtol * e.abs()).all()), (
        f"{what}: max abs diff {diff.max().item():.3e} (mean {diff.mean().item():.3e}) "
        f"exceeds atol {atol:.1e} + rtol {rtol:.1e} x |expected|")


class ReferenceProposer:
    """Proposes the target's own continuation (from a reference run), with planted mistakes.

    ``mistakes`` are absolute sequence positions whose drafted token is deliberately wrong, so the
    acceptance length of every cycle is known in advance. ``received`` keeps every call's
    ``(start, new_features)``: the loop must hand over the target's features at the committed positions.
    """

    def __init__(self, sequence: list[int], layer_ids: list[int], block_size: int, vocab: int,
                 mistakes: set[int] = frozenset()):
        self.sequence = sequence
        self.layer_ids = layer_ids
        self.block_size = block_size
        self.vocab = vocab
        self.mistakes = set(mistakes)
        self.seen = 0
        self.received: list[tuple[int, object]] = []

    def reset(self, temperature: float = 0.0, generator=None) -> None:
        self.seen = 0

    def propose(self, bonus, new_features, start, block_size):
        self.received.append((start, new_features))
        self.seen += new_features.shape[1]
        out = []
        for pos in range(start + 1, start + block_size):
            tok = self.sequence[pos]
            out.append((tok + 1) % self.vocab if pos in self.mistakes else tok)
        return out

    def context_length(self) -> int:
        return self.seen


def reference_drafts(proposer, sequence: list[int], mistakes: set[int], vocab: int = 288) -> None:
    """Make a static drafter's pass (``inference.static_loop.StaticDrafterProposer``) draft the reference
    continuation with planted mistakes, read from its own device counters (bonus position = context + new
    features), as ``ReferenceProposer`` does on the host: a device-resident cycle then has a known
    acceptance length every cycle."""
    dev = proposer._ctx_len.device
    seq = torch.tensor(sequence + [0] * 2 * proposer.block_size, device=dev)
    wrong = torch.zeros(len(seq), dtype=torch.bool, device=dev)
    wrong[sorted(mistakes)] = True

    def block_pass(feats):
        pos = proposer._ctx_len + proposer._n_new + torch.arange(1, proposer.block_size, device=dev)
        return torch.where(wrong[pos], (seq[pos] + 1) % vocab, seq[pos])

    proposer.block_pass = proposer._block_pass = block_pass


def expected_acceptance(prompt_len: int, max_new: int, block: int, mistakes: set[int],
                        uncut: bool = False) -> list[int]:
    """Acceptance lengths a reference proposer must get, from the rule alone (``uncut``: the last cycle with its
    full acceptance, as ``tau_uncut`` counts it, not what the budget let it emit)."""
    lengths, pos, produced = [], prompt_len, 1
    while produced < max_new:
        acc = 0
        while acc < block - 1 and (pos + 1 + acc) not in mistakes:
            acc += 1
        lengths.append(acc + 1 if uncut else min(acc + 1, max_new - produced))  # cut: what the last one emitted
        pos += acc + 1
        produced += acc + 1
    return lengths


def tiny_drafter_config(target, **kw):
    from models.config import DFlashConfig
    from models.mask_token import choose_mask_token, tokenizer_emitted_ids

    args = dict(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_target_layers=target.num_layers,
                max_position_embeddings=target.max_position_embeddings,
                mask_token_id=choose_mask_token(target.vocab_size, tokenizer_emitted_ids(target.tokenizer)),
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                num_taps=3, block_size=8, torch_dtype="float32")
    args.update(kw)
    return DFlashConfig.for_target(**args)


def tiny_store_rows(n: int = 2):
    """``n`` feature rows of 3 tokens and 4 feature columns, for writing small stores."""
    from data.features import FeatureRow

    return [FeatureRow(torch.arange(3), torch.ones(3, dtype=torch.int8), torch.zeros(3, dtype=torch.int32),
                       torch.arange(3, dtype=torch.int32), torch.randn(3, 4)) for _ in range(n)]


class GradCapture:
    """Stands in for the optimizer: keeps the gradients train_step leaves for it."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {k: p.grad.clone() for k, p in self.model.named_parameters()}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)
