"""Target adapters in MLX, the twin of ``target.py``: load a target with ``mlx_lm`` and tap layer outputs.

The target's forward is mlx_lm's own. To read the outputs of chosen decoder layers we swap those
layer objects, inside the decoder's ``layers`` list, for thin proxies that call the real layer and
keep its output (and, for cache rollback, its input), for the duration of one ``capture`` context.
The list is restored on exit, so the model is unmodified between calls, two drafters with
different layer ids never see each other's taps, and nested captures compose (each proxy wraps
whatever the list held and puts it back).

Architectures (same list as the torch adapter, ``models.target_folder.SUPPORTED``): Qwen3 dense / MoE,
Llama 3.x, Qwen3.5 / 3.6 hybrid (GatedDeltaNet + attention, dense / MoE, the text tower of the
multimodal checkpoints), GLM 4.x MoE, Qwen3-Next (hybrid), DeepSeek-V3 and Kimi K2 / K2.5 (latent
attention; mlx_lm's ``kimi_k25`` wraps the text model in ``language_model``), gpt-oss and Gemma 4. bf16 and
mlx-community affine-quantized (4 / 8 bit) checkpoints both load through mlx_lm (``mlx_lm_load``);
transformers 5 folders whose configs mlx_lm does not read yet (only ``rope_parameters``,
``num_local_experts``, ``qwen3_5_text``, Gemma 4's ``per_layer_config``) are adapted by config overrides, and
weights transformers saves in another layout than mlx_lm reads (Kimi K2.5's names, gpt-oss's bf16 experts)
are converted on load.

What a family does outside the decoder layers is the adapter's, as in torch: Gemma 4 multiplies the
embedding by sqrt(hidden) in the model's forward (``embed_tokens`` here is that scaled embedding, what the
drafter's block is embedded with) and soft-caps the logits (``logits``).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from models.quantization import describe_mlx
from models.rope import yarn_inv_freq
from models.target_folder import SUPPORTED, UnsupportedTarget, check_supported, read_target_config

__all__ = ["TargetModel", "TargetOutput", "Capture", "check_supported", "UnsupportedTarget", "SUPPORTED"]


@dataclass
class TargetOutput:
    features: mx.array | None  # [b, s, taps * hidden], tapped layer outputs in config order
    logits: mx.array | None  # [b, s', vocab] (s' = s, or the requested positions)
    cache: list | None = None


@dataclass
class Capture:
    """What one ``capture`` context saw: outputs of the tapped layers, inputs of the recorded ones."""

    outputs: dict[int, mx.array] = field(default_factory=dict)
    inputs: dict[int, mx.array] = field(default_factory=dict)


class _LayerTap:
    """Stands in for one decoder layer inside a ``capture`` context; everything else is delegated."""

    def __init__(self, layer, idx: int, capture: Capture, keep_output: bool, keep_input: bool):
        self._layer, self._idx, self._capture = layer, idx, capture
        self._keep_output, self._keep_input = keep_output, keep_input

    def __call__(self, x, *args, **kwargs):
        if self._keep_input:
            self._capture.inputs[self._idx] = x
        out = self._layer(x, *args, **kwargs)
        if self._keep_output:
            self._capture.outputs[self._idx] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):  # is_linear, use_sliding, ... as the model's forward expects
        return getattr(self._layer, name)


class TargetModel:
    """A loaded mlx_lm target: embedding, LM head, sizes, caches and a tapped forward."""

    def __init__(self, model, tokenizer=None, config: dict | None = None, name: str = ""):
        self.model = model
        # The HF tokenizer, as in the torch adapter (mlx_lm's TokenizerWrapper is not callable); the
        # wrapper is kept for its eos set (tokenizer + generation_config) and streaming detokenizer.
        # Tell the wrapper by its type: a transformers fast tokenizer has a ``_tokenizer`` too (its Rust
        # tokenizer), and taking that for the HF tokenizer left ``self.tokenizer`` uncallable.
        self.tokenizer_wrapper = tokenizer if isinstance(tokenizer, TokenizerWrapper) else None
        self.tokenizer = tokenizer._tokenizer if self.tokenizer_wrapper is not None else tokenizer
        self.name = name
        self.config = dict(config or {})
        self.model_type = self.config.get("model_type") or getattr(model, "model_type", "")
        self.family = check_supported(self.model_type)
        # Multimodal checkpoints wrap the text model in ``language_model``.
        inner = getattr(model, "language_model", None)
        self.language_model = model if inner is None else inner
        self.decoder = self.language_model.model
        self.args = self.language_model.args
        embedding = self.decoder.embed_tokens
        if getattr(self.args, "tie_word_embeddings", False) or not hasattr(self.language_model, "lm_head"):
            self.lm_head = embedding.as_linear
        else:
            self.lm_head = self.language_model.lm_head
        # Gemma 4 scales the embedding inside the model's forward, not in embed_tokens: the drafter borrows
        # the scaled one, as the torch adapter's embed_tokens is (the LM head stays the raw table).
        scale = getattr(self.decoder, "embed_scale", None)
        self.embed_tokens = embedding if scale is None else ScaledEmbedding(embedding, scale)
        self.softcap: float | None = getattr(self.language_model, "final_logit_softcapping", None) or None
        self.model.eval()

    # ------------------------------------------------------------------ facts
    @property
    def layers(self) -> list:
        """The decoder's own layer list (the one the forward iterates)."""
        return self.decoder.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.args.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    @property
    def max_position_embeddings(self) -> int:
        return int(getattr(self.args, "max_position_embeddings", None) or 32768)

    @property
    def dtype(self) -> mx.Dtype:
        """The compute dtype: what the embedding hands the first layer (scales' dtype when quantized)."""
        emb = self.embed_tokens
        return emb.scales.dtype if hasattr(emb, "scales") else emb.weight.dtype

    @property
    def layer_types(self) -> list[str]:
        listed = getattr(self.decoder, "layer_types", None)  # gpt-oss keeps them on the decoder
        if listed:
            return list(listed)
        types = []
        for layer in self.layers:
            if getattr(layer, "layer_type", None):  # Gemma 4 names each layer's
                types.append(layer.layer_type)
                continue
            if getattr(layer, "is_linear", False):
                types.append("linear_attention")
            elif getattr(layer, "use_sliding", False):
                types.append("sliding_attention")
            else:
                types.append("full_attention")
        return types

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def quantization(self) -> str:
        """``none`` or ``mlx-<bits>bit-g<group>``: the same words as the torch adapter's ``quantization``."""
        return describe_mlx(self.config) if self.config.get("quantization") else "none"

    def linear_attention_layers(self) -> list[tuple[int, object]]:
        """``(index, decoder layer)`` for every GatedDeltaNet layer."""
        return [(i, layer) for i, layer in enumerate(self.layers) if getattr(layer, "is_linear", False)]

    def eos_token_ids(self) -> list[int]:
        ids = None
        if self.tokenizer_wrapper is not None:
            ids = getattr(self.tokenizer_wrapper, "eos_token_ids", None)
        if ids is None and self.tokenizer is not None:
            ids = getattr(self.tokenizer, "eos_token_id", None)
        if ids is None:
            ids = self.config.get("eos_token_id", (self.config.get("text_config") or {}).get("eos_token_id"))
        if ids is None:
            return []
        return [int(ids)] if isinstance(ids, int) else sorted(int(i) for i in ids)

    # ----------------------------------------------------------------- compute
    def embed(self, ids: mx.array) -> mx.array:
        return self.embed_tokens(ids)

    def logits(self, hidden: mx.array) -> mx.array:
        """The LM head, then the config's soft-capping where it sets one (Gemma 4), as mlx_lm's forward."""
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        return logits

    def new_cache(self) -> list:
        return make_prompt_cache(self.model)

    @contextmanager
    def capture(self, layer_ids: list[int] = (), record_inputs: list[int] = ()):
        """Tap the outputs of ``layer_ids`` and the inputs of ``record_inputs`` for the forwards inside.

        The decoder's layer list is restored on exit, even when the forward raises.
        """
        cap = Capture()
        outs, ins = set(layer_ids), set(record_inputs)
        for i in outs | ins:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"layer id {i} is outside this target's {self.num_layers} layers")
        layers = self.layers
        originals = {i: layers[i] for i in sorted(outs | ins)}
        try:
            for i, layer in originals.items():
                layers[i] = _LayerTap(layer, i, cap, keep_output=i in outs, keep_input=i in ins)
            yield cap
        finally:
            for i, layer in originals.items():
                layers[i] = layer

    def forward(self, input_ids: mx.array, layer_ids: list[int] | None = None, *, cache: list | None = None,
                with_logits: bool = True, logits_slice: slice | None = None) -> TargetOutput:
        """Run the target (lazily); return the tapped layers' outputs (``hidden_states[l + 1]``) and logits.

        Positions come from the cache offsets (mlx_lm's convention), so the caller keeps the cache
        at the committed length.
        """
        layer_ids = list(layer_ids or [])
        with self.capture(layer_ids) as cap:
            hidden = self.decoder(input_ids, cache=cache)
        features = mx.concatenate([cap.outputs[i] for i in layer_ids], axis=-1) if layer_ids else None
        logits = None
        if with_logits:
            logits = self.logits(hidden if logits_slice is None else hidden[:, logits_slice])
        return TargetOutput(features=features, logits=logits, cache=cache)

    # ------------------------------------------------------------------ load
    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, revision: str | None = None,
                        dtype: mx.Dtype | None = None) -> "TargetModel":
        """Load a target (local folder or Hub id; bf16 or MLX-quantized) with ``mlx_lm.load``.

        ``dtype`` casts the floating weights (e.g. ``mx.float32`` for exactness tests); quantized
        weights keep their packing and only their scales/biases are cast.
        """
        directory, config = read_target_config(path_or_id, revision)
        model, tokenizer, _ = mlx_lm_load(directory, config)
        if dtype is not None:
            _cast_floating(model, dtype)
        return cls(model, tokenizer=tokenizer, config=config, name=str(path_or_id))


