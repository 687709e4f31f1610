"""Generate with a DFlash drafter and print the text, the acceptance length and the speed.

    python -m inference.generate --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 \\
        --prompt "Write a haiku about rivers." --chat
    python -m inference.generate --backend mlx --target mlx-community/Qwen3-8B-4bit --draft DIR \\
        --prompt-ids 1,2,3 --max-new-tokens 64 --json

``--backend auto`` (default) picks MLX on Apple Silicon and PyTorch elsewhere. ``--json`` prints one
JSON object (tokens, acceptance_lengths, tau, decode_tokens_per_s, ...). ``--baseline`` also runs
the target alone on the same prompt and reports the speedup and whether the outputs match, after a
short untimed warm-up of both (one-time costs would otherwise fall on DFlash, which runs first); the
static and compiled loops warm up too (their CUDA graphs are captured on first use). The loop (``--loop``)
is chosen once, when the session is built (``inference.session``).

Before any weights load, the two ``config.json`` files are checked (``inference.checks.preflight``):
a swapped ``--target``/``--draft``, a drafter for another target, ``--block-size`` above the trained
one, ``--prompt-ids`` outside the target's vocabulary and a negative ``--temperature`` end in one line; so do a
drafter whose weights hold NaN / Inf and a quantized MLX drafter on the torch backend (before the target loads).
With ``--chat`` the prompt is rendered with the thinking switch the drafter was trained with (its provenance
block's ``data.thinking``) unless ``--thinking`` says otherwise (a warning when it differs).
"""

from __future__ import annotations

import argparse
import json
import sys

from data.chat import require_chat_template
from inference.checks import (
    LOOPS,
    check_draft_weights,
    check_drafter_backend,
    check_dtype,
    check_fetched_draft_weights,
    check_prompt_ids,
    check_target_tokenizer,
    preflight,
    resolve_thinking,
)
from inference.report import report_of


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
                   help="with --chat: enable_thinking for templates that have it (default: the drafter's recorded "
                        "training setting, else the template's)")
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
    p.add_argument("--loop", choices=LOOPS, default="auto",
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
        require_chat_template(tokenizer, args.target, "; or drop --chat to tokenize --prompt as plain text")
        kwargs = {} if args.thinking is None else {"enable_thinking": args.thinking == "on"}
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            tokenize=True, **kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(args.prompt, add_special_tokens=True)["input_ids"])


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


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.dtype = check_dtype(args.dtype)
    pre = preflight(args.target, args.draft, args.block_size, args.temperature)  # before any weights load
    check_draft_weights(args.draft)
    if args.chat:
        args.thinking = resolve_thinking(args.thinking, pre.drafter, None, lambda m: print(m, file=sys.stderr))
    early_ids = parse_prompt_ids(args.prompt_ids, pre.target.vocab_size) if args.prompt_ids is not None else None
    if early_ids is None:
        check_target_tokenizer(pre.target, args.target, "pass --prompt-ids instead of --prompt, or add the "
                               "target's tokenizer files to the folder")
    # Imported here, not at the top: a CLI's start-up time (the session imports torch and transformers, seconds
    # that --help and the pre-flight errors above do without).
    from inference.session import WARMUP_TOKENS, Session, pick_backend

    backend = pick_backend(args.backend)
    check_drafter_backend(pre.drafter, backend, args.draft)  # before the target loads
    session = Session(backend, args.target, args.draft, args.device, args.dtype, loop=args.loop,
                      block_size=args.block_size)
    check_fetched_draft_weights(args.draft)  # a Hub id's weights, fetched by the session: before any work
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
    from models.support import run_cli

    run_cli(main)


if __name__ == "__main__":
    cli()
