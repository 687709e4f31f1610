"""Training config: typed dataclasses, a YAML recipe, dotted ``key=value`` overrides.

``load_config(["recipe=qwen35-9b", "train.lr=3e-4", "--dry-run"])`` reads ``recipes/qwen35-9b.yaml``
(or a path to any YAML file), applies the overrides in order and returns a ``RunConfig``. Every
key is checked against the dataclasses: an unknown key is an error naming it and the closest
valid key. Values are parsed as YAML (``3e-4`` -> float, ``true`` -> bool, ``[1,2]`` -> list).

Drafter config keys are *not* spelled here: ``drafter.*`` holds only the training-time choices
(layer count, taps, block size, optional shape overrides) that ``models.config.DFlashConfig``
turns into the canonical drafter config.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from models.cli import UserError

GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}  # DESIGN.md section 2 (paper values)


class ConfigKeyError(UserError, KeyError):
    """An override or recipe key that is not a config field."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return self.args[0]


class ConfigValueError(UserError, TypeError):
    """A config value of the wrong type (``train.lr=fast``); a TypeError for callers that catch one."""


@dataclass
class TargetConfig:
    # Local folder or Hub id. "tiny:<arch>" builds a tiny seeded target locally (arch: qwen3, llama, ...).
    path: str = ""
    revision: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
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
    params_b: float | None = None  # total parameters, billions
    active_params_b: float | None = None  # per-token parameters for MoE targets (FLOPs), billions


@dataclass
class DataConfig:
    # Conversations: a JSONL/Parquet file, a datasets folder, a Hub data set id, or "tiny" (data/tiny_chat.py).
    source: str = ""
    split: str = "train"
    subset: str | None = None
    limit: int | None = None  # conversations to read (None = all)
    # Where the prepared (tokenized, loss-masked) data set goes; default {out_dir}/data.
    prepared: str | None = None
    regenerate: str = "none"  # none | local (in-process with the target) | http://host:port/v1 (OpenAI-compatible)
    regenerate_max_tokens: int = 1024
    thinking: bool | None = None  # the chat template's thinking switch: set it to how the target is served
    max_length: int = 3072
    pack: bool = False
    eval_rows: int = 64  # held out from the end of the prepared set
    tiny_conversations: int = 256  # data.source=tiny only


@dataclass
class FeaturesConfig:
    mode: str = "online"  # online: target runs in the step | offline: read a store from `python -m data.extract`
    store: str | None = None  # offline store folder
    dtype: str = "bf16"  # offline store dtype (bf16 | fp8), used when this run extracts


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
    mask_token_id: int | None = None  # None = first embedding row the tokenizer never emits
    init_from: str | None = None  # start from an existing drafter folder


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
    gamma: float | None = None  # loss decay; None = 7 / 5 / 4 for block 16 / 10 / 8
    loss: str = "ce"  # ce | kl | ce+kl
    kl_weight: float = 1.0
    kl_topk: int = 32  # online KL: top-k of the target distribution kept per position
    ce_chunk: int = 2048  # block slots per LM-head chunk (logits: chunk x vocab fp32)
    attention: str = "auto"  # auto (flex on CUDA, dense on CPU) | flex | dense
    grad_checkpointing: bool = False
    mixed_precision: str = "auto"  # auto (bf16 on CUDA, no on CPU) | bf16 | fp16 | no
    seed: int = 0


@dataclass
class EvalConfig:
    every: int = 500  # steps (0 = only at the end)
    at_start: bool = True  # also evaluate the untrained drafter (step 0): the baseline tau
    batches: int = 8  # held-out batches for the simulated tau
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
    keep_last: int = 3


@dataclass
class RunConfig:
    recipe: str = ""
    out_dir: str = "runs/{recipe}"
    resume: bool = False
    dry_run: bool = False
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def gamma(self) -> float:
        if self.train.gamma is not None:
            return float(self.train.gamma)
        if self.drafter.block_size not in GAMMA_BY_BLOCK:
            raise ValueError(f"train.gamma is not set and block size {self.drafter.block_size} has no paper value "
                             f"(known: {GAMMA_BY_BLOCK}); set train.gamma explicitly")
        return GAMMA_BY_BLOCK[self.drafter.block_size]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def validate(self) -> None:
        choices = {"features.mode": ("online", "offline"), "train.loss": ("ce", "kl", "ce+kl"),
                   "train.attention": ("auto", "flex", "dense"), "train.schedule": ("cosine", "constant"),
                   "train.mixed_precision": ("auto", "bf16", "fp16", "no")}
        for key, allowed in choices.items():
            section, name = key.split(".")
            value = getattr(getattr(self, section), name)
            if value not in allowed:
                raise ValueError(f"{key}={value!r}: use one of {allowed}")
        if self.features.mode == "offline" and not self.features.store:
            raise ValueError("features.mode=offline needs features.store=DIR (written by `python -m data.extract`)")
        if self.train.loss != "ce" and self.features.mode == "offline":
            pass  # the offline store must then carry top-k log-probs; checked when the store is opened
        for key in ("train.batch_size", "train.grad_accum", "train.anchors", "drafter.block_size", "train.ce_chunk"):
            section, name = key.split(".")
            if getattr(getattr(self, section), name) < 1:
                raise ValueError(f"{key} must be >= 1")
        _ = self.gamma

    def resolved_out_dir(self) -> Path:
        name = Path(self.recipe).stem if self.recipe else "run"
        return Path(self.out_dir.format(recipe=name))