def _cast_floating(model, dtype: mx.Dtype) -> None:
    """Cast floating weights, honouring the model's ``cast_predicate`` (GatedDeltaNet ``A_log`` stays)."""
    keep = getattr(model, "cast_predicate", None) or (lambda _path: True)
    cast = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and keep(k)]
    if cast:
        model.update(tree_unflatten(cast))
        mx.eval(model.parameters())


def mlx_lm_load(directory: Path, config: dict, lazy: bool = False) -> tuple:
    """``mlx_lm.load`` of a target folder: (model, tokenizer wrapper, config as mlx_lm read it), with the config
    overrides below and, for a folder transformers wrote, its weight names as mlx_lm reads them
    (``SAVED_NAMES``)."""
    overrides = mlx_lm_overrides(config)
    renames = SAVED_NAMES.get(config.get("model_type"))
    classes = _get_classes if renames is None else _renaming(renames)
    convert = SAVED_LAYOUTS.get(config.get("model_type"))  # gpt-oss's bf16 experts (issue 46, below)
    classes = classes if convert is None else _converting(convert)
    model, read = load_model(Path(directory), lazy, model_config=overrides, get_model_classes=classes)
    fix_after_load(model, config)
    return model, load_tokenizer(Path(directory), eos_token_ids=read.get("eos_token_id", None)), read


