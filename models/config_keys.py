"""The names a drafter ``config.json`` is spelled with (architectures, the modeling file, DFlash2's keys, the
layer kinds) and the error every check of a drafter config raises. ``models/config.py`` (the dataclass) and
``models/config_layout.py`` (its published layouts) both build on them."""

from __future__ import annotations

import numbers
from typing import Any

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE2 = "DFlash2DraftModel"  # DFlash2: the v1 backbone + per-layer dynamic convs + a candidate selector
ARCHITECTURES = {"dflash": ARCHITECTURE, "dflash2": ARCHITECTURE2}  # by variant (the recipe's drafter.variant)
MODELING_FILE = "modeling_dflash"  # shipped next to config.json so auto_map resolves
# DFlash2's keys inside dflash_config, with the values of z-lab's published drafters; the reader requires these four.
DFLASH2_KEYS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# Optional DFlash2 keys, written only when they differ from these defaults (softcap None = off).
DFLASH2_OPTIONAL = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}
DFLASH2_WINDOW = 2048  # sliding_window of every published DFlash2 drafter
# DFlash2's selector codebooks: published (and written by us) without ".weight"; z-lab's torch class adds it.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
SLIDING_BLOCK_MODES = ("bidirectional", "causal")
LAYER_TYPES = ("full_attention", "sliding_attention")


class ConfigError(ValueError):
    """A drafter config value is wrong. The message names the field, the value and the fix."""

    def __init__(self, field_name: str, value: Any, problem: str, fix: str):
        self.field = field_name
        self.value = value
        super().__init__(f"{field_name}={value!r}: {problem}. Fix: {fix}")


def whole_number(name: str, value: Any) -> int:
    """``value`` as an int; a fraction (``block_size: 16.5``) is refused, not cut to 16 without a word."""
    number = None
    if not isinstance(value, bool) and isinstance(value, (numbers.Real, str)):  # numpy and torch ints are Real
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None or not number.is_integer():
        raise ConfigError(name, value, "must be a whole number", f"write {name} as an integer")
    return int(number)
