"""Reading a recipe and ``key=value`` overrides into a tree of config dataclasses.

The machinery behind ``train.config.load_config``, kept apart from the schema it reads into: every
function takes the root dataclass (``root``); only ``ALIASES`` (other trainers' key names) spells our
keys. Recipes are YAML files in the ``recipes`` package (``recipe=NAME``) or any path to one.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import fields
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from models.support import UserError


class ConfigKeyError(UserError, KeyError):
    """An override or recipe key that is not a config field."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return self.args[0]


class ConfigValueError(UserError, TypeError):
    """A config value of the wrong type (``train.lr=fast``); a TypeError for callers that catch one."""


class _MalformedValue(ConfigValueError):
    """A value no type of a union could read as written (``1,,17``): its own message, not the union's."""


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def valid_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree (sections and leaves)."""
    keys = []
    hints = _hints(cls)
    for f in fields(cls):
        key = prefix + f.name
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(valid_keys(hints[f.name], key + "."))
    return keys


# What people type from other trainers' configs (HF TrainingArguments, torchtune, axolotl...) -> our key.
# Spelling distance alone gets these wrong: `learning_rate` is closest to `warmup_ratio`. A tuple
# lists the key in each section where the word means something (`data.path` -> `data.source`).
ALIASES: dict[str, str | tuple[str, ...]] = {
    "learning_rate": "train.lr", "lr": "train.lr", "max_lr": "train.lr",
    "path": ("target.path", "data.source", "features.store"), "model": "target.path", "model_path": "target.path",
    "model_name_or_path": "target.path",
    "target": "target.path", "target_model": "target.path",
    "dataset": "data.source", "data": "data.source", "dataset_path": "data.source", "data_path": "data.source",
    "train_file": "data.source", "source": "data.source",
    "num_epochs": "train.epochs", "num_train_epochs": "train.epochs", "epoch": "train.epochs",
    "steps": "train.max_steps", "num_steps": "train.max_steps", "total_steps": "train.max_steps",
    "batch": "train.batch_size", "bs": "train.batch_size", "micro_batch_size": "train.batch_size",
    "per_device_train_batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum", "grad_accumulation": "train.grad_accum",
    "warmup": "train.warmup_ratio", "warmup_steps": "train.warmup_ratio",
    "max_grad_norm": "train.clip", "grad_clip": "train.clip", "clip_grad_norm": "train.clip",
    "gradient_checkpointing": "train.grad_checkpointing", "lr_scheduler_type": "train.schedule",
    "block": "drafter.block_size", "block_len": "drafter.block_size", "num_layers": "drafter.num_hidden_layers",
    "layers": "drafter.num_hidden_layers", "layer_ids": "drafter.target_layer_ids", "mask_id": "drafter.mask_token_id",
    "mask_token": "drafter.mask_token_id", "max_seq_length": "data.max_length", "max_seq_len": "data.max_length",
    "seq_len": "data.max_length", "sequence_len": "data.max_length", "output_dir": "out_dir", "output": "out_dir",
    "wandb_project": "logging.wandb_project", "project": "logging.wandb_project", "logging_steps": "logging.every",
    "save_steps": "checkpoint.every", "eval_steps": "eval.every", "resume_from_checkpoint": "resume",
}


def unknown_key(key: str, root) -> ConfigKeyError:
    """The error for a key that is not in ``root``'s tree: the closest valid key and the section's keys."""
    keys = valid_keys(root)
    sections = {f.name for f in fields(root) if dataclasses.is_dataclass(_hints(root)[f.name])}
    section, _, tail = key.rpartition(".")
    alias = ALIASES.get(tail.lower().replace("-", "_"), ())
    alias = (alias,) if isinstance(alias, str) else alias
    if alias:  # the alias in the section the user named, else its usual home
        close = [next((a for a in alias if a.startswith(section + ".")), alias[0])] if section else [alias[0]]
    elif section in sections:  # right section, wrong name: compare names inside the section
        names = [k.split(".", 1)[1] for k in keys if k.startswith(section + ".")]
        close = [f"{section}.{n}" for n in difflib.get_close_matches(tail, names, n=1, cutoff=0.0)]
    else:  # wrong or missing section: a leaf with a close name, else the closest full key
        leaves = [k for k in keys if k not in sections]
        by_name = difflib.get_close_matches(tail, [k.rsplit(".", 1)[-1] for k in leaves], n=1, cutoff=0.6)
        close = [k for k in leaves if k.rsplit(".", 1)[-1] == by_name[0]][:1] if by_name else \
            difflib.get_close_matches(key, leaves, n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    home = section if section in sections else (close[0].split(".")[0] if close and "." in close[0] else "")
    if home:
        listed = f"{home}. keys: " + ", ".join(k.split(".", 1)[1] for k in keys if k.startswith(home + "."))
    else:
        listed = "top-level keys: " + ", ".join(k for k in keys if "." not in k)
    return ConfigKeyError(f"unknown config key {key!r}{hint} ({listed}; `--help` lists every key)")


def _kind(tp: Any) -> str:
    """A type as the value a user writes (``bool | None``: "true or false or null")."""
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(tp, "a list" if typing.get_origin(tp) is list else getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, key: str, root) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, root)
            except _MalformedValue:
                raise
            except (TypeError, ValueError):
                pass  # try the union's next type; none fits -> one error naming the whole union
        raise ConfigValueError(f"{key}={value!r}: expected {' or '.join(_kind(a) for a in args)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigValueError(f"{key} is a section: give keys under it (e.g. {key}.{fields(tp)[0].name}=...)")
        return build(tp, value, root, key + ".")
    if value is None:  # `out_dir=$UNSET` or `out_dir:` in a recipe: str(None) once made a folder named "None"
        raise ConfigValueError(f"{key} is empty (an unset shell variable?): give {_kind(tp)}, or leave the key out")
    if origin is list:
        if isinstance(value, str):
            if value.strip().startswith("["):
                value = yaml.safe_load(value)
            else:
                items = value.split(",") if value.strip() else []
                if any(not v.strip() for v in items):  # "1,,2": a value left out, not a list of two
                    raise _MalformedValue(f"{key}={value!r}: an empty item in the list; give the values "
                                           "separated by single commas (e.g. 1,9,17)")
                value = [v.strip() for v in items]
        if not isinstance(value, (list, tuple)):
            raise ConfigValueError(f"{key}={value!r}: expected a list")
        return [_coerce(v, args[0], key, root) for v in value] if args else list(value)
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


def build(cls, values: dict[str, Any], root, prefix: str = ""):
    """``cls`` from a nested dict, every value coerced to its field's type; unknown keys refused."""
    hints = _hints(cls)
    names = {f.name for f in fields(cls)}
    for k in values:
        if k not in names:
            raise unknown_key(prefix + k, root)
    kwargs = {k: _coerce(v, hints[k], prefix + k, root) for k, v in values.items()}
    return cls(**kwargs)


