"""A loaded target + drafter on one backend, and the loop that runs them, chosen once when it is built.

What ``generate``, ``validate`` and ``bench`` run: ``Session.run`` generates with the drafter (and, asked,
the baseline), ``Session.baseline`` runs the target alone through the same loop (same dtype, stop rules,
timers and cache treatment). The loop (``--loop auto|eager|static|compiled``, ``choose_loop``):

* ``auto``: on a GPU, the loop ``AUTO_LOOP_ON_CUDA`` names for the target's family: the fastest loop tested
  lossless for it on a GPU, with the measurement that admitted it; elsewhere (and where the static loop
  does not apply) the eager loop (``inference.torch_loop``). An eager batch-1 forward on a GPU is
  launch-bound (an 8B target's decode step took 84 ms eager, 10.8 ms replayed as a graph), so eager
  speedups there measure the host, not the drafter. Hybrid targets (Qwen3.5 / 3.6, GatedDeltaNet) and GLM
  4.x MoE stay eager until their graph replay's speed has been measured on a GPU (``--loop static`` runs
  them, exact on the CPU); Qwen3-Next, latent-attention targets (DeepSeek-V3, Kimi), gpt-oss and Gemma 4 run
  eager (the static loop refuses them), and so do drafters with a YaRN rope block or attention biases (a
  published gpt-oss drafter's: the static drafter pass has plain RoPE and no biases).
* a block size other than the drafter's runs the eager loop, DFlash and the baseline both (the graphs
  are captured for one block shape), with one warning saying so;
* ``static`` / ``compiled`` (graphs + torch.compile'd layers) / ``eager`` force one; the MLX backend runs
  its own loop (``inference.mlx_loop``).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass

import torch

from inference import static_loop, torch_loop
from inference.checks import check_dtype, check_loop
from inference.static_target import StaticLoopUnsupported, check_static_target
from inference.stats import resolve_block_size
from models.drafter2 import load_drafter
from models.support import check_device
from models.target import TargetModel
from models.target_folder import family_facts

log = logging.getLogger("inference")

WARMUP_TOKENS = 16  # tokens of the untimed warm-up generation before a speed comparison


@dataclass(frozen=True)
class AutoLoop:
    """What ``--loop auto`` runs on CUDA for a target family, why, and the measurement that admitted it."""

    loop: str  # eager | static | compiled
    why: str
    measured: str | None  # card, commit, command and figures; None: no GPU measurement admits a faster loop yet


# --loop auto on CUDA, by target family (models.target.SUPPORTED). A loop is admitted for a family once a GPU
# has measured it lossless (tests/test_cuda.py: the eager loop's tokens and acceptance lengths) and faster;
# admitting one is a change of `loop` here with the figure in `measured` (docs/performance.md keeps the table).
AUTO_LOOP_ON_CUDA = {
    "qwen3": AutoLoop(
        "static", "static caches + CUDA graphs: an eager batch-1 forward is launch-bound (the speedup would be the "
        "host's); the compiled loop is faster per cycle, but its one-time compile costs more than a short run saves",
        "H200, acc4b55, inference.bench --random-target qwen3-8b --loop static: cycle cost 1.385-1.401 target steps "
        "(eager on an H100: 1.14-1.95, launch-bound); lossless: tests/test_cuda.py graph replay = eager loop "
        "(H200, 8a48cc6)"),
    "llama": AutoLoop(
        "static", "the same full-attention static loop as Qwen3",
        "lossless: tests/test_cuda.py graph replay = eager loop (H200, 8a48cc6); speed: the Qwen3 figures (the same "
        "passes)"),
    "qwen3_5": AutoLoop(
        "eager", "GatedDeltaNet graph replay is lossless (tests/test_cuda.py, H200, 8a48cc6) but its speed is not "
        "measured yet (lab/gpu/measure.sh measures it)", None),
}
# --- the issue-46 families. GLM 4.x MoE, Qwen3-Next, DeepSeek-V3 / Kimi (rows the h-famB merge left out):
AUTO_LOOP_ON_CUDA.update({
    "glm4_moe": AutoLoop("eager", "its static graph replay is exact on the CPU but not measured on a GPU yet", None),
    "qwen3_next": AutoLoop("eager", "the static loop refuses it (fused GatedDeltaNet projections)", None),
    "deepseek_v3": AutoLoop("eager", "the static loop refuses it (latent-attention caches)", None),
})
# gpt-oss and Gemma 4:
AUTO_LOOP_ON_CUDA.update({
    "gpt_oss": AutoLoop("eager", "the static loop refuses it (attention sinks, sliding-window layers)", None),
    "gemma4": AutoLoop("eager", "the static loop refuses it (sliding-window and KV-shared layers)", None),
})
NOT_MEASURED = AutoLoop("eager", "no loop is measured on a GPU for this family", None)


def auto_loop(family: str | None) -> AutoLoop:
    """The ``AUTO_LOOP_ON_CUDA`` rule of a target family (``NOT_MEASURED`` for a family without one)."""
    return AUTO_LOOP_ON_CUDA.get(family or "", NOT_MEASURED)


def pick_backend(requested: str) -> str:
    """``--backend auto``: MLX on Apple Silicon where it is installed, else torch."""
    if requested != "auto":
        return requested
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        try:
            import mlx.core  # noqa: F401  (optional dependency: the mlx extra)
            return "mlx"
        except ImportError:
            pass
    return "torch"


def choose_loop(requested: str, target, drafter, block_size: int | None = None) -> str:
    """The torch loop a session runs (the rules in the module docstring): eager, static or compiled."""
    rule = auto_loop(getattr(target, "family", None))
    if requested == "auto" and target.device.type == "cuda" and rule.loop == "eager":
        if family_facts(getattr(target, "family", "") or "").static_loop in ("auto", "asked"):  # else: it refuses
            log.warning("%s target on CUDA: --loop auto runs the eager loop (launch-bound at batch 1, so the speedup "
                        "partly measures the host): %s; --loop static runs the CUDA-graph loop",
                        getattr(target, "family", None) or "this", rule.why)
        return "eager"
    if requested == "eager" or (requested == "auto" and target.device.type != "cuda"):
        return "eager"
    try:
        check_static_target(target)
        if getattr(drafter.config, "rope_scaling", None) or getattr(drafter.config, "attention_bias", False):
            raise StaticLoopUnsupported("the static drafter pass has plain RoPE and no attention biases; this "
                                        "drafter's config carries a YaRN block or attention_bias (a published "
                                        "gpt-oss drafter's): use --loop eager")
    except StaticLoopUnsupported:
        if requested == "auto":
            return "eager"
        raise
    kind = rule.loop if requested == "auto" else requested
    trained = drafter.config.block_size if block_size is not None else None
    if block_size not in (None, trained):
        # The graphs are captured for one block shape: DFlash would run eager against a static baseline
        # (a speedup of two different loops), so both run the eager loop, and the report says so.
        log.warning("--block-size %d is not the drafter's %d: the %s loop is captured for one block shape, so "
                    "DFlash and the baseline both run the eager loop", block_size, trained, kind)
        return "eager"
    return kind


class Session:
    """A loaded target + drafter on one backend and its loop (``loop_kind``), decided here, once."""

    def __init__(self, backend: str, target: str, draft: str, device: str | None = None, dtype: str | None = None,
                 loop: str = "auto", block_size: int | None = None):
        check_loop(backend, loop)
        dtype = check_dtype(dtype)
        if backend == "mlx" and device is not None:  # was ignored without a word
            raise ValueError(f"--device {device} is a torch flag; the MLX backend runs on its own device (Metal on "
                             "a Mac, the CPU on Linux): drop --device, or use --backend torch")
        if backend != "mlx":  # torch's own errors ("not compiled with CUDA", "Expected one of cpu, cuda...") are
            check_device(device)  # tracebacks after the target loaded
        self.backend, self.block_size, self.loop_kind, self._static = backend, block_size, "eager", None
        if backend == "mlx":
            try:
                from inference import mlx_loop  # optional dependency: the mlx extra
            except ImportError as e:
                raise SystemExit(f"--backend mlx needs MLX: pip install -e '.[mlx]' ({e})") from None
            self.loop = mlx_loop
            self.target, self.proposer = mlx_loop.load(target, draft, dtype=dtype)
        else:
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            default = torch.bfloat16 if device.startswith("cuda") else torch.float32
            tdtype = getattr(torch, dtype) if dtype else default
            self.loop = torch_loop
            self.target = TargetModel.from_pretrained(target, dtype=tdtype, device=device)
            drafter = load_drafter(draft, dtype=tdtype, device=device)  # either generation (v1, DFlash2)
            self.proposer = torch_loop.DrafterProposer(drafter, self.target)
            self.loop_kind = choose_loop(loop, self.target, drafter, block_size)
        if block_size is not None:
            resolve_block_size(block_size, self.proposer.block_size)
        self.tokenizer = self.target.tokenizer

    def run(self, prompt: list[int], baseline: bool = False, block_size: int | None = None, **kw):
        """DFlash on ``prompt`` (and the baseline after it when asked): ``(result, baseline result or None)``."""
        block_size = self._block_size(block_size)
        kw = self._static_budget(prompt, kw)
        static = self._static_loop(prompt, kw.get("max_new_tokens", 256))
        if static is not None:
            result = static_loop.static_dflash_generate(*static, prompt, block_size=block_size, **kw)
        else:
            result = self.loop.dflash_generate(self.target, self.proposer, prompt, block_size=block_size, **kw)
        base = self.baseline(prompt, **kw) if baseline else None
        return result, base

    def baseline(self, prompt: list[int], **kw):
        """The target alone through the same loop kind: same dtype, stop rules, timers and cache treatment."""
        kw = self._static_budget(prompt, kw)
        static = self._static_loop(prompt, kw.get("max_new_tokens", 256))
        if static is not None:
            return static_loop.static_target_generate(static[0], prompt, **kw)
        return self.loop.target_generate(self.target, prompt, **kw)

    def _block_size(self, requested: int | None) -> int | None:
        """A call's block size: the session's (None: the drafter's), or any other on the eager loops."""
        if requested is None or requested == self.block_size or self.loop_kind == "eager":
            return self.block_size if requested is None else requested
        built = self.block_size or self.proposer.block_size
        if requested != built:  # the loop was chosen for the session's block size
            raise ValueError(f"block size {requested}: this session runs the {self.loop_kind} loop, captured for "
                             f"blocks of {built}; build the Session with block_size={requested} (DFlash and the "
                             "baseline then run the eager loop)")
        return requested

    def _static_budget(self, prompt: list[int], kw: dict) -> dict:
        """``kw`` with ``max_new_tokens`` capped at the target's positions when the static loop runs.

        Its K/V buffers are preallocated for prompt + max_new_tokens (+ block slack): ``--max-new-tokens
        1000000000`` asked the allocator for 128 GB (a CUDA OOM on a GPU). The target addresses
        ``max_position_embeddings`` positions; like the eager loop past them (a warning, and it runs), the
        static loop then generates up to them with a note saying so, the buffers sized for that.
        """
        if self.loop_kind == "eager":
            return kw
        asked = kw.get("max_new_tokens", 256)
        positions = int(self.target.max_position_embeddings)
        room = max(positions - len(prompt), 1)  # a prompt past them already: one token (eager warns and runs too)
        if asked <= room:
            return kw
        log.warning(
            "--max-new-tokens %d with a %d-token prompt runs past the target's %d positions "
            "(max_position_embeddings): the %s loop preallocates its caches, so it generates at most %d new tokens "
            "(about %.1f GiB of buffers otherwise); --loop eager generates past the target's positions",
            asked, len(prompt), positions, self.loop_kind, room, self._static_bytes(len(prompt) + asked) / 2**30)
        return {**kw, "max_new_tokens": room}

    def _static_bytes(self, positions: int) -> int:
        """Bytes of the static loop's K/V buffers (target and drafter) for ``positions`` positions.

        Only the target's attention layers have one: a GatedDeltaNet layer's state does not grow with the
        positions (three of four Qwen3.5 layers)."""
        c, d = self.target.config, self.proposer.drafter.config
        size = getattr(self.target.dtype, "itemsize", 2)  # torch.dtype.itemsize; 2 bytes for anything else
        head = lambda cfg: getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # noqa: E731
        kv = lambda cfg: getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # noqa: E731
        attention = sum(kind == "full_attention" for kind in self.target.layer_types)
        per = 2 * (attention * kv(c) * head(c) + d.num_hidden_layers * kv(d) * head(d)) * size
        return per * positions

    def _static_loop(self, prompt: list[int], max_new_tokens: int) -> tuple | None:
        """(StaticTarget, StaticDrafterProposer) when this session runs the static loop, else None.

        Built on first use with room for 4096 positions (or what the call needs, rounded up to 1024):
        a longer call rebuilds them, and its CUDA graphs are captured again.
        """
        if self.loop_kind == "eager":
            return None
        B = self.proposer.drafter.config.block_size
        need = len(prompt) + max_new_tokens + 2 * B
        if self._static is None or self._static[0].max_len < need:
            self._static = static_loop.build_static_loop(self.target, self.proposer.drafter,
                                                         max(4096, -(-need // 1024) * 1024),
                                                         compile=self.loop_kind == "compiled")
        return self._static

    def reset_peak_memory(self) -> None:
        if self.backend == "mlx":
            import mlx.core as mx  # optional dependency: the mlx extra

            mx.reset_peak_memory()
        elif self.target.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.target.device)

    def peak_memory_bytes(self) -> int | None:
        """MLX ``mx.get_peak_memory``, CUDA ``torch.cuda.max_memory_allocated``; None on a torch CPU run."""
        if self.backend == "mlx":
            import mlx.core as mx  # optional dependency: the mlx extra

            return int(mx.get_peak_memory())
        if self.target.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.target.device))
        return None

    def describe(self) -> dict:
        """Backend, device and dtypes, for reports."""
        if self.backend == "mlx":
            import mlx.core as mx  # optional dependency: the mlx extra

            device = str(mx.default_device())
            if mx.metal.is_available():
                device += f" ({mx.metal.device_info().get('device_name', 'Metal')})"
            dtype = str(self.target.dtype).removeprefix("mlx.core.")
            ddtype = str(getattr(getattr(self.proposer, "drafter", None), "dtype", None)).removeprefix("mlx.core.")
        else:
            dev = self.target.device
            device = str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
            dtype = str(self.target.dtype).removeprefix("torch.")
            drafter = getattr(self.proposer, "drafter", None)  # test stand-ins have none
            ddtype = str(drafter.fc.weight.dtype if drafter is not None else None).removeprefix("torch.")
        return {"backend": self.backend, "device": device, "dtype": dtype, "draft_dtype": ddtype,
                "loop": "mlx" if self.backend == "mlx" else self.loop_kind, "platform": platform.platform(),
                "machine": platform.machine()}


