"""Target adapters (PyTorch): load a causal LM and tap the outputs of chosen decoder layers.

One adapter covers the architectures whose decoder stack is ``embed_tokens -> layers -> norm``
with an ``lm_head``: Qwen3 (dense, MoE), Llama 3.x and Qwen3.5 / 3.6 (hybrid GatedDeltaNet +
attention, dense and MoE; the text tower of the multimodal checkpoint), GLM 4.x MoE, Qwen3-Next
(hybrid, like Qwen3.5), DeepSeek-V3 and Kimi K2 / K2.5 (multi-head latent attention; K2.5's text
tower), gpt-oss (attention sinks) and Gemma 4 (scaled embedding, soft-capped logits). What differs per
family is in ``models.target_folder.FAMILY_FACTS``. Taps are forward hooks
on the chosen layers, so only those layers' outputs are kept; when logits are not needed and no
cache is being filled, the forward stops right after the deepest tapped layer.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo.config
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, DeepseekV3ForCausalLM, DynamicCache,
                          FineGrainedFP8Config, GenerationConfig)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from models import gated_deltanet as gdn
from models.attention import CAUSAL_SDPA, attention_implementation, mask_free
from models.cache_keywords import cache_kwarg, passes_cache
from models.dequantize import dequantized_model
from models.hub import is_hub_id, snapshot_commit
from models.quantization import QuantizationError, describe_mlx, is_mlx_quantized, parse_quantization
from models.target_folder import SUPPORTED, UnsupportedTarget  # noqa: F401  (the adapter's names, as in the MLX twin)
from models.target_folder import check_supported, family_facts, load_tokenizer, read_target_config
from models.weights import read_safetensors_tensors

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_max_memory(spec: str | dict | None) -> dict | None:
    """``"0=70GiB,1=70GiB,cpu=200GiB"`` (or a dict) -> transformers' ``max_memory`` (GPU keys as ints)."""
    if spec is None or spec == "" or spec == {}:
        return None
    items = spec.items() if isinstance(spec, dict) else (part.split("=", 1) for part in str(spec).split(",") if part)
    out: dict = {}
    for item in items:
        if len(item) != 2 or not str(item[0]).strip() or not str(item[1]).strip():
            raise ValueError(f"max_memory {spec!r}: write DEVICE=SIZE pairs separated by commas, "
                             "e.g. 0=70GiB,1=70GiB,cpu=200GiB")
        key, size = str(item[0]).strip(), str(item[1]).strip()
        if not (key.isdigit() or key in ("cpu", "disk", "mps")):
            raise ValueError(f"max_memory {spec!r}: device {key!r} is not a GPU index, 'cpu' or 'disk'")
        out[int(key) if key.isdigit() else key] = int(size) if size.isdigit() else size
    return out


def warn_if_slow_linear_attention(family: str, device: torch.device) -> None:
    """One line when a Qwen3.5 / 3.6 or Qwen3-Next target runs on CUDA without the fast GatedDeltaNet kernels."""
    if family_facts(family).linear_attention is None or device.type != "cuda" or \
            importlib.util.find_spec("fla") is not None:
        return
    logging.getLogger(__name__).warning(
        "%s target on CUDA without flash-linear-attention: GatedDeltaNet runs transformers' torch reference "
        "(2.7x slower forward); install the kernels: pip install 'draftsmith[cuda]' "
        "(and causal-conv1d where it builds)", {"qwen3_5": "Qwen3.5", "qwen3_next": "Qwen3-Next"}.get(family, family))