# Weight names transformers' save_pretrained writes where mlx_lm reads the published checkpoint's: transformers 5.24
# saves Kimi K2.5's text layers as ``language_model.model.blocks.N`` and its projector as ``model.mm_projector``.
SAVED_NAMES = {"kimi_k25": ((r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                            (r"^model\.mm_projector\.", "mm_projector."))}


def _renaming(renames):
    """mlx_lm's model classes lookup (``mlx_lm.utils._get_classes``), with a model class that renames the weights
    before its own ``sanitize``."""
    def classes(config: dict):
        model_class, args_class = _get_classes(config)

        def sanitize(self, weights):
            for pattern, name in renames:
                weights = {re.sub(pattern, name, k): v for k, v in weights.items()}
            return model_class.sanitize(self, weights)
        return type(model_class.__name__, (model_class,), {"sanitize": sanitize,
                                                            "__module__": model_class.__module__}), args_class
    return classes


def mlx_lm_overrides(config: dict) -> dict:
    """Config keys mlx_lm needs but a transformers 5 ``config.json`` spells differently (or not at all)."""
    out: dict = {}
    model_type = config.get("model_type")
    # mlx_lm has no *_text modules; its qwen3_5 module reads a bare text config too.
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        out["model_type"] = model_type.removesuffix("_text")
    rope = config.get("rope_parameters") or {}
    if config.get("rope_theta") is None and "rope_theta" in rope and "text_config" not in config:
        out["rope_theta"] = rope["rope_theta"]
    if model_type == "qwen3_moe":
        if "num_experts" not in config and "num_local_experts" in config:
            out["num_experts"] = config["num_local_experts"]
        out.setdefault("mlp_only_layers", config.get("mlp_only_layers") or [])
    if model_type in FLAT_ROPE_MODEL_TYPES:
        out.update(flat_rope_overrides(config))
    family = FAMILY_OVERRIDES.get(model_type)  # gpt-oss / Gemma 4 (issue 46), below
    if family is not None:
        out.update(family(config))
    return out


# GLM 4.x MoE, Qwen3-Next, DeepSeek-V3 / Kimi K2 / K2.5: mlx_lm reads ``rope_theta``, ``partial_rotary_factor`` and
# ``rope_scaling``, which transformers 5 folds into ``rope_parameters``. Without them glm4_moe and qwen3_next fail to
# load (required arguments), and DeepSeek-V3 / Kimi load but run plain RoPE instead of YaRN: silently other logits.
FLAT_ROPE_MODEL_TYPES = ("glm4_moe", "qwen3_next", "deepseek_v3", "kimi_k2", "kimi_k25")


def flat_rope_overrides(config: dict) -> dict:
    """The rope keys mlx_lm reads, from a transformers 5 ``rope_parameters`` block; a multimodal config (Kimi
    K2.5) gets them inside its whole ``text_config`` (mlx_lm replaces top-level keys, it does not merge them).
    Keys the folder already has (published checkpoints ship ``rope_theta`` / ``rope_scaling``) are kept."""
    text = config.get("text_config")
    if isinstance(text, dict):
        inner = flat_rope_overrides(text)
        return {"text_config": {**text, **inner}} if inner else {}
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in rope:  # no flat block (or the folder's own keys): nothing to add
        return {}
    out = {"rope_theta": config.get("rope_theta") or rope["rope_theta"]}
    if "partial_rotary_factor" in rope and config.get("partial_rotary_factor") is None:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if config.get("rope_scaling") is None:
        out["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else dict(rope)
    return out


def fix_after_load(model, config: dict) -> None:
    """What the config says but mlx_lm's model does not do, applied to the loaded model.

    gpt-oss ships YaRN with ``truncate: false`` (the correction range is not rounded to whole dimensions);
    mlx_lm's ``YarnRoPE`` always rounds it, so its rotary frequencies (and every layer after the first) were
    off (logits by 1e-2 to 0.1 on tiny targets). The frequencies are set to transformers' unrounded ones.
    """
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("truncate") is False:
        for layer in getattr(model, "layers", []):
            r = getattr(getattr(layer, "self_attn", None), "rope", None)
            if r is not None and hasattr(r, "_freqs"):
                inv, _ = yarn_inv_freq(r.dims, float(rope.get("rope_theta", text.get("rope_theta"))), rope)
                r._freqs = mx.array(1.0 / inv)


class ScaledEmbedding:
    """An embedding whose rows come out multiplied by ``scale`` (Gemma 4: sqrt(hidden), applied in the compute
    dtype as mlx_lm's forward applies it); everything else (``weight``, ``scales``, ``as_linear``) is the
    embedding's own."""

    def __init__(self, embedding, scale: float):
        self.embedding, self.scale = embedding, scale

    def __call__(self, ids: mx.array) -> mx.array:
        return self.embedding(ids) * self.scale

    def __getattr__(self, name):
        return getattr(self.embedding, name)


# --- gpt-oss and Gemma 4 (issue 46): per-family config overrides and loading --------------------------------
FLAT_ROPE_MODEL_TYPES += ("gpt_oss",)  # its YaRN block: without rope_scaling mlx_lm runs plain RoPE (logits off by 2.5)


def _gemma4_text(text: dict) -> dict:
    """transformers 5.24 saves Gemma 4's global-layer head size and K/V heads as ``per_layer_config`` (one entry
    per full layer); mlx_lm reads ``global_head_dim`` / ``num_global_key_value_heads`` (Google's spelling)."""
    full = [v for k, v in (text.get("per_layer_config") or {}).items()
            if text["layer_types"][int(k)] == "full_attention"]
    out = {}
    if full and "global_head_dim" not in text and "head_dim" in full[0]:
        out["global_head_dim"] = full[0]["head_dim"]
    if full and "num_global_key_value_heads" not in text and "num_key_value_heads" in full[0]:
        out["num_global_key_value_heads"] = full[0]["num_key_value_heads"]
    return out


def _gemma4(config: dict) -> dict:
    """The multimodal checkpoint: its text tower's keys go inside ``text_config``, and the top-level
    ``vocab_size`` mlx_lm copies over the text tower's (its default, 262144, would replace the tower's own)."""
    text = config.get("text_config") or {}
    out = {"text_config": {**text, **_gemma4_text(text)}}
    if "vocab_size" not in config and "vocab_size" in text:
        out["vocab_size"] = text["vocab_size"]
    return out


FAMILY_OVERRIDES = {}  # model_type -> config.json -> the keys mlx_lm needs
FAMILY_OVERRIDES.update({"gemma4_text": _gemma4_text, "gemma4": _gemma4})


def gpt_oss_from_transformers(weights: dict) -> dict:
    """gpt-oss experts as transformers saves them in bf16 (``experts.gate_up_proj`` [E, H, 2I], gate and up
    interleaved, ``experts.down_proj`` [E, I, H], and their ``_bias``) -> the split layout mlx_lm's ``sanitize``
    passes through (``experts.{gate,up,down}_proj.{weight,bias}``, weights [E, out, in]). Other layouts (the
    original MXFP4 ``*_blocks``, mlx-community folders) are returned as they are."""
    if not any(k.endswith(".experts.gate_up_proj") for k in weights):
        return weights
    out = {}
    for k, v in weights.items():
        if k.endswith(".experts.gate_up_proj"):
            t = v.swapaxes(-1, -2)
            out[k.replace("gate_up_proj", "gate_proj.weight")] = mx.contiguous(t[:, ::2])
            out[k.replace("gate_up_proj", "up_proj.weight")] = mx.contiguous(t[:, 1::2])
        elif k.endswith(".experts.gate_up_proj_bias"):
            out[k.replace("gate_up_proj_bias", "gate_proj.bias")] = mx.contiguous(v[:, ::2])
            out[k.replace("gate_up_proj_bias", "up_proj.bias")] = mx.contiguous(v[:, 1::2])
        elif k.endswith(".experts.down_proj"):
            out[k + ".weight"] = mx.contiguous(v.swapaxes(-1, -2))
        elif k.endswith(".experts.down_proj_bias"):
            out[k.replace("down_proj_bias", "down_proj.bias")] = v
        else:
            out[k] = v
    return out


# model_type -> weights as transformers saved them -> the layout mlx_lm's sanitize reads
SAVED_LAYOUTS = {"gpt_oss": gpt_oss_from_transformers}


def _converting(convert):
    """mlx_lm's model classes lookup, with a model class that converts the weights before its own ``sanitize``."""
    def classes(config: dict):
        model_class, args_class = _get_classes(config)

        def sanitize(self, weights):
            return model_class.sanitize(self, convert(weights))
        return type(model_class.__name__, (model_class,), {"sanitize": sanitize,
                                                            "__module__": model_class.__module__}), args_class
    return classes
