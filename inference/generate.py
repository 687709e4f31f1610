"""Generate with a DFlash drafter and print the text, the acceptance length and the speed.

    python -m inference.generate --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 \\
        --prompt "Write a haiku about rivers." --chat
    python -m inference.generate --backend mlx --target mlx-community/Qwen3-8B-4bit --draft DIR \\
        --prompt-ids 1,2,3 --max-new-tokens 64 --json

``--backend auto`` (default) picks MLX on Apple Silicon and PyTorch elsewhere. ``--json`` prints one
JSON object (tokens, acceptance_lengths, tau, decode_tokens_per_s, ...). ``--baseline`` also runs
the target alone on the same prompt and reports the speedup and whether the outputs match, after a
short untimed warm-up of both (one-time costs would otherwise fall on DFlash, which runs first); the
static and compiled loops warm up too (their CUDA graphs are captured on first use).

Before any weights load, the two ``config.json`` files are checked (``inference.checks.preflight``):
a swapped ``--target``/``--draft``, a drafter for another target, ``--block-size`` above the trained
one, ``--prompt-ids`` outside the target's vocabulary and a negative ``--temperature`` end in one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys

from inference.checks import check_draft_weights, check_dtype, check_prompt_ids, check_target_tokenizer, preflight
from models.cli import check_device

WARMUP_TOKENS = 16  # tokens of the untimed warm-up generation before a speed comparison


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inference.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["auto", "torch", "mlx"], default="auto",
                   help="torch (CUDA or CPU), mlx (Metal, or CPU on Linux), auto: mlx on Apple Silicon")
    p.add_argument("--target", required=True, help="target model: local folder or Hugging Face Hub id")
    p.add_argument("--draft", required=True, help="DFlash drafter: local folder or Hub id")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, used as given")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn with the chat template")
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="with --chat: enable_thinking for templates that have it (default: the template's)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="exact number of new tokens unless EOS comes first")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless: equals the target's output)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per draft block (bonus included); at most the drafter's trained block size")
    p.add_argument("--seed", type=int, default=0, help="sampling seed when --temperature > 0")
    p.add_argument("--baseline", action="store_true", help="also run the target alone and report the speedup")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None,
                   help="compute dtype, e.g. float32 for exactness (torch default: bfloat16 on cuda, float32 on cpu; "
                        "mlx default: the checkpoint's)")
    p.add_argument("--loop", choices=TORCH_LOOPS, default="auto",
                   help="torch: auto (default) = static caches + CUDA graphs on a GPU for full-attention targets, "
                        "else eager; static / compiled (graphs + torch.compile) / eager force one (static also "
                        "runs Qwen3.5 targets)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if not 0 <= args.seed < 2**64:  # the MLX key and torch's generator take 64-bit seeds (a traceback after the
        p.error(f"--seed {args.seed}: use 0 to 2**64 - 1")  # models loaded, for a negative one or a larger one)
    if not (args.temperature >= 0 and args.temperature != float("inf")):
        p.error(f"--temperature {args.temperature}: use 0 for greedy (lossless) decoding or a positive value to sample")
    if args.prompt is not None:
        try:  # bytes the terminal's encoding could not decode reach us as surrogates: the tokenizer's TypeError
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            p.error(f"--prompt is not UTF-8 text (an undecodable byte at character {e.start}: "
                    f"{args.prompt[max(e.start - 10, 0):e.start + 10]!r}): set the terminal to UTF-8 (e.g. "
                    "LANG=C.UTF-8), or pass --prompt-ids")
    if args.prompt is not None and not args.prompt.strip():  # an unset shell variable: found only after the load
        p.error("--prompt is empty: give the text to generate from (or --prompt-ids)")
    if args.chat and args.prompt is None:
        p.error("--chat needs --prompt (text); --prompt-ids are used as given")
    if args.thinking is not None and not args.chat:  # was ignored: the prompt went in raw
        p.error("--thinking sets the chat template's switch: add --chat (with --prompt)")
    return args


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        try:
            import mlx.core  # noqa: F401
            return "mlx"
        except ImportError:
            pass
    return "torch"


def parse_prompt_ids(text: str, vocab_size: int | None) -> list[int]:
    """``--prompt-ids 1,2,3``, checked against the target's vocabulary before any model loads."""
    parts = [x.strip() for x in text.strip().strip(",").split(",")]
    try:
        ids = [int(x) for x in parts] if any(parts) else []
    except ValueError:  # "1,,2" too: an empty id is a typo, not nothing
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    return check_prompt_ids(ids, vocab_size)


