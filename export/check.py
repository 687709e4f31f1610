"""What every export checks before it is moved into place: the engine schema, the weights, the target.

Silent failures are the field's main pain (a drafter that loads and serves at 0-2% acceptance
because a layer id was off by one, the mask id or the rope settings were not written, or an engine
read a schema it did not expect). These checks read the folder *as written* and refuse it with one
message listing every problem, so nothing wrong is exported quietly.

- ``schema_problems``: every key vLLM ``dflash``, SGLang ``DFLASH``, z-lab's code and the MLX
  runtimes read (``REQUIRED_KEYS``), both ``block_size`` places and both rope places agreeing, plain
  RoPE, no last-layer tap, no ``eagle_aux_hidden_state_layer_ids``, ``auto_map`` resolving to a file;
  for DFlash2 the published layout too (``dflash2_schema_problems``: the conv/selector keys,
  ``is_causal: false``, every layer ``sliding_attention``).
- ``weight_problems``: tensor names and shapes against the config (no ``embed_tokens`` / ``lm_head``);
  a DFlash2 folder holds exactly the published names and shapes (``DFlashConfig.weight_shapes``: codebooks
  without ``.weight``, in float even in a quantized folder).
- ``config_differences``: the reloaded config against the in-memory one, field by field.
- ``target_problems``: when the target folder is on this machine, its hidden size, vocabulary,
  layer count and tokenizer (the mask id must be a row the tokenizer never emits).
- ``random_block`` + ``logit_stats``: the parity gates' inputs and their comparison.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from models.config import DFlashConfig, layer_order_problem
from models.config_keys import (ARCHITECTURE, ARCHITECTURE2, ARCHITECTURES, CODEBOOKS, DFLASH2_KEYS, MODELING_FILE,
                                ConfigError)
from models.config_layout import is_drafter_config, read_json_file
from models.hub import SMALL_FILES, is_hub_id, resolve_model_dir
from models.mask_token import mask_problem
from models.weights import STRAY_KEY, weight_files

# Top-level keys of the flat layout (docs/design.md, "config.json"; written by DFlashConfig.to_dict).
REQUIRED_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "attention_bias", "max_position_embeddings",
    "vocab_size", "tie_word_embeddings", "layer_types", "sliding_window", "use_sliding_window", "torch_dtype",
    "num_target_layers", "block_size", "rope_theta", "rope_parameters", "dflash_config",
)
REQUIRED_DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "block_size")
# vLLM would read eagle_aux ids unshifted; the others are a target's rope (partial rotary, mrope), not the drafter's.
FORBIDDEN_KEYS = ("eagle_aux_hidden_state_layer_ids", "rope_scaling", "partial_rotary_factor", "mrope_section",
                  "mrope_interleaved")
FORBIDDEN_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
# Parity tolerance on logits, relative to the largest |logit| of the reference, by compute dtype. bf16 keeps 8
# significant bits to fp16's 11, so 8x fp16's: the MLX bf16 export of a trained tiny drafter measured 4.35e-2 (its
# fp32 export 3.5e-6: the maths agree, the rest is rounding), while a wrong weight or op moves logits by O(1).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 8e-2}
LOW_TOP1 = 0.9  # a quantized draft agreeing less often than this with the full-precision one is worth a warning


class ExportCheckError(ValueError):
    """An export failed a check; nothing was moved into place."""


def schema_problems(d: dict[str, Any], folder: Path | None = None, *, hf: bool = True) -> list[str]:
    """Everything wrong with a config.json dict for the engines (empty list = fine)."""
    problems = [f"missing key {k!r}" for k in REQUIRED_KEYS if k not in d]
    if hf and "auto_map" not in d:
        problems.append("missing key 'auto_map' (AutoModel(trust_remote_code=True) needs it)")
    problems += [f"key {k!r} must not be written (a drafter has plain RoPE and no eagle aux ids)"
                 for k in FORBIDDEN_KEYS if k in d]
    if d.get("architectures") not in [[name] for name in ARCHITECTURES.values()]:
        problems.append(f"architectures={d.get('architectures')!r}, expected [{ARCHITECTURE!r}] or [{ARCHITECTURE2!r}]")
    if d.get("architectures") == [ARCHITECTURE2]:
        problems += dflash2_schema_problems(d)
    nested = d.get("dflash_config") or {}
    problems += [f"missing key 'dflash_config.{k}'" for k in REQUIRED_DFLASH_KEYS if k not in nested]
    if "block_size" in d and "block_size" in nested and d["block_size"] != nested["block_size"]:
        problems.append(f"block_size={d['block_size']} but dflash_config.block_size={nested['block_size']}")
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":  # a published gpt-oss drafter's block, kept by a warm start from it
        problems += [f"rope_parameters.{k} missing from its YaRN block" for k in
                     ("factor", "original_max_position_embeddings") if k not in rope]
    elif rope.get("rope_type") != "default":
        problems.append(f"rope_parameters.rope_type={rope.get('rope_type')!r}, expected 'default' (plain RoPE) or "
                        "'yarn'")
    if "rope_theta" in d and rope.get("rope_theta") != d["rope_theta"]:
        problems.append(f"rope_theta={d['rope_theta']} but rope_parameters.rope_theta={rope.get('rope_theta')}")
    problems += [f"rope_parameters.{k} is set: the drafter's RoPE is full-head 1-D" for k in FORBIDDEN_ROPE_KEYS
                 if k in rope]
    n_layers, n_target = d.get("num_hidden_layers"), d.get("num_target_layers")
    if isinstance(d.get("layer_types"), list) and len(d["layer_types"]) != n_layers:
        problems.append(f"layer_types has {len(d['layer_types'])} entries for num_hidden_layers={n_layers}")
    ids = nested.get("target_layer_ids") or []
    if isinstance(n_target, int):
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < n_target - 1)]
        if bad:
            problems.append(f"target_layer_ids {ids} has {bad} outside 0..{n_target - 2} (the last target layer, "
                            f"{n_target - 1}, is never tapped)")
    if len(set(ids)) != len(ids):
        problems.append(f"target_layer_ids {ids} repeats a layer")
    elif all(isinstance(i, (int, float)) for i in ids) and (order := layer_order_problem(ids)):
        problems.append(f"target_layer_ids {ids}: {order}")
    mask, vocab = nested.get("mask_token_id"), d.get("vocab_size")
    if isinstance(vocab, int) and not (isinstance(mask, int) and 0 <= mask < vocab):
        problems.append(f"dflash_config.mask_token_id={mask!r} is not a row of the target embedding (vocab {vocab})")
    if not isinstance(nested.get("block_size", 2), int) or nested.get("block_size", 2) < 2:
        problems.append(f"dflash_config.block_size={nested.get('block_size')!r}: a block is the bonus token + masks")
    if "quantization" in d and d.get("quantization_config") != d["quantization"]:
        problems.append("quantization and quantization_config differ (mlx-lm writes the same value in both)")
    if hf and folder is not None and isinstance(d.get("auto_map"), dict):
        for ref in d["auto_map"].values():
            module = str(ref).split("--")[-1].rsplit(".", 1)[0]
            if not (folder / f"{module}.py").is_file():
                problems.append(f"auto_map points at {module}.py, which is not in the folder")
    return problems


def dflash2_schema_problems(d: dict[str, Any]) -> list[str]:
    """What the published DFlash2 layout needs beyond v1's keys (what vLLM, SGLang and z-lab's code read)."""
    nested = d.get("dflash_config") or {}
    problems = [f"missing key 'dflash_config.{k}' (DFlash2)" for k in DFLASH2_KEYS if k not in nested]
    if d.get("is_causal") is not False:
        problems.append(f"is_causal={d.get('is_causal')!r}: a DFlash2 drafter must say is_causal: false (absent or "
                        "true, engines make its layers causal inside the block)")
    types = d.get("layer_types")
    if not isinstance(types, list) or not types or any(t != "sliding_attention" for t in types):
        problems.append(f"layer_types={types!r}: every DFlash2 layer is sliding_attention")
    if d.get("use_sliding_window") is not True:
        problems.append("use_sliding_window must be true (transformers drops sliding_window when it is false)")
    window, block = d.get("sliding_window"), nested.get("block_size")
    if not isinstance(window, int) or (isinstance(block, int) and window < block):
        problems.append(f"sliding_window={window!r}: a DFlash2 drafter needs a window of at least the block")
    H, G = d.get("hidden_size"), nested.get("conv_group_size")
    if isinstance(H, int) and isinstance(G, int) and (G <= 0 or H % G):
        problems.append(f"dflash_config.conv_group_size={G} does not divide hidden_size={H}")
    return problems


def dflash2_weight_problems(shapes: dict[str, tuple[int, ...]], config: DFlashConfig) -> list[str]:
    """A DFlash2 folder's tensors against the published names and shape formulas. In an MLX-quantized folder the
    packed linears (``.weight`` + ``.scales`` + ``.biases``) are checked by name only; codebooks stay in float."""
    packed = {k.rsplit(".", 1)[0] for k in shapes if k.endswith(".scales")}
    problems = [f"weight {name!r} is quantized: the DFlash2 codebooks stay in float" for name in CODEBOOKS
                if name in packed]
    suffixed = [name for name in CODEBOOKS if f"{name}.weight" in shapes]
    problems += [f"weight '{name}.weight': DFlash2 codebooks are stored without '.weight' (engines read {name!r})"
                 for name in suffixed]
    want = {k: v for k, v in config.weight_shapes().items() if k.rsplit(".", 1)[0] not in packed}
    have = {k: v for k, v in shapes.items() if k.rsplit(".", 1)[0] not in packed and not STRAY_KEY.search(k)}
    missing = sorted(set(want) - set(have) - set(suffixed))
    unexpected = sorted(set(have) - set(want) - {f"{name}.weight" for name in suffixed})
    if missing:
        problems.append(f"weights {missing} are missing")
    if unexpected:
        problems.append(f"weights {unexpected} are not in the DFlash2 layout")
    problems += [f"{k} has shape {have[k]}, expected {want[k]}" for k in sorted(want)
                 if k in have and have[k] != want[k]]
    return problems


def weight_problems(folder: Path, config: DFlashConfig) -> list[str]:
    """Tensor names and shapes in the folder against the config (read from the headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="numpy") as f:
                for k in f.keys():
                    shapes[k] = tuple(f.get_slice(k).get_shape())
        except Exception as e:  # safetensors raises its own error types for damaged headers
            return [f"{path.name} is corrupt or truncated ({e})"]
    problems = [f"weight {k!r} is the target's, not the drafter's" for k in sorted(shapes) if STRAY_KEY.search(k)]
    fc = shapes.get("fc.weight")
    if fc is None:
        problems.append("weight 'fc.weight' is missing")
    elif not config.quantization and fc != (config.hidden_size, config.fc_in_features):
        problems.append(f"fc.weight has shape {fc}, expected {(config.hidden_size, config.fc_in_features)} "
                        f"(taps x hidden = {config.num_taps} x {config.hidden_size})")
    layers = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.")}
    if layers != set(range(config.num_hidden_layers)):
        problems.append(f"weights hold layers {sorted(layers)}, config.json says {config.num_hidden_layers}")
    if config.variant == "dflash2":
        problems += dflash2_weight_problems(shapes, config)
    return problems


