"""The keyword a transformers layer takes its cache by, across transformers versions.

transformers 5.24 renamed a layer's cache argument to ``cache``; earlier versions call it
``past_key_values`` (attention) or ``cache_params`` (a GatedDeltaNet mixer). The target adapter, the
compiled GatedDeltaNet halves and the loops all ask here.
"""

from __future__ import annotations

import inspect

from torch import nn

# The keywords a layer takes its cache by across transformers versions (see ``cache_kwarg``).
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


def passes_cache(kwargs: dict) -> bool:
    """Whether a layer call's keyword arguments hand it a cache (under any of its names)."""
    return any(kwargs.get(name) is not None for name in CACHE_KWARGS)


def cache_kwarg(module: nn.Module, old: str = "past_key_values") -> str:
    """The keyword ``module.forward`` takes its cache by: ``cache`` from transformers 5.24 on (the old
    name, ``past_key_values`` or a GatedDeltaNet mixer's ``cache_params``, still works there with a
    deprecation warning until 5.40), the old name before."""
    # the class's forward: compile_layers swaps an instance's forward for a wrapper of (*args, **kwargs)
    return "cache" if "cache" in inspect.signature(type(module).forward).parameters else old
