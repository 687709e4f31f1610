"""The ``target.quantization`` values: what a run asks for, parsed and checked before anything loads.

``parse_quantization`` reads ``none``, ``mlx:PATH_OR_ID`` (an existing MLX folder or Hub repo),
``mlx-3bit`` / ``mlx-4bit`` / ``mlx-8bit`` (quantize the bf16 target here, group size 64 as mlx_lm's
default; ``mlx-4bit-g32`` picks another group size), ``bnb-4bit`` and ``fp8`` (transformers'
bitsandbytes / FP8 loaders, where installed). What the values lead to lives beside: an MLX folder read
in torch (``dequantize.py``), a bf16 target quantized with mlx_lm (``quantize.py``), the transformers
quantizers (``target.transformers_quantization_config``) and the "trained against" line
(``provenance.trained_against``). This module imports no torch: the training config checks a value
with it, and the CLIs that read provenance start fast.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from models.support import UserError

BITS = (2, 3, 4, 5, 6, 8)  # affine widths MLX packs
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64  # mlx_lm.convert's default for affine


class QuantizationError(UserError, ValueError):
    """A quantization value, checkpoint or layer that cannot be used as asked."""


@dataclass(frozen=True)
class QuantSpec:
    kind: str  # none | mlx | bnb | fp8
    bits: int | None = None
    group_size: int | None = None
    path: str | None = None  # mlx:PATH_OR_ID

    def describe(self) -> str:
        """What a checkpoint records as ``trained against``."""
        if self.kind == "none":
            return "none"
        if self.kind == "mlx" and self.path:
            return f"mlx:{self.path}"
        if self.kind == "mlx":
            return f"mlx-{self.bits}bit-g{self.group_size}"
        return {"bnb": "bnb-4bit", "fp8": "fp8"}[self.kind]


_MLX_BITS = re.compile(r"^mlx-(\d+)bit(?:-g(\d+))?$")
VALUES = "none | mlx:PATH_OR_ID | mlx-3bit | mlx-4bit | mlx-8bit (optionally -g32/-g64/-g128) | bnb-4bit | fp8"


def parse_quantization(value: str | None) -> QuantSpec:
    """``target.quantization`` -> ``QuantSpec``; a clear error for anything else."""
    text = "none" if value in (None, "", False) else str(value).strip()
    if text == "none":
        return QuantSpec("none")
    if text.startswith("mlx:"):
        path = text[4:].strip()
        if not path:
            raise QuantizationError("target.quantization=mlx: needs a folder or Hub id after 'mlx:' "
                                    "(e.g. mlx:mlx-community/Qwen3-4B-4bit)")
        return QuantSpec("mlx", path=path)
    m = _MLX_BITS.match(text)
    if m:
        bits, group = int(m.group(1)), int(m.group(2) or DEFAULT_GROUP_SIZE)
        check_bits_group(bits, group, what=f"target.quantization={text}")
        return QuantSpec("mlx", bits=bits, group_size=group)
    if text == "bnb-4bit":
        return QuantSpec("bnb", bits=4)
    if text == "fp8":
        return QuantSpec("fp8", bits=8)
    raise QuantizationError(f"target.quantization={text!r} is not a quantization draftsmith knows: use {VALUES}")


def check_bits_group(bits: int, group_size: int, what: str = "quantization") -> None:
    if bits not in BITS:
        raise QuantizationError(f"{what}: {bits} bits is not an MLX affine width; use one of {list(BITS)}")
    if group_size not in GROUP_SIZES:
        raise QuantizationError(f"{what}: group size {group_size} is not supported; use one of {list(GROUP_SIZES)}")


def is_mlx_quantized(directory: str | Path) -> bool:
    """A folder whose config.json carries MLX affine ``quantization: {bits, group_size}``."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        return False
    q = json.loads(config_path.read_text()).get("quantization")
    return isinstance(q, dict) and "bits" in q and "group_size" in q


def describe_mlx(config: dict) -> str:
    q = config.get("quantization") or {}
    return f"mlx-{q.get('bits')}bit-g{q.get('group_size')}"
