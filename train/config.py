"""Training config: typed dataclasses, a YAML recipe, dotted ``key=value`` overrides.

``load_config(["recipe=qwen35-9b", "train.lr=3e-4", "--dry-run"])`` reads ``recipes/qwen35-9b.yaml``
(or a path to any YAML file), applies the overrides in order and returns a ``RunConfig``. Every
key is checked against the dataclasses: an unknown key is an error naming it and the closest
valid key. Values are parsed as YAML (``3e-4`` -> float, ``true`` -> bool, ``[1,2]`` -> list).

Drafter config keys are *not* spelled here: ``drafter.*`` holds only the training-time choices
(layer count, taps, block size, optional shape overrides) that ``models.config.DFlashConfig``
turns into the canonical drafter config. How a recipe and overrides become these dataclasses (key
checks, type coercion, the closest-key hints): ``train/overrides.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from models.config import LAYER_ORDER_FIX, layer_order_problem
from models.quantization import parse_quantization
# shared with exports, which name the objective; the run folder's layout
from models.provenance import DPACE_ALPHA, GAMMA_BY_BLOCK, SELECTOR_LOSS_ALPHA, STEP_DIR, checkpoint_dirs
from train.overrides import (build, check_key, flatten, leaf_type, parse_args, parse_value, recipe_path,
                             set_dotted)
from train.overrides import valid_keys as keys_of

# train.compile's booleans as YAML 1.1 and the command line spell them (a str key reads `false` as "no")
COMPILE_SPELLINGS = {"yes": "true", "on": "true", "1": "true", "no": "false", "off": "false", "0": "false"}


def compile_setting(value) -> str:
    """``train.compile`` as ``auto``, ``true`` or ``false`` (train/compiling.py says what each does); a boolean,
    or any spelling of one, included. Anything else is returned as given, for ``validate`` to refuse."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower()
    return COMPILE_SPELLINGS.get(text, text)


@dataclass
class TargetConfig:
    # Local folder or Hub id. "tiny:<arch>" builds a tiny seeded target locally (arch: qwen3, llama, ...).
    path: str = ""
    revision: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    # none | mlx:PATH_OR_ID | mlx-Nbit, N in 2 3 4 5 6 8 (-g32/-g64/-g128) | bnb-4bit | fp8 (models/quantization.py)
    quantization: str = "none"
    # A target too large for one GPU: spread it over this node's GPUs (auto | balanced | sequential; transformers'
    # device_map), one training process per node, the drafter on the first GPU. max_memory: budget per device,
    # "0=40GiB,1=75GiB,..." (leave room on GPU 0 for the drafter, its optimizer state and activations).
    device_map: str | None = None
    max_memory: str | None = None
    # Shape facts used by the dry-run plan when config.json cannot be fetched (refreshed from it when it can).
    model_type: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None  # the target's RoPE base (the drafter's default base)
    params_b: float | None = None  # total parameters, billions
    active_params_b: float | None = None  # per-token parameters for MoE targets (FLOPs), billions
    # GiB of weights as loaded, for a checkpoint not stored in bf16 (FP8 DeepSeek-V3, Kimi K2.5's INT4 experts);
    # the plan counts params_b x 2 bytes otherwise
    weights_gib: float | None = None


@dataclass
class DataConfig:
    # Conversations: a JSONL/Parquet file, a datasets folder, a Hub data set id, or "tiny" (data/tiny_chat.py).
    source: str = ""
    split: str = "train"
    subset: str | None = None
    limit: int | None = None  # conversations to read (None = all)
    # Where the prepared (tokenized, loss-masked) data set goes; default {out_dir}/data.
    prepared: str | None = None
    # none | local (in-process with the target) | vllm | sglang (started on a free port, stopped before training)
    # | http://host:port/v1 (a running OpenAI-compatible server)
    regenerate: str = "none"
    regenerate_max_tokens: int = 1024
    regenerate_batch_size: int = 64  # conversations per batch when regenerate=local
    rebuild: bool = False  # the prepared data was made with other settings: rebuild it (default: refuse)
    thinking: bool | None = None  # the chat template's thinking switch: set it to how the target is served
    max_length: int = 3072
    pack: bool = False
    eval_rows: int = 64  # held out from the end of the prepared set
    tiny_conversations: int = 256  # data.source=tiny only
    force_target: bool = False  # use data regenerated by another target (or another quantization of it) anyway


