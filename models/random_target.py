"""Random-weight targets of real shapes for the benches: speed only, the weights are random.

Every bench takes its target from here: ``python -m data.bench`` (a Qwen3 of the given hidden size, depth
and vocabulary), ``train.bench --e2e RECIPE`` and ``inference.bench --random-target RECIPE`` (the exact
shape of a shipped recipe's target, ``recipes/NAME.yaml``'s shape facts), ``export.bench --shape RECIPE``
(a drafter of that target's shape, no target built). ``tiny`` is ``models/tiny.py``'s seeded tiny
architecture that its ``tiny:<arch>`` path names (random weights, not the fitted ones).
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig, Qwen3Config

from models.target import TargetModel
from models.tiny import TINY_VOCAB, tiny_config, tiny_target

RECIPE_SHAPES = ("qwen3-8b", "qwen35-9b", "llama31-8b", "qwen35-4b", "qwen35-27b", "tiny")
CONFIGS = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3_5": Qwen3_5TextConfig}  # model types built here
TINY_LAYERS = 6  # a tiny recipe's target depth, as train/tiny.py builds it
RECIPES = Path(__file__).resolve().parents[1] / "recipes"  # read as files: models imports no other folder


def random_target(model_type: str, shape: dict, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                  name: str = "random") -> TargetModel:
    """The one builder: a ``model_type`` causal LM of ``shape`` (transformers config keys), seeded weights.

    Built directly on ``device``: initialising 8B parameters on the CPU takes minutes (``meta`` builds
    the shapes alone, no weights). Qwen3.5 shapes get the hybrid (GatedDeltaNet + attention) text model
    with transformers' default layer pattern, which is the published 9B/4B one.
    """
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(CONFIGS[model_type](**shape), dtype=dtype)
    return TargetModel(model.eval(), tokenizer=None, name=name)


def qwen3_target(hidden: int, layers: int, vocab: int, device: str, dtype: torch.dtype) -> TargetModel:
    """A Qwen3 of free sizes (the data bench's flags): heads of 128 from 256 wide, a 3x MLP, 4 query heads per KV."""
    heads = max(hidden // 128, 2)
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                 head_dim=128 if hidden >= 256 else hidden // heads, max_position_embeddings=8192,
                 tie_word_embeddings=False)
    return random_target("qwen3", shape, device, dtype, name=f"random-qwen3-h{hidden}-l{layers}")


def recipe_spec(recipe: str) -> dict:
    """A shipped recipe's YAML, refused in one line when no random target of its shape can be built."""
    path = RECIPES / f"{recipe}.yaml"
    if not path.is_file():
        raise ValueError(f"no recipe {recipe!r}: use one of {RECIPE_SHAPES}")
    spec = yaml.safe_load(path.read_text())
    t = spec["target"]
    if not str(t.get("path", "")).startswith("tiny:") and (t.get("model_type") not in CONFIGS
                                                           or "vocab_size" not in t):
        # small.yaml names a local folder, MoE recipes have no builder here: neither has a shape to build
        raise ValueError(f"recipe {recipe!r} has no random-target shape (model_type {t.get('model_type')!r}): "
                         f"use one of {RECIPE_SHAPES}")
    return spec


def recipe_runs_on_cpu(spec: dict) -> bool:
    """Only the tiny recipe's target fits a CPU run; the others are 4B-27B parameters."""
    return str(spec["target"]["path"]).startswith("tiny:")


def recipe_shape(recipe: str, num_layers: int | None = None) -> tuple[str, dict]:
    """(model type, transformers config keys) of a shipped recipe's target; ``num_layers``: fewer layers."""
    t = recipe_spec(recipe)["target"]
    if str(t["path"]).startswith("tiny:"):
        arch = t["path"].split(":", 1)[1] or "qwen3"
        c = tiny_config(arch, vocab_size=TINY_VOCAB, num_layers=num_layers or TINY_LAYERS)
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")
        return arch, {k: getattr(c, k) for k in keys}
    shape = dict(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                 num_hidden_layers=num_layers or t["num_layers"], num_attention_heads=t["num_attention_heads"],
                 num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                 max_position_embeddings=min(t["max_position_embeddings"], 32768), tie_word_embeddings=False)
    if t["model_type"] == "qwen3_5" and num_layers:
        shape["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    return t["model_type"], shape


def recipe_target(recipe: str, device: str, dtype: torch.dtype = torch.bfloat16, num_layers: int | None = None):
    """A random-weight target with the exact shape of a shipped recipe's target (``recipes/NAME.yaml``).

    ``tiny`` gets the tiny seeded architecture its ``tiny:<arch>`` path names (``models.tiny.tiny_target``).
    """
    t = recipe_spec(recipe)["target"]
    if str(t["path"]).startswith("tiny:"):
        arch = t["path"].split(":", 1)[1] or "qwen3"
        model = tiny_target(arch, num_layers=num_layers or TINY_LAYERS, dtype=dtype)
        return TargetModel(model.to(device), tokenizer=None, name=f"random-{recipe}")
    kind, shape = recipe_shape(recipe, num_layers)
    return random_target(kind, shape, device, dtype, name=f"random-{recipe}")
