"""The DFlash2 golden numbers (tests/fixtures/dflash2, see its README) and tiny DFlash2 drafters for tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import FIXTURES

GOLDEN = FIXTURES / "dflash2"
CONFIGS = {"A": "config.json", "B": "config_caseB.json"}  # B: output_multiplier 1.5, soft-cap 30
TEMPERATURE = 0.7  # the golden q rows are softmax(score / 0.7)


def golden(name: str) -> dict[str, torch.Tensor]:
    """``weights``, ``inputs`` or ``outputs`` of the reference run."""
    return load_file(str(GOLDEN / f"{name}.safetensors"))


def golden_config(case: str = "A") -> dict:
    return json.loads((GOLDEN / CONFIGS[case]).read_text())


def target_parts() -> tuple[torch.Tensor, torch.Tensor]:
    """The borrowed target embedding and LM head ``[288, 64]``."""
    w = golden("weights")
    return w["target.embed_tokens.weight"], w["target.lm_head.weight"]


def published_folder(directory: Path, case: str = "A", codebook_suffix: bool = False) -> Path:
    """A drafter folder laid out as published (z-lab/Qwen3.8-27B-DFlash2's key set, tiny shapes): the reference's
    config.json and its weights without the target's parts, the codebooks without ``.weight`` (or with it, as
    the reference's own ``save_pretrained`` spells them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(golden_config(case), indent=2))
    state = {}
    for k, v in golden("weights").items():
        if k.startswith("target."):
            continue
        if k.endswith("_codebook.weight") and not codebook_suffix:
            k = k.removesuffix(".weight")
        state[k] = v
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def block_calls() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(block ids, new context features, position ids) of the two proposals; the second continues the cache."""
    i = golden("inputs")
    return [(i[f"block_ids_{n}"], i[f"context_features_{n}"], i[f"position_ids_{n}"]) for n in (1, 2)]


def uniform_for(tokens: np.ndarray, candidates: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Draws in [0, 1) that make an inverse-CDF sampler over ``q`` pick ``tokens`` (the middle of each token's
    interval): a sampled walk then follows the greedy one, so its q rows are the golden ones."""
    pick = (candidates == tokens[..., None]).argmax(-1)
    cdf = np.cumsum(q, axis=-1)
    chosen = np.take_along_axis(cdf, pick[..., None], -1)[..., 0]
    return chosen - np.take_along_axis(q, pick[..., None], -1)[..., 0] / 2


def by_token(candidates, values) -> list[dict[int, float]]:
    """Per slot, {candidate id: value}: candidate order is not part of the contract (the reference's is unsorted)."""
    c, v = np.asarray(candidates).reshape(-1, np.shape(candidates)[-1]), np.asarray(values, np.float64)
    v = v.reshape(c.shape)
    return [dict(zip(row.tolist(), vals.tolist())) for row, vals in zip(c, v)]


def max_diff_by_token(candidates, values, ref_candidates, ref_values) -> float:
    """Max |difference| of two per-slot {id: value} maps; the id sets must be equal."""
    worst = 0.0
    for mine, ref in zip(by_token(candidates, values), by_token(ref_candidates, ref_values)):
        assert set(mine) == set(ref), f"candidate sets differ: {sorted(mine)} vs {sorted(ref)}"
        worst = max(worst, max(abs(mine[t] - ref[t]) for t in ref))
    return worst


def tiny_dflash2_config(**kw):
    from models.config import DFlashConfig

    args = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=288, num_target_layers=8, target_layer_ids=[1, 3, 5],
                mask_token_id=280, block_size=8, rope_theta=10000.0, torch_dtype="float32", variant="dflash2",
                selector_rank=8, selector_top_k=4)
    args.update(kw)
    return DFlashConfig(**args)


def random_dflash2(config, seed: int = 0, conv_scale: float = 0.1):
    """A torch DFlash2 drafter with every weight random, as after some training from the identity init: convs
    ``conv_scale`` away from identity (their static and dynamic weights), the selector on."""
    from models.drafter2 import DFlash2DraftModel

    torch.manual_seed(seed)
    model = DFlash2DraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("base_kernel"):
                p.copy_(conv_scale * torch.randn_like(p))
                p[:, 0] += 1
            elif name.endswith("kernel_projection.weight"):
                p.copy_(conv_scale / 2 * torch.randn_like(p))
            else:
                p.copy_((0.5 if "codebook" in name else 0.1) * torch.randn_like(p))
    return model.eval()


def tiny_v2_config(target, **kw):
    """A tiny DFlash2 drafter config for a tiny target (``tests.helpers.tiny_drafter_config`` with the DFlash2 keys:
    convs of groups of 16 channels, rank 8, K = 4 candidates, every layer sliding with a window of 24)."""
    from tests.helpers import tiny_drafter_config

    args = dict(variant="dflash2", selector_rank=8, selector_top_k=4, sliding_window=24)
    args.update(kw)
    return tiny_drafter_config(target, **args)