# ----------------------------------------------------------------------------- text towers AutoModelForCausalLM refuses
class KimiK25TextModel(DeepseekV3ForCausalLM):
    """Kimi K2.5's text tower alone, from the multimodal checkpoint: a DeepSeek-V3 causal LM (``kimi_k2``) whose
    weights the checkpoint stores under ``language_model.`` (``language_model.model.layers.N``,
    ``language_model.lm_head``); the vision tower and projector are not loaded. transformers' own
    ``save_pretrained`` of the multimodal model writes ``language_model.model.blocks.N`` and
    ``model.mm_projector``: read too."""

    _keys_to_ignore_on_load_unexpected = [r"^vision_tower\.", r"^(model\.)?mm_projector\."]
    checkpoint_keys = {r"^language_model\.model\.blocks\.": "model.layers.", r"^language_model\.": ""}


# model_type -> the causal LM of its text tower, for multimodal checkpoints AutoModelForCausalLM does not map to
# one (it maps Qwen3.5's itself).
TEXT_TOWERS = {"kimi_k25": KimiK25TextModel}


def load_causal_lm(directory: Path, model_type: str | None, **kwargs) -> nn.Module:
    """The causal LM (the text tower of a multimodal checkpoint) of a target folder, as transformers loads it."""
    tower = TEXT_TOWERS.get(model_type)
    if tower is None:
        return AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    full = AutoConfig.from_pretrained(directory)
    text = full.get_text_config(decoder=True)
    if getattr(full, "quantization_config", None) is not None and getattr(text, "quantization_config", None) is None:
        text.quantization_config = full.quantization_config  # a quantized checkpoint may say so at the top only
    return tower.from_pretrained(directory, config=text, key_mapping=tower.checkpoint_keys, **kwargs)


class _StopForward(Exception):
    """Raised by the deepest tap when nothing after it is needed."""


@dataclass
class TargetOutput:
    features: torch.Tensor | None  # [b, s, taps * hidden], tapped layer outputs in config order
    logits: torch.Tensor | None  # [b, s', vocab] (s' = s, or the requested positions)
    cache: object | None = None


def check_borrowed_parts_resident(model) -> None:
    """A spread target (``device_map``) must keep its embedding and LM head in device memory.

    The drafter borrows their weight tensors directly (the training loss multiplies by ``lm_head.weight``),
    and features and logits are gathered where the embedding is: offloaded to the CPU or disk by
    accelerate, those weights are empty placeholders outside each module's own call.
    """
    placed = getattr(model, "hf_device_map", None) or {}
    # With a GPU in the map, "cpu" means offloaded too (weights in host memory, moved in for each call).
    gpus = any(isinstance(w, int) or str(w).startswith("cuda") for w in placed.values())
    offloaded = ("disk", "meta", "cpu") if gpus else ("disk", "meta")
    for name, where in placed.items():
        borrowed = name in ("", "lm_head", "model", "model.language_model") or name.endswith("embed_tokens")
        if borrowed and str(where) in offloaded:
            raise ValueError(f"device_map put the target's {name or 'whole model'} on {where!r}: the embedding and "
                             "LM head must stay in device memory (the drafter uses their weights directly). Raise "
                             "max_memory for the first GPU, or add GPUs")


def allow_recompiles(n: int) -> None:
    """Raise dynamo's recompile limit (8) to ``n``: HF layers compile once per layer and kind of shape, and
    past the limit the rest would silently run eager."""
    dyn = torch._dynamo.config
    dyn.recompile_limit = max(getattr(dyn, "recompile_limit", 8), n)


def _around_the_mixer(layer: nn.Module) -> list[nn.Module]:
    """A linear-attention layer's parts that are plain torch, for a mixer ``models.gated_deltanet`` cannot
    run: its norms, its MLP, and the mixer's gated output norm."""
    parts = [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp]
    gated = getattr(getattr(layer, "linear_attn", None), "norm", None)
    return parts + ([gated] if isinstance(gated, nn.Module) else [])


def _uncached_compiled(eager, backend):
    """``eager``, compiled for calls without a cache (``TargetModel.compile_layers``)."""
    compiled = torch.compile(eager, backend=backend)

    def forward(*args, **kwargs):
        return (eager if passes_cache(kwargs) else compiled)(*args, **kwargs)
    return forward


