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
