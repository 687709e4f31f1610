"""A target's folder before any weights load: the architectures draftsmith supports, its config, its tokenizer.

The torch adapter (``target.py``), its MLX twin (``target_mlx.py``), the MLX-quantized loader
(``dequantize.py``) and the quantizer (``quantize.py``) all start here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from models.config_layout import read_json_file, refuse_drafter_as_target
from models.hub import SMALL_FILES, fetch_model, resolve_model_dir
from models.weights import check_folder_weights

# model_type -> family. Qwen3.6 checkpoints use the qwen3_5 model types.
SUPPORTED = {
    "qwen3": "qwen3", "qwen3_moe": "qwen3",
    "llama": "llama",
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5",
    # GLM 4.x MoE, Qwen3-Next, DeepSeek-V3 / Kimi K2.5 (K2.5's text tower is a DeepSeek-V3 model: "kimi_k2")
    "glm4_moe": "glm4_moe", "qwen3_next": "qwen3_next",
    "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "kimi_k25": "deepseek_v3",
}


@dataclass(frozen=True)
class FamilyFacts:
    """What the loops, loaders and the plan need to know about a family beyond its decoder layers.

    ``linear_attention``: the module layout of its GatedDeltaNet layers, None without any ("qwen3_5":
    ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, what the static loop and the fused training
    path read; "qwen3_next": fused ``in_proj_qkvz`` / ``in_proj_ba``). ``latent_attention``: multi-head latent
    attention (the cache holds one compressed latent and one rope key per position, not per-head K/V).
    ``static_loop``: "auto" (``--loop auto`` takes the static CUDA-graph loop on a GPU), "asked" (it runs the
    family exactly, checked on the CPU, but ``auto`` stays eager until its graph replay is measured on a GPU), or
    the one-line reason the static loop refuses it. ``sdpa``: False when the attention has a term SDPA has no
    argument for (gpt-oss's learned sinks): such a target never runs under SDPA or the project's ``CAUSAL_SDPA``
    fast path, which would drop it silently.
    """

    linear_attention: str | None = None
    latent_attention: bool = False
    static_loop: str = "auto"
    sdpa: bool = True


MLA_STATIC = ("its multi-head latent attention caches one compressed latent and one rope key per position, not the "
              "per-head K/V buffers the static loop preallocates")
FAMILY_FACTS = {
    "qwen3": FamilyFacts(),
    "llama": FamilyFacts(),
    "qwen3_5": FamilyFacts(linear_attention="qwen3_5", static_loop="asked"),
    # GLM 4.x MoE, Qwen3-Next, DeepSeek-V3 / Kimi K2.5
    "glm4_moe": FamilyFacts(static_loop="asked"),
    "qwen3_next": FamilyFacts(linear_attention="qwen3_next", static_loop=(
        "its GatedDeltaNet layers fuse their input projections (in_proj_qkvz, in_proj_ba), which the static "
        "GatedDeltaNet pass (Qwen3.5's in_proj_qkv/z/b/a) does not read")),
    "deepseek_v3": FamilyFacts(latent_attention=True, static_loop=MLA_STATIC),
}
# --- gpt-oss and Gemma 4 (issue 46). gpt-oss: alternating sliding / full attention with learned attention sinks,
# MoE. Gemma 4: the text tower of the multimodal checkpoint (gemma4) or a bare text checkpoint (gemma4_text):
# 31B dense, 26B-A4B MoE, E2B / E4B with per-layer input embeddings and KV-shared layers.
SUPPORTED.update({"gpt_oss": "gpt_oss", "gemma4": "gemma4", "gemma4_text": "gemma4"})
FAMILY_FACTS.update({
    "gpt_oss": FamilyFacts(sdpa=False, static_loop="its learned attention sinks (the static loop's SDPA would drop "
                                                   "them) and sliding-window layers"),
    "gemma4": FamilyFacts(static_loop="its sliding-window layers, global layers with their own head size and "
                                      "KV-shared layers"),
})


class UnsupportedTarget(ValueError):
    pass


TARGET_NAMES = ("Qwen3 (dense, MoE), Llama 3.x, Qwen3.5 / 3.6 (hybrid, dense and MoE), GLM 4.x MoE, Qwen3-Next, "
                "DeepSeek-V3, Kimi K2 / K2.5, gpt-oss, Gemma 4")


def check_supported(model_type: str) -> str:
    if model_type not in SUPPORTED:
        raise UnsupportedTarget(f"not supported yet: {model_type}. draftsmith trains drafters for {TARGET_NAMES} "
                                f"(model types {', '.join(sorted(SUPPORTED))})")
    return SUPPORTED[model_type]


def family_facts(family: str) -> FamilyFacts:
    return FAMILY_FACTS.get(family, FamilyFacts())


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
