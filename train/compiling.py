"""``train.compile``: whether a run compiles its layers, what the compilation cost, and the way back to eager.

``auto`` (the default) compiles on CUDA and nowhere else: there the compiled drafter and target layers
took the recipe's step from 0.355 to 0.516 of an H200's peak (docs/performance.md), while on a CPU or MPS
inductor's code is slower to build than the steps it would speed up. ``true`` asks for it (and is refused
off CUDA), ``false`` keeps the eager layers (the same math).

Compilation is lazy: it happens in the first call of each compiled layer (the step-0 eval or the first
training step), and a compiler that fails there (a torch / Triton / driver combination inductor cannot
build for) would end the run. :class:`Compiled` runs those calls: on a torch._dynamo / inductor failure it
puts the eager layers back, says so in one warning, and runs the same call again, so the run goes on with
the eager run's numbers (no optimizer step has been taken inside a failed call: it fails in a forward or
a backward). The one-time compile time is printed after the first training step.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch
from torch._dynamo.exc import TorchDynamoException
from torch._inductor import exc as inductor_exc

from train.config import compile_setting

_ABSENT = object()  # an attribute a module did not have before its layers were compiled


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failing torch.compile raises: dynamo wraps the backend's failures (inductor's ``InductorError`` is
    one of them); a backward graph, compiled lazily at the first backward, may raise inductor's own errors."""
    return (TorchDynamoException, *(getattr(inductor_exc, n) for n in ("LoweringException", "CppCompileError",
                                                                     "CUDACompileError") if hasattr(inductor_exc, n)))


def compile_wanted(setting: str, device_type: str) -> bool:
    """Whether a run on ``device_type`` compiles (``train.compile``; ``true`` off CUDA is refused)."""
    setting = compile_setting(setting)
    if setting == "true" and device_type != "cuda":
        raise ValueError("train.compile=true compiles the drafter's (and online, the target's) layers for CUDA "
                         f"kernels; this run is on {device_type}: drop train.compile (auto compiles on CUDA only; "
                         "the eager layers are the same math)")
    return setting == "true" or (setting == "auto" and device_type == "cuda")


def compile_seconds() -> float | None:
    """Seconds this process has spent in torch.compile so far (dynamo's own count: tracing, inductor, the lazily
    compiled backward graphs); None where this torch does not keep it."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # a private API: another torch may lack it or spell it otherwise
        return None


class Compiled:
    """The compiled layers of a run: ``call`` runs what may compile them, with the fall-back to eager."""

    def __init__(self, modules: list[torch.nn.Module], what: str, device: torch.device):
        # what compile_layers replaces: each module's own ``forward`` attribute (accelerate's device hook, when a
        # spread target has one) and nn.Module.compile's wrapper
        self._saved = [(m, {name: m.__dict__.get(name, _ABSENT) for name in ("forward", "_compiled_call_impl")})
                       for m in modules]
        self.what, self.device = what, device
        self.active = True
        self.fell_back: str | None = None  # the error that sent the run back to eager
        self.first_step_s: float | None = None
        self._compile_at_start = compile_seconds()

    def call(self, fn: Callable[[], object], optimizer=None):
        """``fn()``; if compiling fails inside it, the eager layers back (one warning) and ``fn()`` again.
        ``optimizer``: its gradients are cleared before the second try (a failed backward may have left some)."""
        if not self.active:
            return fn()
        try:
            return fn()
        except compile_errors() as e:
            self.eager_again(e)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            return fn()

    def step(self, fn: Callable[[], object], optimizer, log: Callable[[str], None]):
        """One training step through ``call``; the first one is timed, and the compile time printed after it."""
        if self.first_step_s is not None or not self.active:
            return self.call(fn, optimizer)
        sync(self.device)
        t0 = time.perf_counter()
        out = self.call(fn, optimizer)
        sync(self.device)
        self.first_step_s = time.perf_counter() - t0
        if self.active:
            log(self.summary())
        return out

    def compile_s(self) -> float | None:
        """Seconds spent compiling since the layers were wrapped (None: not counted by this torch)."""
        now = compile_seconds()
        return None if now is None or self._compile_at_start is None else now - self._compile_at_start

    def summary(self) -> str:
        spent = self.compile_s()
        what = f"{spent:.1f} s of one-time compilation" if spent is not None else "one-time compilation"
        return (f"train.compile: {self.what} compiled: {what} (everything compiled since the layers were wrapped: "
                f"layers, flex attention, the loss kernel), first step {self.first_step_s:.1f} s; a row length not "
                "seen before recompiles once (dynamic shapes)")

    def eager_again(self, error: BaseException) -> None:
        """Put back the layers' eager forwards, once, with one warning naming the failure."""
        for module, saved in self._saved:
            for name, value in saved.items():
                if value is _ABSENT:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
            if "_layers_compiled" in module.__dict__:
                module._layers_compiled = False
        self.active = False
        said = " ".join(line.strip() for line in str(error).splitlines()[:3] if line.strip())
        self.fell_back = f"{type(error).__name__}: {said}"[:300]  # dynamo's first line names the backend only
        warnings.warn(f"train.compile: compiling the layers failed ({self.fell_back}); running the eager layers "
                      "(the same math, slower): set train.compile=false to skip the attempt", stacklevel=3)


def compile_models(cfg, device_type: str, drafter, target) -> Compiled | None:
    """``train.compile``: the drafter's layers, and with online features the target's too (its tapped forward is
    ~40% of an online step; offline runs never call it). None when the run stays eager."""
    if not compile_wanted(cfg.train.compile, device_type):
        return None
    online = cfg.features.mode == "online"
    modules = _modules(drafter) + (_modules(target) if online else [])
    handle = Compiled(modules, "drafter and target layers" if online else "drafter layers", torch.device(device_type))
    drafter.compile_layers()
    if online:
        target.compile_layers()
    return handle


def _modules(model) -> list:
    """Every module of ``model`` (a TargetModel: of its HF model, and the TargetModel itself for its flag)."""
    inner = getattr(model, "model", None)
    found = list(inner.modules()) if isinstance(inner, torch.nn.Module) else []
    if isinstance(model, torch.nn.Module):
        found += list(model.modules())
    return found + ([model] if not isinstance(model, torch.nn.Module) else [])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