def encode_prompt(args: argparse.Namespace, tokenizer, vocab_size: int | None = None) -> list[int]:
    if args.prompt_ids is not None:
        return parse_prompt_ids(args.prompt_ids, vocab_size)
    if tokenizer is None:
        raise SystemExit("the target folder has no tokenizer: pass --prompt-ids instead of --prompt")
    if args.chat:
        from data.chat import require_chat_template

        require_chat_template(tokenizer, args.target, "; or drop --chat to tokenize --prompt as plain text")
        kwargs = {} if args.thinking is None else {"enable_thinking": args.thinking == "on"}
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            tokenize=True, **kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(args.prompt, add_special_tokens=True)["input_ids"])


TORCH_LOOPS = ("auto", "eager", "static", "compiled")


def pick_torch_loop(requested: str, target, drafter) -> str:
    """The torch loop a session runs: ``auto`` = the static-cache CUDA-graph loop on a GPU where it
    applies (full-attention target, drafter without sliding-window layers), else the eager loop.

    An eager batch-1 forward on a GPU is launch-bound (an 8B target's decode step took 84 ms eager,
    10.8 ms replayed as a graph), so eager speedups there measure the host, not the drafter.
    Qwen3.5 / 3.6 (GatedDeltaNet) targets run the static loop when asked (``--loop static``); ``auto``
    keeps them eager until its graph replay has been checked on a GPU (``tests/test_cuda.py``).
    """
    from inference.static_target import StaticLoopUnsupported, check_static_target

    if requested == "auto" and target.device.type == "cuda" and target.is_hybrid:
        import logging

        logging.getLogger(__name__).warning(
            "Qwen3.5 target on CUDA: --loop auto runs the eager loop (launch-bound at batch 1, so the speedup "
            "partly measures the host); --loop static runs the CUDA-graph loop, not yet checked on a GPU")
        return "eager"
    if requested == "eager" or (requested == "auto" and target.device.type != "cuda"):
        return "eager"
    try:
        check_static_target(target)
        if drafter.config.use_sliding_window:
            raise StaticLoopUnsupported("the static drafter pass has full-attention layers only; this drafter has "
                                        "sliding-window layers: use --loop eager")
    except StaticLoopUnsupported:
        if requested == "auto":
            return "eager"
        raise
    return "static" if requested == "auto" else requested