def set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, p in enumerate(parts[:-1]):
        child = node.get(p)
        if child is not None and not isinstance(child, dict):
            # a recipe's ``train: 3`` would otherwise be replaced, unseen, by the overrides' section
            section = ".".join(parts[:i + 1])
            raise ConfigValueError(f"{section} is a section, but it was given the value {child!r}: "
                                   f"give keys under it (e.g. {key}=...)")
        if child is None:
            child = {}
            node[p] = child
        node = child
    node[parts[-1]] = value


def check_key(key: str, root) -> None:
    if key not in valid_keys(root):
        raise unknown_key(key, root)


def recipes_dir() -> Path:
    """The shipped recipes: the ``recipes`` package's folder (a checkout, an editable or a plain install)."""
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
            if recipe is not None and v != recipe:  # the last one silently won
                raise ValueError(f"recipe given twice (recipe={recipe} and recipe={v}): keep one, and set "
                                 "single keys on top of it (e.g. recipe=tiny train.lr=3e-4)")
            recipe = v
        else:
            pairs.append((k, v))
    return recipe, pairs


def leaf_type(key: str, root) -> Any:
    """The declared type of a dotted leaf key (``train.lr`` -> float)."""
    cls, parts = root, key.split(".")
    for part in parts[:-1]:
        cls = _hints(cls)[part]
    return _hints(cls)[parts[-1]]


def parse_value(text: str, tp: Any = None, key: str = "value") -> Any:
    """A command-line value as YAML (numbers, booleans, [lists]); a mapping only when written as
    ``{...}``, so ``target.quantization=mlx:`` stays the text the user typed, not ``{'mlx': None}``.

    A string key (``tp`` str or ``str | None``) keeps the text as typed: YAML 1.1 would turn
    ``out_dir=0123`` into 83, ``out_dir=12:30`` into 750 and ``data.subset=off`` into False."""
    if text == "":
        return None
    if tp is str:
        return text
    if tp == (str | None) or tp == typing.Optional[str]:
        return None if text in ("null", "~", "None") else text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigValueError(f"{key}={text!r} is not a value ({problem}): write numbers as 3e-4, lists as "
                               "[1,2,3], booleans as true / false") from None
    return text if isinstance(value, dict) and not text.lstrip().startswith("{") else value


def flatten(tree: dict, root, prefix: str = "") -> list[str]:
    """Dotted leaf keys of a recipe tree (a mapping under a section name is that section's keys)."""
    out = []
    for k, v in tree.items():
        key = prefix + str(k)
        if isinstance(v, dict) and key in {f.name for f in fields(root)}:
            out.extend(flatten(v, root, key + "."))
        else:
            out.append(key)
    return out
