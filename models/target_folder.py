"""A target's folder before any weights load: the architectures draftsmith supports, its config, its tokenizer.

The torch adapter (``target.py``), its MLX twin (``target_mlx.py``), the MLX-quantized loader
(``dequantize.py``) and the quantizer (``quantize.py``) all start here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from models.config import read_json_file, refuse_drafter_as_target
from models.hub import SMALL_FILES, fetch_model, resolve_model_dir
from models.weights import check_folder_weights

# model_type -> family. Qwen3.6 checkpoints use the qwen3_5 model types.
SUPPORTED = {
    "qwen3": "qwen3", "qwen3_moe": "qwen3",
    "llama": "llama",
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5",
}
# --- gpt-oss and Gemma 4 (issue 46). gpt-oss: alternating sliding / full attention with learned attention sinks,
# MoE. Gemma 4: the text tower of the multimodal checkpoint (gemma4) or a bare text checkpoint (gemma4_text):
# 31B dense, 26B-A4B MoE, E2B / E4B with per-layer input embeddings and KV-shared layers.
SUPPORTED.update({"gpt_oss": "gpt_oss", "gemma4": "gemma4", "gemma4_text": "gemma4"})


@dataclass(frozen=True)
class FamilyFacts:
    """What a family needs beyond the common decoder stack, one row per family (``FAMILY_FACTS``).

    ``sdpa``: False when the attention has a term SDPA has no argument for (gpt-oss's learned sinks): such a
    target never runs under SDPA or the project's ``CAUSAL_SDPA`` fast path, which would drop it silently.
    ``static_loop``: why the static / CUDA-graph loop refuses the family (None: its structural checks decide).
    """

    sdpa: bool = True
    static_loop: str | None = None


FAMILY_FACTS: dict[str, FamilyFacts] = {}
# --- gpt-oss and Gemma 4 (issue 46)
FAMILY_FACTS.update({
    "gpt_oss": FamilyFacts(sdpa=False, static_loop="gpt-oss has learned attention sinks (the static loop's SDPA "
                                                   "would drop them) and sliding-window layers"),
    "gemma4": FamilyFacts(static_loop="Gemma 4 has sliding-window layers, global layers with their own head size "
                                      "and KV-shared layers"),
})


def family_facts(family: str) -> FamilyFacts:
    """The family's row of ``FAMILY_FACTS`` (the defaults for a family without one)."""
    return FAMILY_FACTS.get(family, FamilyFacts())


class UnsupportedTarget(ValueError):
    pass


def check_supported(model_type: str) -> str:
    if model_type not in SUPPORTED:
        raise UnsupportedTarget(f"not supported yet: {model_type} (draftsmith targets: {sorted(SUPPORTED)})")
    return SUPPORTED[model_type]


def read_target_config(path_or_id: str | Path, revision: str | None = None,
                       what: str = "target", weights: bool = True) -> tuple[Path, dict]:
    """(local folder, config.json) of a target, its architecture checked before any weights load;
    the torch adapter, the MLX twin and the MLX-quantized loader all start here. ``weights=False``:
    a Hub id fetches only the small files (config, tokenizer, shard index)."""
    directory = (fetch_model(path_or_id, revision=revision, what=what) if weights else
                 resolve_model_dir(path_or_id, revision=revision, what=what, allow_patterns=SMALL_FILES))
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a {what} folder needs config.json")
    config = read_json_file(config_path)
    refuse_drafter_as_target(path_or_id, config, what)
    check_supported(config.get("model_type", "<missing model_type>"))
    if weights:  # a truncated shard: one line naming it, not a loader's traceback after minutes of loading
        check_folder_weights(directory)
    return directory, config


def load_tokenizer(directory: str | Path):
    """``AutoTokenizer.from_pretrained(directory)``; a truncated tokenizer file is named (transformers raised a
    bare "Unterminated string starting at: line 11 column 7")."""
    try:
        return AutoTokenizer.from_pretrained(directory)
    except ValueError as e:  # json.JSONDecodeError is one
        for f in sorted(Path(directory).glob("*.json")):
            read_json_file(f)  # the first file that does not parse says so, with its path
        raise ValueError(f"the tokenizer in {directory} does not load ({e})") from e