class TargetModel:
    """A loaded target: embedding, LM head, sizes, and a tapped forward."""

    def __init__(self, model: nn.Module, tokenizer=None, name: str = ""):
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "")
        self.model_type = model.config.model_type
        self.family = check_supported(self.model_type)
        self.config = model.config.get_text_config(decoder=True)
        inner = model.model
        self.decoder = getattr(inner, "language_model", inner)  # multimodal checkpoints wrap the text tower
        self.layers = self.decoder.layers
        self._cache_kw = cache_kwarg(self.decoder)  # read once: the signature does not change per call
        self._layers_compiled = False  # compile_layers ran
        # the configs HF reads the attention implementation from: the decoder's (masks), the layers' (attention)
        self._attention_configs = list({id(c): c for c in [self.decoder.config, *(
            la.self_attn.config for la in self.layers if hasattr(la, "self_attn"))]}.values())
        self.embed_tokens = self.decoder.embed_tokens
        self.lm_head = model.get_output_embeddings()
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers))
        self.facts = family_facts(self.family)
        # Gemma 4: logits = cap * tanh(logits / cap), as the model's own forward computes them (greedy decoding
        # never sees it, sampling and the target's distributions do).
        self.softcap: float | None = getattr(self.config, "final_logit_softcapping", None) or None
        warn_if_slow_linear_attention(self.family, self.device)
        # What the weights are ("none", "mlx-4bit-g64", "bnb-4bit", ...): recorded as "trained against".
        self.quantization = "none"
        # False when only the embedding and LM head were loaded (``borrowed_parts``): no forward.
        self.has_layers = True
        # Name, revision and weight fingerprint, set by ``data.store.target_identity`` the first time.
        self.identity: dict | None = None
        # The Hub commit of the snapshot the weights were read from (None for a local folder): the fingerprint
        # reads that commit's files, not those of a branch that may have moved on since.
        self.revision: str | None = None

    # ------------------------------------------------------------------ facts
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def max_position_embeddings(self) -> int:
        return getattr(self.config, "max_position_embeddings", 32768)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def linear_attention_modules(self) -> list[tuple[int, nn.Module]]:
        return [(i, layer.linear_attn) for i, layer in enumerate(self.layers) if hasattr(layer, "linear_attn")]

    def eos_token_ids(self) -> list[int]:
        gen = getattr(self.model, "generation_config", None)
        ids = getattr(gen, "eos_token_id", None) if gen is not None else None
        if ids is None:
            ids = self.config.eos_token_id
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        return [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))

    def compile_layers(self, backend: str = "inductor", fuse_mixer: bool = True) -> "TargetModel":
        """``torch.compile`` each decoder layer's ``forward`` for the tapped forward (online training with
        ``train.compile=true``).

        The frozen target's forward is ~40% of an online step and, eager, runs every norm, rotary
        product and SiLU gate as its own kernel. ``forward`` is compiled rather than the module call,
        so the taps (forward hooks, added and removed per call) stay outside the compiled code and
        never force a recompile. GatedDeltaNet layers (Qwen3.5 / 3.6) compile everything around their
        mixer's chunked kernel (flash-linear-attention's Triton kernels, which run as they are) as two
        graphs (``models.gated_deltanet``): the input RMSNorm, the four input projections (joined into one
        matmul), conv and gates before the kernel; the gated norm, output projection, residual adds, second
        RMSNorm and MLP after it (eager, each RMSNorm was ~7 elementwise kernels over the whole activation
        in fp32, ~10 ms of a Qwen3.5-9B step on an H200). A layer it cannot run, or every layer with
        ``fuse_mixer=False``, keeps its mixer's own forward and compiles its norms and MLP one by one.
        Shapes are marked dynamic after the first new length (dynamo's default), so varying row lengths
        do not recompile per batch; the limit is raised to one compile per layer and kind of shape.
        Passes that fill a cache (the held-out generation, the loops) keep the eager layers: a cache
        update specialises each compile on its layer index and a growing length, minutes of compiles for
        nothing.
        """
        if self._layers_compiled:  # a second call would compile the compiled wrappers
            return self
        self._layers_compiled = True
        allow_recompiles(2 * len(self.layers) + 8)
        # one compiled function for every GatedDeltaNet layer: the weights are graph inputs, so layers share it
        inputs, output = (torch.compile(f, backend=backend) for f in (gdn.layer_inputs, gdn.layer_output))
        for layer in self.layers:
            if getattr(layer, "linear_attn", None) is None:  # an attention layer: the whole layer
                layer.forward = _uncached_compiled(layer.forward, backend)
            elif fuse_mixer and gdn.fusable(layer):
                gdn.join_input_projections(layer.linear_attn)
                layer.forward = gdn.uncached_forward(layer, inputs, output)
            else:
                for part in _around_the_mixer(layer):
                    part.forward = _uncached_compiled(part.forward, backend)
        return self

    # ----------------------------------------------------------------- compute
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The block embedding the drafter borrows: Gemma's ``embed_tokens`` multiplies by sqrt(hidden) itself."""
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits: the LM head, then the config's soft-capping where it sets one (Gemma 4)."""
        logits = self.lm_head(hidden)
        if self.softcap:  # the same three rounded ops as transformers' Gemma forward
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's ``(cos, sin)`` for one row at ``positions`` [T], as its layers take them.

        Qwen3.5's text rotary embedding is M-RoPE shaped: it takes one position row per section,
        ``[3, batch, T]``. transformers 5.17 indexes that shape directly (a ``[1, T]`` row fails
        with an IndexError), later versions expand a 2-D row themselves; the 3-D form works in both.
        """
        rotary = self.decoder.rotary_emb
        ids = positions[None]
        if getattr(rotary, "mrope_section", None) is not None:
            ids = ids[None].expand(3, 1, -1)
        return rotary(hidden, ids)

    def new_cache(self):
        """A cache the loops can roll back: sliding-window attention layers get a full layer.

        transformers' sliding layer drops its oldest positions once the window is full and then refuses
        ``crop``; a full layer keeps every position and the model's sliding-window mask (built from the
        config, not from the cache) still limits what each query sees, so outputs are the same.
        """
        cache = DynamicCache(config=self.model.config)
        cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                        for layer in cache.layers]
        return cache

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, layer_ids: list[int] | None = None, *, cache=None,
                position_ids: torch.Tensor | None = None, with_logits: bool = True,
                logits_slice: slice | None = None, attention_mask: torch.Tensor | None = None) -> TargetOutput:
        """Run the target; return the tapped layers' outputs (``hidden_states[l + 1]``) and logits."""
        if not self.has_layers:
            raise RuntimeError(f"target {self.name} was loaded without its decoder layers (only the embedding and LM "
                               "head, for training on offline features): this step needs the whole target. Prepare "
                               "the data first (python -m data.prepare), or train with features.mode=online")
        layer_ids = list(layer_ids or [])
        for i in layer_ids:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"layer id {i} is outside this target's {self.num_layers} layers")
        captured: dict[int, torch.Tensor] = {}
        stop_after = max(layer_ids) if (layer_ids and not with_logits and cache is None) else None

        def tap(idx):
            def hook(_module, _args, output):
                captured[idx] = output[0] if isinstance(output, tuple) else output
                if idx == stop_after:
                    raise _StopForward
            return hook

        handles = [self.layers[i].register_forward_hook(tap(i)) for i in sorted(set(layer_ids))]
        out = None
        # Unpadded and uncached (the training step's online features): HF's mask builders would read the
        # GPU back only to find there is nothing to mask (models/attention.py).
        plain = cache is None and attention_mask is None and position_ids is None
        configs = self._attention_configs
        try:
            fast = plain and self.facts.sdpa and mask_free(configs, self.layer_types)  # sinks: never SDPA
            with attention_implementation(configs, CAUSAL_SDPA if fast else None):
                out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=cache is not None, **{self._cache_kw: cache})
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        # A target dispatched over several devices (device_map) leaves each layer's output on its own
        # device: features and logits are gathered on the first one, where the drafter lives.
        device = self.device
        features = torch.cat([captured[i].to(device) for i in layer_ids], dim=-1) if layer_ids else None
        logits = None
        if with_logits:
            hidden = out.last_hidden_state
            logits = self.logits(hidden if logits_slice is None else hidden[:, logits_slice]).to(device)
        return TargetOutput(features=features, logits=logits, cache=cache)

    # ------------------------------------------------------------------ load
    @classmethod
    def from_pretrained(cls, path_or_id: str | Path, dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None, revision: str | None = None,
                        quantization: str | None = None, device_map: str | dict | None = None,
                        max_memory: str | dict | None = None, **kwargs) -> "TargetModel":
        """Load a target from a local folder or a Hub id (config checked before any weights load).

        ``device_map`` (``auto`` / ``balanced`` / ``sequential`` / an explicit map) spreads a target
        too large for one GPU over the devices within ``max_memory`` (``"0=70GiB,1=70GiB"``): the
        embedding sits on the first device, and features and logits come back there.

        An MLX affine-quantized folder (mlx-community layout) is dequantized bit-exactly
        (``load_mlx_target``), so every consumer runs the weights the Mac runs.
        ``quantization`` = ``bnb-4bit`` / ``fp8`` loads through transformers' quantizers.
        """
        directory, config = read_target_config(path_or_id, revision)
        if isinstance(dtype, str):
            dtype = None if dtype == "auto" else getattr(torch, dtype)
        if device_map is not None:
            if isinstance(device_map, str) and device_map not in DEVICE_MAPS:
                raise ValueError(f"device_map {device_map!r}: use one of {', '.join(DEVICE_MAPS)}, "
                                 "or an explicit {module: device} map")
            if device is not None:
                raise ValueError("give either device (the whole target on one device) or device_map (spread "
                                 "over several), not both")
            kwargs["device_map"] = device_map
            kwargs["max_memory"] = parse_max_memory(max_memory)
        elif max_memory:
            raise ValueError("max_memory needs device_map (e.g. device_map=auto): it is a budget per device "
                             "for spreading the target")
        if is_mlx_quantized(directory):
            if device_map is not None:
                raise ValueError(f"device_map is not supported for MLX-quantized targets ({directory}): load it "
                                 "on one device (a 4-bit target is a quarter of the bf16 size)")
            return load_mlx_target(directory, dtype=dtype, device=device)
        quant_config = transformers_quantization_config(quantization)
        if quant_config is not None:  # quantized weights are placed by transformers, never moved afterwards
            kwargs["quantization_config"] = quant_config
            if device is not None:
                kwargs.setdefault("device_map", {"": str(device)})
                device = None
        model = load_causal_lm(directory, config.get("model_type"), dtype=dtype or "auto", **kwargs)
        check_borrowed_parts_resident(model)
        if device is not None:
            model = model.to(device)
        tokenizer = None
        if any(directory.glob("tokenizer*")):
            tokenizer = load_tokenizer(directory)
        target = cls(model, tokenizer=tokenizer, name=str(path_or_id))
        target.revision = snapshot_commit(directory)
        if quant_config is not None:
            target.quantization = quantization
        return target

    @classmethod
    def borrowed_parts(cls, path_or_id: str | Path, dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu", revision: str | None = None) -> "TargetModel":
        """The target with only its embedding and LM head in memory: all that training on offline features
        borrows (the drafter's input embedding and loss head). The decoder layers stay on the meta device
        (shapes and config only), so Qwen3.5-27B costs its ~5 GB of embedding and head per GPU
        instead of 55 GB. ``forward`` refuses. Only the two tensors are read from the safetensors shards.
        """
        directory, _ = read_target_config(path_or_id, revision, weights=False)  # shards: only the two tensors'
        if is_mlx_quantized(directory):
            raise ValueError(f"{directory} is MLX-quantized: its embedding and head are packed; load the whole target")
        config = AutoConfig.from_pretrained(directory).get_text_config(decoder=True)
        dtype = dtype or getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        names = {m: n for n, m in model.named_modules()}
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        wanted = {"embed": names[embed] + ".weight", "head": names[head] + ".weight"}
        # Tied checkpoints store no head tensor; one that stores both is loaded untied (as from_pretrained does).
        tied = bool(getattr(config, "tie_word_embeddings", False))
        found = read_safetensors_tensors(directory, [wanted["embed"], wanted["head"]], device,
                                         optional=[wanted["head"]] if tied else [],
                                         repo_id=str(path_or_id) if is_hub_id(path_or_id) else None)
        embed.weight = nn.Parameter(found[wanted["embed"]].to(dtype), requires_grad=False)
        head_weight = found.get(wanted["head"])
        head.weight = (embed.weight if head_weight is None
                       else nn.Parameter(head_weight.to(dtype), requires_grad=False))
        if hasattr(embed, "scalar_embed_scale"):  # Gemma: sqrt(hidden), a non-persistent buffer left on meta
            embed.embed_scale = torch.tensor(embed.scalar_embed_scale, device=embed.weight.device)
        if (directory / "generation_config.json").is_file():  # eos ids, as from_pretrained reads them
            model.generation_config = GenerationConfig.from_pretrained(directory)
        tokenizer = load_tokenizer(directory) if any(directory.glob("tokenizer*")) else None
        target = cls(model, tokenizer=tokenizer, name=str(path_or_id))
        target.revision = snapshot_commit(directory)
        target.has_layers = False
        return target


def load_mlx_target(path_or_id: str | Path, dtype: torch.dtype | None = None, device=None,
                    revision: str | None = None) -> TargetModel:
    """An MLX affine-quantized folder or Hub repo -> a ``TargetModel`` on dequantized weights
    (``models.dequantize``).

    ``dtype`` defaults to the scales' dtype (bf16 for mlx-community repos). The adapter's
    ``quantization`` attribute says what it was loaded from.
    """
    directory, config = read_target_config(path_or_id, revision, what="quantized target")
    model = dequantized_model(directory, config, dtype)
    if device is not None:
        model = model.to(device)
    tokenizer = None
    if any(directory.glob("tokenizer*")):
        tokenizer = load_tokenizer(directory)
    target = TargetModel(model, tokenizer=tokenizer, name=str(path_or_id))
    target.quantization = describe_mlx(config)
    return target


def transformers_quantization_config(value: str | None):
    """``bnb-4bit`` / ``fp8`` -> the transformers ``quantization_config`` to load with; None otherwise.

    The backend must be installed: the error says what to install instead of failing mid-load.
    """
    spec = parse_quantization(value)
    if spec.kind == "bnb":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise QuantizationError("target.quantization=bnb-4bit needs bitsandbytes: pip install bitsandbytes "
                                    "(CUDA), or use mlx-4bit, which runs anywhere")
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    if spec.kind == "fp8":
        if not torch.cuda.is_available():
            raise QuantizationError("target.quantization=fp8 needs a CUDA GPU (transformers' FP8 kernels); "
                                    "on CPU use mlx-8bit")
        return FineGrainedFP8Config()
    if spec.kind == "mlx":
        raise QuantizationError(f"target.quantization={value}: MLX quantization is resolved to a folder first "
                                "(models.quantize.resolve_target); load that folder")
    return None