@dataclass
class FeaturesConfig:
    mode: str = "online"  # online: target runs in the step | offline: read a store from `python -m data.extract`
    store: str | None = None  # offline store folder
    # Read by no run (training never extracts: a store is read in the dtype `python -m data.extract --dtype` wrote);
    # kept so configs and checkpoints that carry it still load, and any other value is refused.
    dtype: str = "bf16"


@dataclass
class DrafterConfig:
    num_hidden_layers: int = 5
    num_taps: int = 5
    target_layer_ids: list[int] | None = None  # None = default_layer_ids(num_target_layers, num_taps)
    block_size: int = 16
    # None = from the target (heads / kv heads / head_dim / intermediate of the target's attention).
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    # None = the tokenizer's mask token, else the first spare embedding row, else a reserved special token.
    mask_token_id: int | None = None
    rope_theta: float | None = None  # None = the target's own RoPE base frequency
    init_from: str | None = None  # start from an existing drafter folder
    # dflash | dflash2 (v1 backbone + per-layer dynamic convs + candidate selector; models/drafter2.py)
    variant: str = "dflash"


@dataclass
class TrainConfig:
    epochs: float = 6
    max_steps: int | None = None  # optimizer steps; None = epochs x steps per epoch
    batch_size: int = 1  # rows per micro-batch per device
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    schedule: str = "cosine"  # cosine | constant
    warmup_ratio: float = 0.04
    clip: float = 1.0
    anchors: int = 512  # blocks per row, re-drawn every epoch
    # How the per-slot losses of a block are weighted (docs/design.md, "Training objective"):
    # decay: the paper's fixed w_k = exp(-(k-1)/gamma), normalised by the weight sum;
    # dpace: D-PACE, w_j = sum_{k>=j} prod_{i<=k} ((1 - dpace_alpha) exp(-CE_i) + dpace_alpha), from the drafter's
    # own per-slot CE (detached), normalised by dpace_normaliser.
    loss_weighting: str = "dpace"  # dpace | decay (why D-PACE: lab/README.md, "D-PACE and DFlash2 at ...")
    gamma: float | None = None  # decay only; None = 7 / 5 / 4 for block 16 / 10 / 8
    dpace_alpha: float | None = None  # dpace only, in [0, 1]; None = 0.5 (1 = weights independent of the drafter)
    # dpace only; None = weights. weights: sum w CE / sum w (the decay's convention, a weighted mean CE);
    # tokens: / scored slots; rows: / training rows. With rows the loss, and its gradients, are ~N*B times
    # those of weights (N anchors per row, B the block): train.clip=1.0 then always binds, and clipping sets
    # the step size rather than the lr alone.
    dpace_normaliser: str | None = None
    # DFlash2 only (drafter.variant=dflash2; refused for v1), >= 0; None = 1.0. Each scored slot's loss is the unary
    # loss above plus selector_loss_alpha x the selector's K-way cross-entropy over the slot's unary top-K
    # (selector_top_k) candidates, scored with the true previous token as predecessor (teacher forcing), the label
    # injected at rank K when outside the top-K; same slot weights and normaliser as the unary loss. This is
    # speculators' experimental DFlash2 objective taken as the model (z-lab has published none): ours, not the
    # reference's (docs/design.md, "DFlash2").
    selector_loss_alpha: float | None = None
    loss: str = "ce"  # ce | kl | ce+kl
    kl_weight: float = 1.0
    kl_topk: int = 32  # online KL: top-k of the target distribution kept per position
    ce_chunk: int = 2048  # block slots per LM-head chunk (logits: chunk x vocab fp32)
    attention: str = "auto"  # auto (flex on CUDA, dense on CPU) | flex | dense
    # flex backward tiles: auto (measured best for the GPU, else torch's) | torch | M1,N1,M2,N2,STAGES,WARPS
    flex_backward: str = "auto"
    grad_checkpointing: bool = False
    # torch.compile each drafter layer and, online, the target's: auto (on CUDA; off on CPU / MPS) | true | false
    compile: str = "auto"
    mixed_precision: str = "auto"  # auto (bf16 on CUDA, no on CPU) | bf16 | fp16 | no
    seed: int = 0