def bigram_dflash2(target, sequence: list[int], seed: int = 1, strength: float = 10.0):
    """A DFlash2 drafter whose selector walk drafts ``sequence``'s bigrams: after token a it proposes the token that
    last followed a in ``sequence`` (so it is right for a few slots, then wrong: multi-token acceptance through the
    walk, its predecessors the walk's own picks). Random weights (convs off identity) with attention and MLP
    outputs damped, so every mask slot's hidden state stays near the normed mask embedding h0;
    ``hidden_projection`` maps h0 to ones, the codebooks are a one-hot predecessor and a ``strength``-scaled
    successor table, and K = V candidates, so the pair term decides every pick. Built on the CPU in float32."""
    V = target.vocab_size
    model = random_dflash2(tiny_v2_config(target, selector_rank=V, selector_top_k=V), seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
        h0 = model.norm(target.embed_tokens.weight[model.config.mask_token_id][None].detach().float().cpu())[0]
        selector = model.candidate_selector
        selector.hidden_projection.weight.copy_(torch.ones(V, 1) * h0 / h0.dot(h0))
        selector.predecessor_codebook.copy_(torch.eye(V))
        successor = torch.zeros(V, V)
        for a, b in zip(sequence, sequence[1:]):
            successor[:, a] = 0
            successor[b, a] = strength
        selector.successor_codebook.copy_(successor)
    return model


# A hand-made verify block for the rejection sampler (``accept`` with a q): vocabulary 6, B = 3 (two drafts),
# K = 4 candidates per slot, the second slot's q depending on the first draft (as the walk's does), target rows
# with mass outside the candidates. At T = 0.7 the logits are 0.7 log p, so softmax(logits / T) = p.
REJECTION_T = 0.7
REJECTION_P = np.array([[0.10, 0.35, 0.05, 0.10, 0.25, 0.15],
                        [0.30, 0.05, 0.20, 0.15, 0.10, 0.20],
                        [0.05, 0.10, 0.40, 0.10, 0.15, 0.20]])
REJECTION_CANDIDATES = np.array([[0, 1, 2, 3], [1, 2, 4, 5]])
REJECTION_Q1 = np.array([0.40, 0.30, 0.20, 0.10])
REJECTION_Q2 = {x: np.roll([0.50, 0.25, 0.15, 0.10], x) for x in range(4)}  # by the first draft
CHI2_5_DOF_1E4 = 25.74  # P(chi-square with 5 degrees of freedom > 25.74) = 1e-4


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


def rejection_trials(accept_block, n: int = 20000, seed: int = 0) -> dict:
    """``n`` cycles of the hand-made block: drafts drawn from q (inverse CDF, as the walk draws them),
    ``accept_block(drafts, q rows, candidate rows) -> the target's tokens [3]`` (the sampler under test, its own
    random stream), then the host's rule (the longest prefix equal to the drafts, then the token at the first
    mismatch). Returns the committed tokens' counts at each position (position k counted over the cycles that
    reached it), the acceptance counts, and the first drafts' counts (what always accepting would commit)."""
    rng = np.random.default_rng(seed)
    counts, reached, drafted = np.zeros((3, 6)), np.zeros(3), np.zeros(6)
    for _ in range(n):
        x1 = REJECTION_CANDIDATES[0, min(np.searchsorted(np.cumsum(REJECTION_Q1), rng.random(), "right"), 3)]
        q2 = REJECTION_Q2[x1]
        x2 = REJECTION_CANDIDATES[1, min(np.searchsorted(np.cumsum(q2), rng.random(), "right"), 3)]
        drafts = [int(x1), int(x2)]
        tokens = accept_block(drafts, np.stack([REJECTION_Q1, q2]), REJECTION_CANDIDATES)
        accepted = 0
        while accepted < 2 and tokens[accepted] == drafts[accepted]:
            accepted += 1
        for k, tok in enumerate(drafts[:accepted] + [tokens[accepted]]):
            counts[k, tok] += 1
            reached[k] += 1
        drafted[x1] += 1
    q1 = np.zeros(6)
    q1[REJECTION_CANDIDATES[0]] = REJECTION_Q1
    overlap = np.minimum(REJECTION_P[0], q1)  # P(first draft accepted and = x)
    second = sum(overlap[x] * np.minimum(REJECTION_P[1], _scatter(REJECTION_Q2[x], 1)).sum() for x in range(4))
    return dict(counts=counts, reached=reached, drafted=drafted, n=n,
                accept_rate=(reached[1] / n, overlap.sum()),  # (measured, exact) P(slot 1 accepted)
                accept_rate_2=(reached[2] / max(reached[1], 1), second / overlap.sum()),  # P(slot 2 | slot 1)
                compare_rate=float((REJECTION_P[0] * q1).sum()))  # what sampling p and comparing would accept


def _scatter(q: np.ndarray, slot: int) -> np.ndarray:
    full = np.zeros(6)
    full[REJECTION_CANDIDATES[slot]] = q
    return full


def check_rejection_trials(stats: dict) -> None:
    """Every committed position's frequencies match the target's row (chi-square below its 1e-4 quantile; a
    correct sampler fails that with probability 1e-4 per position, and the fixed seed makes it deterministic);
    the acceptance rates equal the rejection sampler's sum(min(p, q)) within 4.5 binomial standard errors, far
    from the rate of comparing with a target sample; the first drafts alone fail the same chi-square (the power
    of the test: committing the drafts as drawn, tokens ~ q, is caught)."""
    for k in range(3):
        stat = chi_square(stats["counts"][k], REJECTION_P[k])
        assert stat < CHI2_5_DOF_1E4, (f"position {k + 1}: chi-square {stat:.1f} over {int(stats['reached'][k])} "
                                       f"tokens, frequencies {stats['counts'][k] / stats['reached'][k]} vs "
                                       f"{REJECTION_P[k]}")
    for (measured, exact), n in ((stats["accept_rate"], stats["n"]), (stats["accept_rate_2"], stats["reached"][1])):
        se = np.sqrt(exact * (1 - exact) / n)
        assert abs(measured - exact) < 4.5 * se, f"acceptance rate {measured:.4f}, expected {exact:.4f} (se {se:.4f})"
    assert abs(stats["accept_rate"][1] - stats["compare_rate"]) > 0.3
    assert chi_square(stats["drafted"], REJECTION_P[0]) > 100 * CHI2_5_DOF_1E4