def config_differences(expected: DFlashConfig, got: DFlashConfig) -> list[str]:
    """Field-by-field differences between the in-memory drafter's config and the reloaded one.

    Compares the dataclass fields, not ``to_dict()``: a writer bug must not hide on both sides.
    """
    a, b = asdict(expected), asdict(got)
    return [f"{k}: wrote {a.get(k)!r}, read back {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def target_problems(config: DFlashConfig, target: str | Path | None) -> tuple[list[str], str]:
    """Check the drafter against its target, a local folder or a Hub id (its config and tokenizer files
    only, never its weights); (problems, what was checked)."""
    if target and is_hub_id(target):
        try:
            folder = resolve_model_dir(target, what="target", allow_patterns=SMALL_FILES)
        except OSError as e:
            return [], f"target not checked (could not fetch the config of {target}: {e})"
    elif target and (Path(target) / "config.json").is_file():
        folder = Path(target)
    else:
        return [], "target not checked (neither a local folder with config.json nor a Hub id)"
    t = read_json_file(folder / "config.json")
    if is_drafter_config(t):  # its own layer count made this "the target has 2 decoder layers"
        raise ExportCheckError(f"the target {target} is a DFlash drafter ({folder / 'config.json'} names "
                               f"{ARCHITECTURE} / has dflash_config), not a target model: pass --target with the "
                               "target the drafter is for (its folder or Hub id). Nothing was exported")
    text = t.get("text_config") or t
    problems = []
    try:
        config.check_target(hidden_size=text.get("hidden_size"), vocab_size=text.get("vocab_size"),
                            num_layers=text.get("num_hidden_layers"))
    except ConfigError as e:
        problems.append(str(e))
    checked = "target shape"
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer  # start-up time (export.hf / export.mlx / export.push --help)

        try:
            tok = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as e:
            return problems, f"target shape (tokenizer not readable: {e})"
        # The rule training resolves the mask by (models.mask_token): a spare row, the tokenizer's own mask token
        # (Gemma 4's <mask>, z-lab's choice) or an unused special are fine; text, EOS and template tokens are not.
        why = mask_problem(tok, config.mask_token_id)
        if why:
            name = tok.convert_ids_to_tokens(config.mask_token_id)
            problems.append(f"mask_token_id={config.mask_token_id} ({name!r}) is a token the target's tokenizer "
                            f"emits ({why}): drafts would confuse it with real text")
        checked = "target shape and tokenizer"
    return problems, f"{checked} ({target})"


def raise_if(problems: list[str], what: str,
             fix: str = "Nothing was exported: fix the drafter (or its config.json) and export again") -> None:
    if problems:
        raise ExportCheckError(f"{what}: " + "; ".join(problems) + f". {fix}")


# ------------------------------------------------------------------------------ parity inputs
def random_block(config: DFlashConfig, seed: int = 0, context: int = 8, rows: int = 4) -> dict[str, np.ndarray]:
    """Random blocks: embedded tokens ``[rows, B, H]``, context features ``[rows, c, taps*H]``, positions."""
    rng = np.random.default_rng(seed)
    B = config.block_size
    return {"noise": (rng.standard_normal((rows, B, config.hidden_size)) * 0.05).astype(np.float32),
            "features": rng.standard_normal((rows, context, config.fc_in_features)).astype(np.float32),
            "positions": np.repeat(np.arange(context + B, dtype=np.int64)[None] + 3, rows, axis=0)}


def stand_in_head(config: DFlashConfig, seed: int = 0, rows: int = 4096) -> np.ndarray:
    """A seeded ``[rows, H]`` stand-in for the target's LM head (the real one is linear too, so equal
    hidden states give equal logits; a stand-in keeps the gate off the target's multi-GB weights)."""
    rng = np.random.default_rng(seed + 1)
    return (rng.standard_normal((min(rows, config.vocab_size), config.hidden_size)) /
            np.sqrt(config.hidden_size)).astype(np.float32)


def logit_stats(reference: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """Max / mean absolute logit error, the max error relative to max |reference|, top-1 agreement."""
    ref, out = np.asarray(reference, np.float64), np.asarray(got, np.float64)
    diff = np.abs(ref - out)
    scale = max(float(np.abs(ref).max()), 1e-12)
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "rel": float(diff.max() / scale),
            "top1": float((ref.argmax(-1) == out.argmax(-1)).mean())}


def check_parity(stats: dict[str, float], dtype: str, what: str) -> None:
    tol = TOLERANCE.get(dtype, TOLERANCE["bfloat16"])
    if not np.isfinite(stats["max_abs"]) or stats["rel"] > tol:
        raise ExportCheckError(f"{what}: logits differ by {stats['max_abs']:.3e} ({stats['rel']:.2e} of the largest "
                               f"logit; tolerance {tol:.0e} for {dtype}), top-1 agreement {stats['top1']:.1%}. "
                               "Nothing was exported: the written folder does not compute what the drafter does")


def modeling_file_name() -> str:
    return f"{MODELING_FILE}.py"