@dataclass
class EvalConfig:
    every: int = 500  # steps (0 = only at the end)
    at_start: bool = True  # also evaluate the untrained drafter (step 0): the baseline tau
    batches: int = 8  # held-out step batches (batch_size x grad_accum x processes rows each) for the simulated tau
    true_tau_every: int = 0  # steps between real DFlash generations (0 = only at the end if true_tau_prompts)
    true_tau_prompts: int = 0  # held-out prompts generated with the torch loop (0 = off)
    true_tau_max_new_tokens: int = 128


@dataclass
class LoggingConfig:
    every: int = 10
    wandb: bool = False
    wandb_project: str = "draftsmith"
    wandb_mode: str | None = None  # online | offline (None = wandb's default)
    progress: bool = True


@dataclass
class CheckpointConfig:
    every: int = 1000  # steps (0 = only at the end)
    keep_last: int = 3  # 0 = keep every checkpoint


@dataclass
class ExportConfig:
    """After training, run ``python -m export.hf`` / ``export.mlx`` / ``export.push`` on the final drafter
    (train/export_stage.py). Folders: ``{dir}/hf`` and ``{dir}/mlx``."""

    hf: bool = False  # HF folder for vLLM / SGLang / transformers
    hf_dtype: str = "bf16"  # bf16 | fp16 | fp32
    mlx: bool = False  # MLX folder for a Mac
    mlx_quantize: int | None = None  # 4 | 8 bits (None = bf16)
    mlx_group_size: int = 64  # 32 | 64 | 128
    push_repo: str | None = None  # push the HF export to this Hub repo (needs export.hf=true)
    push_mlx_repo: str | None = None  # push the MLX export to this Hub repo (needs export.mlx=true)
    push_private: bool = False
    dir: str | None = None  # default {out_dir}/export

    def __post_init__(self) -> None:
        if self.hf_dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"export.hf_dtype={self.hf_dtype!r}: use bf16, fp16 or fp32")
        if self.mlx_quantize not in (None, 4, 8):
            raise ValueError(f"export.mlx_quantize={self.mlx_quantize!r}: use 4 or 8 (bits), or unset for bf16")
        if self.mlx_group_size not in (32, 64, 128):
            raise ValueError(f"export.mlx_group_size={self.mlx_group_size!r}: use 32, 64 or 128")
        if self.push_repo and not self.hf:
            raise ValueError(f"export.push_repo={self.push_repo!r} pushes the HF export: add export.hf=true")
        if self.push_mlx_repo and not self.mlx:
            raise ValueError(f"export.push_mlx_repo={self.push_mlx_repo!r} pushes the MLX export: add export.mlx=true")