class Session:
    """A loaded target + drafter on one backend; ``run`` generates (and optionally the baseline)."""

    def __init__(self, backend: str, target: str, draft: str, device: str | None = None, dtype: str | None = None,
                 loop: str = "auto"):
        self.backend, requested = backend, loop  # `loop` is rebound to the backend's loop module below
        if loop not in TORCH_LOOPS:
            raise ValueError(f"--loop {loop!r}: use one of {', '.join(TORCH_LOOPS)}")
        self.loop_kind, self._static = "eager", None
        if backend == "mlx" and loop not in ("auto", "eager"):
            raise ValueError(f"--loop {loop} is a torch loop; the MLX backend runs its own (drop --loop, or use "
                             "--backend torch)")
        dtype = check_dtype(dtype)
        if backend == "mlx" and device is not None:  # was ignored without a word
            raise ValueError(f"--device {device} is a torch flag; the MLX backend runs on its own device (Metal on "
                             "a Mac, the CPU on Linux): drop --device, or use --backend torch")
        if backend != "mlx":  # torch's own errors ("not compiled with CUDA", "Expected one of cpu, cuda...") are
            check_device(device)  # tracebacks after the target loaded
        if backend == "mlx":
            try:
                from inference import mlx_loop as loop
            except ImportError as e:
                raise SystemExit(f"--backend mlx needs MLX: pip install -e '.[mlx]' ({e})") from None
            self.target, self.proposer = loop.load(target, draft, dtype=dtype)
        else:
            import torch

            from inference import torch_loop as loop
            from models.drafter import DFlashDraftModel
            from models.target import TargetModel

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            default = torch.bfloat16 if device.startswith("cuda") else torch.float32
            tdtype = getattr(torch, dtype) if dtype else default
            self.target = TargetModel.from_pretrained(target, dtype=tdtype, device=device)
            drafter = DFlashDraftModel.from_pretrained(draft, dtype=tdtype, device=device)
            self.proposer = loop.DrafterProposer(drafter, self.target)
            self.loop_kind = pick_torch_loop(requested, self.target, drafter)
        self.loop = loop
        self.tokenizer = self.target.tokenizer

    def run(self, prompt: list[int], baseline: bool = False, block_size: int | None = None, **kw):
        trained = self.proposer.drafter.config.block_size if self.loop_kind != "eager" else None
        if block_size not in (None, trained) and self.loop_kind != "eager":
            # The graphs are captured for one block shape: DFlash would run eager against a static baseline
            # (a speedup of two different loops), so both run the eager loop, and the report says so.
            logging.getLogger("inference").warning(
                "--block-size %d is not the drafter's %d: the %s loop is captured for one block shape, so "
                "DFlash and the baseline both run the eager loop", block_size, trained, self.loop_kind)
            self.loop_kind = "eager"
        kw = self._static_budget(prompt, kw, block_size)
        static = self._static_loop(prompt, kw.get("max_new_tokens", 256), block_size)
        if static is not None:
            from inference.static_loop import static_dflash_generate

            result = static_dflash_generate(*static, prompt, block_size=block_size, **kw)
        else:
            result = self.loop.dflash_generate(self.target, self.proposer, prompt, block_size=block_size, **kw)
        base = self.baseline(prompt, **kw) if baseline else None
        return result, base

    def baseline(self, prompt: list[int], **kw):
        """The target alone through the same loop kind: same dtype, stop rules, timers and cache treatment."""
        kw = self._static_budget(prompt, kw, None)
        static = self._static_loop(prompt, kw.get("max_new_tokens", 256), None)
        if static is not None:
            from inference.static_loop import static_target_generate

            return static_target_generate(static[0], prompt, **kw)
        return self.loop.target_generate(self.target, prompt, **kw)

    def _static_budget(self, prompt: list[int], kw: dict, block_size: int | None) -> dict:
        """``kw`` with ``max_new_tokens`` capped at the target's positions when the static loop runs.

        Its K/V buffers are preallocated for prompt + max_new_tokens (+ block slack): ``--max-new-tokens
        1000000000`` asked the allocator for 128 GB (a CUDA OOM on a GPU). The target addresses
        ``max_position_embeddings`` positions; like the eager loop past them (a warning, and it runs), the
        static loop then generates up to them with a note saying so, the buffers sized for that.
        """
        if self.loop_kind == "eager" or block_size not in (None, self.proposer.drafter.config.block_size):
            return kw
        asked = kw.get("max_new_tokens", 256)
        positions = int(self.target.max_position_embeddings)
        room = max(positions - len(prompt), 1)  # a prompt past them already: one token (eager warns and runs too)
        if asked <= room:
            return kw
        logging.getLogger("inference").warning(
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

    def _static_loop(self, prompt: list[int], max_new_tokens: int, block_size: int | None):
        """(StaticTarget, StaticDrafterProposer) when this session runs the static loop, else None.

        Built on first use with room for 4096 positions (or what the call needs, rounded up to 1024):
        a longer call rebuilds them, and its CUDA graphs are captured again. A block size other than
        the drafter's runs the eager loop (the graphs are captured for one block shape).
        """
        if self.loop_kind == "eager":
            return None
        B = self.proposer.drafter.config.block_size
        if block_size not in (None, B):
            return None
        need = len(prompt) + max_new_tokens + 2 * B
        if self._static is None or self._static[0].max_len < need:
            from inference.static_loop import build_static_loop

            self._static = build_static_loop(self.target, self.proposer.drafter, max(4096, -(-need // 1024) * 1024),
                                             compile=self.loop_kind == "compiled")
        return self._static

    def reset_peak_memory(self) -> None:
        if self.backend == "mlx":
            import mlx.core as mx

            mx.reset_peak_memory()
        elif self.target.device.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.target.device)

    def peak_memory_bytes(self) -> int | None:
        """MLX ``mx.get_peak_memory``, CUDA ``torch.cuda.max_memory_allocated``; None on a torch CPU run."""
        if self.backend == "mlx":
            import mlx.core as mx

            return int(mx.get_peak_memory())
        if self.target.device.type == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated(self.target.device))
        return None

    def describe(self) -> dict:
        """Backend, device and dtypes, for reports."""
        import platform as pf

        if self.backend == "mlx":
            import mlx.core as mx

            device = str(mx.default_device())
            if mx.metal.is_available():
                device += f" ({mx.metal.device_info().get('device_name', 'Metal')})"
            dtype = str(self.target.dtype).removeprefix("mlx.core.")
            ddtype = str(getattr(getattr(self.proposer, "drafter", None), "dtype", None)).removeprefix("mlx.core.")
        else:
            import torch

            dev = self.target.device
            device = str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
            dtype = str(self.target.dtype).removeprefix("torch.")
            drafter = getattr(self.proposer, "drafter", None)  # test stand-ins have none
            ddtype = str(drafter.fc.weight.dtype if drafter is not None else None).removeprefix("torch.")
        return {"backend": self.backend, "device": device, "dtype": dtype, "draft_dtype": ddtype,
                "loop": self.loop_kind, "platform": pf.platform(), "machine": pf.machine()}


def warn_past_positions(prompt_len: int, max_new_tokens: int, positions: int) -> bool:
    """Say when the prompt plus ``--max-new-tokens`` runs past the target's positions: the eager loop runs
    there without a word, and its text, tau and speed describe a target beyond its context. Returns whether."""
    if prompt_len + max_new_tokens <= positions:
        return False
    fix = (f"shorten the prompt to under {positions} tokens" if prompt_len >= positions else
           f"lower --max-new-tokens to {positions - prompt_len} or shorten the prompt")
    print(f"warning: the {prompt_len}-token prompt plus --max-new-tokens {max_new_tokens} runs past the target's "
          f"{positions} positions (max_position_embeddings): the tokens past them come from a target beyond its "
          f"context; {fix}", file=sys.stderr)
    return True


def report_of(backend: str, result, baseline, greedy: bool = True) -> dict:
    """The --json report. Sampled (``greedy`` False), DFlash and the baseline draw their tokens differently from
    one seed, so their outputs differ by design: ``matches_baseline`` / ``first_divergence`` are None, as
    validate reports them, not a ``False`` that reads as a lossless loop gone wrong."""
    from inference.report import first_divergence

    report = {"backend": backend, **result.to_json()}
    if baseline is not None:
        report["baseline_decode_tokens_per_s"] = baseline.decode_tokens_per_s
        report["speedup"] = (result.decode_tokens_per_s / baseline.decode_tokens_per_s
                             if baseline.decode_tokens_per_s else None)
        first_diff = first_divergence(result.tokens, baseline.tokens) if greedy else None
        report["matches_baseline"] = first_diff is None if greedy else None
        report["first_divergence"] = first_diff
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.dtype = check_dtype(args.dtype)
    pre = preflight(args.target, args.draft, args.block_size, args.temperature)  # before any weights load
    check_draft_weights(args.draft)
    early_ids = parse_prompt_ids(args.prompt_ids, pre.target.vocab_size) if args.prompt_ids is not None else None
    if early_ids is None:
        check_target_tokenizer(pre.target, args.target, "pass --prompt-ids instead of --prompt, or add the "
                               "target's tokenizer files to the folder")
    backend = pick_backend(args.backend)
    session = Session(backend, args.target, args.draft, args.device, args.dtype, loop=args.loop)
    tokenizer = session.tokenizer
    prompt = early_ids if early_ids is not None else encode_prompt(args, tokenizer)
    if session.loop_kind == "eager":  # the static loops cap --max-new-tokens at the positions, with their own warning
        warn_past_positions(len(prompt), args.max_new_tokens, session.target.max_position_embeddings)
    if args.baseline or session.loop_kind != "eager":  # kernel selection, allocation, graph capture (and a
        # compiled loop's compilation) are not timed: validate does the same
        session.run(prompt, baseline=args.baseline, block_size=args.block_size, temperature=args.temperature,
                    max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens), seed=args.seed)
    result, baseline = session.run(prompt, baseline=args.baseline, block_size=args.block_size,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    report = report_of(backend, result, baseline, greedy=args.temperature == 0)
    if args.json:
        print(json.dumps(report))
    else:
        text = tokenizer.decode(result.tokens) if tokenizer is not None else " ".join(map(str, result.tokens))
        print(text)
        # No decode step (one token asked, or the first was EOS): tau and speeds are undefined, not 0
        tau = f"{result.tau:.2f}" if result.acceptance_lengths else "-"
        speed = f"{result.decode_tokens_per_s:.1f}" if result.decode_s > 0 and len(result.tokens) > 1 else "-"
        print(f"\n[{backend}] {len(result.tokens)} tokens | tau {tau} | decode {speed} tok/s | acceptance "
              f"histogram {result.histogram()}", file=sys.stderr)
        if baseline is not None:
            speedup = f"{report['speedup']:.2f}x" if report["speedup"] else "-"
            same = report["matches_baseline"] if args.temperature == 0 else "- (sampled: not compared)"
            print(f"baseline {report['baseline_decode_tokens_per_s']:.1f} tok/s | speedup {speedup}"
                  f" | matches baseline: {same}", file=sys.stderr)
    return report


def cli() -> None:
    """The ``draftsmith-generate`` console script: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.cli import run_cli

    run_cli(main)


if __name__ == "__main__":
    cli()