# ----------------------------------------------------------------------------- key handling
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def valid_keys(cls=RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree (sections and leaves)."""
    keys = []
    hints = _hints(cls)
    for f in fields(cls):
        key = prefix + f.name
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(valid_keys(hints[f.name], key + "."))
    return keys


def _unknown(key: str) -> ConfigKeyError:
    keys = valid_keys()
    sections = {f.name for f in fields(RunConfig) if dataclasses.is_dataclass(_hints(RunConfig)[f.name])}
    section, _, tail = key.rpartition(".")
    if section in sections:  # right section, wrong name: compare names inside the section
        names = [k.split(".", 1)[1] for k in keys if k.startswith(section + ".")]
        close = [f"{section}.{n}" for n in difflib.get_close_matches(tail, names, n=1, cutoff=0.0)]
    else:  # wrong or missing section: a leaf with a close name, else the closest full key
        leaves = [k for k in keys if k not in sections]
        by_name = difflib.get_close_matches(tail, [k.rsplit(".", 1)[-1] for k in leaves], n=1, cutoff=0.6)
        close = [k for k in leaves if k.rsplit(".", 1)[-1] == by_name[0]][:1] if by_name else \
            difflib.get_close_matches(key, leaves, n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigKeyError(f"unknown config key {key!r}{hint}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise ConfigValueError(f"{key}={value!r}: expected {tp}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigValueError(f"{key} is a section: give keys under it (e.g. {key}.{fields(tp)[0].name}=...)")
        return _build(tp, value, key + ".")
    if origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigValueError(f"{key}={value!r}: expected a list")
        return [_coerce(v, args[0], key) for v in value] if args else list(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigValueError(f"{key}={value!r}: expected true or false")
    if tp in (int, float) and isinstance(value, str):
        try:  # PyYAML reads 6e-4 (no dot) as a string
            value = float(value)
        except ValueError:
            raise ConfigValueError(f"{key}={value!r}: expected a number") from None
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigValueError(f"{key}={value!r}: expected an integer")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigValueError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if isinstance(value, bool):  # YAML 1.1 reads no/off/false as False: `train.mixed_precision=no` means "no"
            return "yes" if value else "no"
        if isinstance(value, (dict, list)):
            raise ConfigValueError(f"{key}={value!r}: expected a string")
        return str(value)
    return value


def _build(cls, values: dict[str, Any], prefix: str = ""):
    hints = _hints(cls)
    names = {f.name for f in fields(cls)}
    for k in values:
        if k not in names:
            raise _unknown(prefix + k)
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in values.items()}
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[parts[-1]] = value


def _check_key(key: str) -> None:
    if key not in valid_keys():
        raise _unknown(key)


def recipes_dir() -> Path:
    """The shipped recipes: the ``recipes`` package's folder (a checkout, an editable or a plain install)."""
    from importlib.resources import files

    return Path(str(files("recipes")))


def recipe_names() -> list[str]:
    """Names ``recipe=NAME`` accepts, sorted."""
    return sorted(x.stem for x in recipes_dir().glob("*.yaml"))


def recipe_path(recipe: str) -> Path:
    """``tiny`` -> the shipped ``recipes/tiny.yaml``; a path to a YAML file is used as is."""
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise FileNotFoundError(f"recipe file {p} not found")
        return p
    candidate = recipes_dir() / f"{recipe}.yaml"
    if not candidate.is_file():
        names = recipe_names()
        close = difflib.get_close_matches(recipe, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise FileNotFoundError(f"unknown recipe {recipe!r} (recipes: {names}){hint}")
    return candidate


def parse_args(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """``recipe=NAME`` plus ``key=value`` pairs; ``--dry-run`` / ``--resume`` are flag spellings."""
    recipe, pairs = None, []
    for arg in argv:
        if arg in ("--dry-run", "--dry_run"):
            pairs.append(("dry_run", "true"))
            continue
        if arg == "--resume":
            pairs.append(("resume", "true"))
            continue
        a = arg[2:] if arg.startswith("--") else arg
        if "=" not in a:
            raise ValueError(f"argument {arg!r} is not key=value (e.g. recipe=tiny train.lr=3e-4)")
        k, v = a.split("=", 1)
        k = k.replace("-", "_") if k in ("dry-run",) else k
        if k == "recipe":
            recipe = v
        else:
            pairs.append((k, v))
    return recipe, pairs


def load_config(argv: list[str] | None = None, *, recipe: str | None = None,
                overrides: dict[str, Any] | None = None) -> RunConfig:
    """Recipe YAML, then overrides (command line pairs, then the ``overrides`` dict), validated."""
    argv = list(argv or [])
    arg_recipe, pairs = parse_args(argv)
    recipe = arg_recipe or recipe
    tree: dict[str, Any] = {}
    if recipe:
        raw = yaml.safe_load(recipe_path(recipe).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"recipe {recipe} must be a YAML mapping")
        tree = raw
        for k in _flatten(raw):
            _check_key(k)
    for k, v in pairs:
        _check_key(k)
        _set_dotted(tree, k, yaml.safe_load(v) if v != "" else None)
    for k, v in (overrides or {}).items():
        _check_key(k)
        _set_dotted(tree, k, v)
    tree["recipe"] = recipe or tree.get("recipe", "")
    cfg = _build(RunConfig, tree)
    cfg.validate()
    return cfg


def _flatten(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        key = prefix + str(k)
        if isinstance(v, dict) and key in {f.name for f in fields(RunConfig)}:
            out.extend(_flatten(v, key + "."))
        else:
            out.append(key)
    return out


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Rebuild a saved (resolved) config."""
    return _build(RunConfig, d)