@dataclass
class RunConfig:
    recipe: str = ""
    out_dir: str = "runs/{recipe}"
    resume: bool = False
    dry_run: bool = False
    devices: str = ""  # dry run: the GPUs to plan memory for, COUNTxGiB (e.g. 8x80); default: this machine's
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    @property
    def gamma(self) -> float:
        """The decay's gamma (``train.gamma``, else the paper's value for the block size)."""
        if self.train.gamma is not None:
            return float(self.train.gamma)
        if self.drafter.block_size not in GAMMA_BY_BLOCK:
            raise ValueError(f"train.gamma is not set and block size {self.drafter.block_size} has no paper value "
                             f"(known: {GAMMA_BY_BLOCK}); set train.gamma explicitly")
        return GAMMA_BY_BLOCK[self.drafter.block_size]

    def loss_weighting(self) -> dict[str, Any]:
        """The weighting keywords of ``train.objective.block_loss`` for this run (D-PACE's unset keys resolved)."""
        t = self.train
        if t.loss_weighting == "dpace":
            alpha = DPACE_ALPHA if t.dpace_alpha is None else float(t.dpace_alpha)
            return {"gamma": None, "weighting": "dpace", "dpace_alpha": alpha,
                    "normaliser": t.dpace_normaliser or "weights"}
        return {"gamma": self.gamma, "weighting": "decay", "normaliser": "weights"}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def validate(self) -> None:
        from models.support import DTYPE_NAMES
        from models.flex_options import parse_flex_backward  # start-up time: `train.distill --help` imports no torch

        quant = parse_quantization(self.target.quantization)  # a bad value fails here, before anything loads
        if (self.target.path or "").startswith("tiny:"):  # tiny:<typo> failed after out_dir/config.yaml was written
            from train.tiny import parse_tiny  # start-up time: only a tiny target's config imports transformers

            parse_tiny(self.target.path)
        parse_flex_backward(self.train.flex_backward)  # a typo would fail only at the first CUDA step
        # the short names train.mixed_precision and the CLIs take mean the same here (once an AttributeError)
        self.target.dtype = DTYPE_NAMES.get(self.target.dtype, self.target.dtype)
        self.train.compile = compile_setting(self.train.compile)  # a recipe's `compile: false` arrives as "no"
        choices = {"target.dtype": ("auto", "float32", "bfloat16", "float16"),
                   "features.mode": ("online", "offline"), "train.loss": ("ce", "kl", "ce+kl"),
                   "train.attention": ("auto", "flex", "dense"), "train.schedule": ("cosine", "constant"),
                   "train.mixed_precision": ("auto", "bf16", "fp16", "no"), "drafter.variant": ("dflash", "dflash2"),
                   "train.loss_weighting": ("decay", "dpace"), "train.compile": ("auto", "true", "false")}
        for key, allowed in choices.items():
            section, name = key.split(".")
            value = getattr(getattr(self, section), name)
            if value not in allowed:
                raise ValueError(f"{key}={value!r}: use one of {allowed}")
        # wandb's modes (shared, and the older dryrun / run, too): a typo failed only at wandb.init, once loaded
        if self.logging.wandb_mode not in (None, "online", "offline", "disabled", "shared", "dryrun", "run"):
            raise ValueError(f"logging.wandb_mode={self.logging.wandb_mode!r}: use online, offline or disabled (or "
                             "leave it unset for wandb's default)")
        if self.features.mode == "offline" and not self.features.store:
            raise ValueError("features.mode=offline needs features.store=DIR (written by `python -m data.extract`)")
        if self.features.dtype != "bf16":  # fp8 was accepted and ignored: no training run extracts features
            raise ValueError(f"features.dtype={self.features.dtype} changes nothing: training never extracts, it reads "
                             "a store in the dtype it was extracted in. Drop it, and pass --dtype "
                             f"{self.features.dtype} to python -m data.extract instead")
        if self.features.mode == "offline" and quant.kind in ("bnb", "fp8"):
            # A store holds the features of the weights data.extract ran, which it loads unquantized; these
            # quantizations exist only inside transformers' loader, so the store's fingerprint cannot tell.
            raise ValueError(f"target.quantization={self.target.quantization} with features.mode=offline: the store's "
                             "features come from data.extract, which runs the unquantized weights, so the drafter "
                             "would not learn the quantized target. Use features.mode=online, or an MLX-quantized "
                             "target (target.quantization=mlx:DIR, extracted with data.extract --target DIR)")
        if not self.train.epochs > 0:  # 0 or less once trained one step silently
            raise ValueError(f"train.epochs={self.train.epochs}: give a positive number of passes over the data "
                             "(fractions allowed), or train.max_steps=N")
        if self.train.max_steps is not None and self.train.max_steps < 1:
            raise ValueError(f"train.max_steps={self.train.max_steps} must be >= 1 (or unset: train.epochs decides)")
        self._check_drafter()  # every drafter shape key at once, before the weighting asks for a gamma of its block
        for key in ("train.batch_size", "train.grad_accum", "train.anchors", "train.ce_chunk"):
            section, name = key.split(".")
            if getattr(getattr(self, section), name) < 1:
                raise ValueError(f"{key} must be >= 1")
        # Values that train to NaN or to nothing, without an error, if let through
        numbers = {"train.gamma": (self.train.gamma, self.train.gamma is None or self.train.gamma > 0, "> 0 (the loss "
                                   "weight exp(-(k-1)/gamma) divides by it; unset = the paper's value)"),
                   "train.lr": (self.train.lr, self.train.lr > 0, "> 0"),
                   "train.min_lr_ratio": (self.train.min_lr_ratio, 0 <= self.train.min_lr_ratio <= 1, "in [0, 1]"),
                   "train.warmup_ratio": (self.train.warmup_ratio, 0 <= self.train.warmup_ratio < 1, "in [0, 1)"),
                   "train.clip": (self.train.clip, self.train.clip >= 0, ">= 0 (0 = no clipping)"),
                   "train.weight_decay": (self.train.weight_decay, self.train.weight_decay >= 0, ">= 0"),
                   "train.kl_weight": (self.train.kl_weight, self.train.kl_weight >= 0, ">= 0"),
                   "train.kl_topk": (self.train.kl_topk, self.train.kl_topk >= 1, ">= 1")}
        for key, (value, ok, rule) in numbers.items():
            if not ok:
                raise ValueError(f"{key}={value} must be {rule}")
        if len(self.train.betas) != 2 or not all(0 <= b < 1 for b in self.train.betas):
            raise ValueError(f"train.betas={self.train.betas} must be two numbers in [0, 1), e.g. [0.9,0.95]")
        self._check_counts()
        self._check_weighting()
        self._check_selector()
        if self.export.dir and (self.export.hf or self.export.mlx):
            run, out = self.resolved_out_dir().absolute(), Path(self.export.dir).absolute()
            for part in (run / "final", run / "checkpoints"):  # replaced whole by this run's later saves
                if out == part or part in out.parents:
                    raise ValueError(f"export.dir={self.export.dir} is inside {part}, which training replaces "
                                     f"whole: the exports would be lost. Unset it ({run / 'export'}) or give a "
                                     "folder outside final/ and checkpoints/")

    def _check_weighting(self) -> None:
        """Each weighting's own keys, and only those (a key of the other one would be ignored without a word); D-PACE's
        unset keys are resolved here, so the saved config (checkpoints, provenance) says what the run used."""
        t = self.train
        if t.loss_weighting == "decay":
            _ = self.gamma  # a block size without a paper gamma fails here
            given = [f"train.{k}={getattr(t, k)}" for k in ("dpace_alpha", "dpace_normaliser")
                     if getattr(t, k) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} set with train.loss_weighting=decay, which ignores it: add "
                                 "train.loss_weighting=dpace, or drop the dpace_* key(s)")
            return
        if t.gamma is not None:
            raise ValueError(f"train.gamma={t.gamma} is the decay weighting's constant and does nothing with "
                             "train.loss_weighting=dpace: unset it with train.gamma=null (a recipe may set it), or use "
                             "train.loss_weighting=decay")
        if t.dpace_alpha is not None and not 0 <= t.dpace_alpha <= 1:
            raise ValueError(f"train.dpace_alpha={t.dpace_alpha} must be in [0, 1] (D-PACE's smoothing q~ = "
                             f"(1 - alpha) q + alpha; unset = {DPACE_ALPHA})")
        if t.dpace_normaliser not in (None, "weights", "tokens", "rows"):
            raise ValueError(f"train.dpace_normaliser={t.dpace_normaliser!r}: use weights (the default), tokens "
                             "or rows")
        t.dpace_alpha = DPACE_ALPHA if t.dpace_alpha is None else float(t.dpace_alpha)
        t.dpace_normaliser = t.dpace_normaliser or "weights"

    def _check_selector(self) -> None:
        """``train.selector_loss_alpha``: DFlash2's alone, resolved (1.0 when unset) so the saved config, which a
        resume compares, says what the run used."""
        alpha = self.train.selector_loss_alpha
        if self.drafter.variant != "dflash2":
            if alpha is not None:
                raise ValueError(f"train.selector_loss_alpha={alpha} weighs DFlash2's selector loss and this run "
                                 f"trains a {self.drafter.variant} drafter, which has no selector: add "
                                 "drafter.variant=dflash2, or drop train.selector_loss_alpha")
            return
        if isinstance(alpha, bool) or (alpha is not None and not (math.isfinite(alpha) and alpha >= 0)):
            raise ValueError(f"train.selector_loss_alpha={alpha} must be a number >= 0 (0: the selector is not "
                             f"trained; unset = {SELECTOR_LOSS_ALPHA})")
        self.train.selector_loss_alpha = SELECTOR_LOSS_ALPHA if alpha is None else float(alpha)

    def _check_counts(self) -> None:
        """Counts and sizes that otherwise fail late (after the target and data loaded, or after training in
        the final eval), fail far from their key, or are silently replaced by a default."""
        if not math.isfinite(self.train.epochs):
            raise ValueError(f"train.epochs={self.train.epochs}: give a finite number of passes over the data")
        if not 0 <= self.train.seed < 2**32:
            raise ValueError(f"train.seed={self.train.seed} must be in [0, 2**32)")
        rules = {  # key: (value, minimum); None = unset (a default applies)
            "logging.every": (self.logging.every, 1), "eval.every": (self.eval.every, 0),
            "eval.batches": (self.eval.batches, 1), "eval.true_tau_every": (self.eval.true_tau_every, 0),
            "eval.true_tau_prompts": (self.eval.true_tau_prompts, 0),
            "eval.true_tau_max_new_tokens": (self.eval.true_tau_max_new_tokens, 1),
            "checkpoint.every": (self.checkpoint.every, 0), "checkpoint.keep_last": (self.checkpoint.keep_last, 0),
            "data.max_length": (self.data.max_length, 1), "data.eval_rows": (self.data.eval_rows, 0),
            "data.limit": (self.data.limit, 1), "data.regenerate_max_tokens": (self.data.regenerate_max_tokens, 1),
            "data.regenerate_batch_size": (self.data.regenerate_batch_size, 1),
            "data.tiny_conversations": (self.data.tiny_conversations, 1)}
        for key, (value, least) in rules.items():
            if value is not None and value < least:
                raise ValueError(f"{key}={value} must be >= {least}")

    def _check_drafter(self) -> None:
        """Every drafter shape key that is wrong without the target, named together in one error: one at a time
        (block size 1 first asked for train.gamma, then loaded the target, then said a block needs 2 slots) cost
        a run per mistake. What needs the target's shape (taps past its layers) is checked before it loads, by
        ``train.setup.check_inputs``."""
        d, problems = self.drafter, []
        least = {"num_hidden_layers": 1, "num_taps": 1, "block_size": 2,
                 # the shape overrides: 0 once meant "the target's" without a word
                 "intermediate_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 2}
        why = {"block_size": " (a block holds the bonus token and at least one mask; default 16)"}
        for name, low in least.items():
            value = getattr(d, name)
            if value is not None and value < low:
                problems.append(f"drafter.{name}={value} must be >= {low}{why.get(name, '')}")
        if d.head_dim is not None and d.head_dim >= 2 and d.head_dim % 2:
            problems.append(f"drafter.head_dim={d.head_dim} must be even (RoPE rotates pairs of dimensions)")
        heads, kv = d.num_attention_heads, d.num_key_value_heads
        if heads and kv and heads >= 1 and kv >= 1 and heads % kv:
            problems.append(f"drafter.num_key_value_heads={kv} must divide drafter.num_attention_heads={heads} "
                            "(grouped-query attention)")
        ids = d.target_layer_ids
        if ids is not None and not ids:
            problems.append("drafter.target_layer_ids=[] taps no layer: list layer ids, or leave it unset for the "
                            "default spread (drafter.num_taps of them)")
        elif ids:
            if any(i < 0 for i in ids):
                problems.append(f"drafter.target_layer_ids={ids}: layer ids count from 0")
            if len(set(ids)) != len(ids):
                problems.append(f"drafter.target_layer_ids={ids} taps a layer twice")
            elif problem := layer_order_problem(ids):
                problems.append(f"drafter.target_layer_ids={list(ids)}: {problem}: {LAYER_ORDER_FIX}")
        if d.mask_token_id is not None and d.mask_token_id < 0:
            problems.append(f"drafter.mask_token_id={d.mask_token_id} must be a row of the embedding (>= 0; unset: "
                            "chosen from the tokenizer)")
        if d.rope_theta is not None and not (math.isfinite(d.rope_theta) and d.rope_theta > 0):
            problems.append(f"drafter.rope_theta={d.rope_theta} must be a positive RoPE base (unset: the target's)")
        if problems:
            raise ValueError("; ".join(problems))

    def resolved_out_dir(self) -> Path:
        name = Path(self.recipe).stem if self.recipe else "run"
        return Path(self.out_dir.replace("{recipe}", name))  # other braces are the folder's own characters


# ----------------------------------------------------------------------------- loading
def read_yaml(path: Path, what: str = "") -> Any:
    """A YAML file; one that does not parse is one line (the parser's own message runs over 8), and a run's
    ``config.yaml`` (the run folder's, or a checkpoint's) names an intact copy of the same run's settings."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        copy = intact_run_config(Path(path))
        fix = f"; restore it from {copy}" if copy else ""
        raise ValueError(f"{what}{path} is not valid YAML{line}: {getattr(e, 'problem', None) or e}{fix}") from None


def intact_run_config(path: Path) -> Path | None:
    """For a run's ``config.yaml`` (``out_dir/config.yaml``, ``final/`` or ``checkpoints/step_N/``'s): another copy
    of the run's settings that parses, the newest checkpoint's first; None for any other file."""
    if path.name != "config.yaml":
        return None
    folder = path.parent
    if folder.name == "final" or (STEP_DIR.match(folder.name) and folder.parent.name == "checkpoints"):
        root = folder.parent if folder.name == "final" else folder.parent.parent
    elif (folder / "checkpoints").is_dir() or (folder / "final").is_dir():
        root = folder
    else:
        return None
    for copy in [d / "config.yaml" for d in reversed(checkpoint_dirs(root))] + [root / "final" / "config.yaml",
                                                                                  root / "config.yaml"]:
        if copy.is_file() and copy.resolve() != path.resolve():
            try:
                if isinstance(yaml.safe_load(copy.read_text()), dict):
                    return copy
            except (OSError, yaml.YAMLError):
                continue
    return None


def valid_keys() -> list[str]:
    """Every dotted key of the training config (sections and leaves)."""
    return keys_of(RunConfig)


def load_config(argv: list[str] | None = None, *, recipe: str | None = None,
                overrides: dict[str, Any] | None = None) -> RunConfig:
    """Recipe YAML, then overrides (command line pairs, then the ``overrides`` dict), validated."""
    argv = list(argv or [])
    arg_recipe, pairs = parse_args(argv)
    recipe = arg_recipe or recipe
    tree: dict[str, Any] = {}
    if recipe:
        path = recipe_path(recipe)
        raw = read_yaml(path, "recipe ") or {}
        if not isinstance(raw, dict):
            raise ValueError(f"recipe {recipe} must be a YAML mapping")
        tree = raw
        for k in flatten(raw, RunConfig):
            check_key(k, RunConfig)
    for k, v in pairs:
        check_key(k, RunConfig)
        set_dotted(tree, k, parse_value(v, leaf_type(k, RunConfig), k))
    for k, v in (overrides or {}).items():
        check_key(k, RunConfig)
        set_dotted(tree, k, v)
    tree["recipe"] = recipe or tree.get("recipe", "")
    cfg = build(RunConfig, tree, RunConfig)
    cfg.validate()
    return cfg
