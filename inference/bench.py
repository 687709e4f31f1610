"""Decode speed of the DFlash loop vs the target alone, one JSON line per (backend, prompt) result.

    python -m inference.bench --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --backend torch
    python -m inference.bench --tiny qwen3_5 --backend torch      # random tiny target + drafter, no download

    python -m inference.bench --random-target qwen3-8b --loop static eager --repeat 2   # CUDA, no download
    python -m inference.bench --random-target tiny --max-new-tokens 32                  # the same plumbing on a CPU

Each line: backend, device, prompt index, tokens, tau, dflash and baseline decode tokens/s, speedup,
and whether the greedy outputs match (first divergence index otherwise). A warm-up generation
runs first so that one-time costs (kernel selection, allocation, graph capture) are not timed.

``--loop`` (torch backend): ``eager`` is the reference loop (``inference.torch_loop``), ``static``
the preallocated-cache loop with CUDA graphs (``inference.static_loop``), ``compiled`` the same with
``torch.compile``d target layers and drafter block pass (one-time compile before the timed runs): the
one cycle of ``inference.cycle`` over each loop's state adapters; the baseline is the same cycle
without a drafter, through the same loop kind. Torch lines also
give the **cycle cost** (decode seconds per DFlash cycle over baseline seconds per token: 1.0
means a draft+verify cycle costs one target decode step) and a ``decode_parts`` line per loop:
per-cycle milliseconds of draft, verify, accept (the one host sync) and host bookkeeping (eager:
rollback too), from one extra run with a device sync around each part (static loops: their
two-graph cycle, whose parts can be timed apart; ``--cycle`` picks which cycle the decode lines
time: the device-resident one by default, as generate runs it); ``--profile N`` adds the
top kernels of each pass. ``--random-target RECIPE``
builds a random-weight target of a recipe's shape on the device and a random recipe drafter
(tau ~1: speed plumbing only); prompts are then random token ids.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from inference.checks import check_dtype, preflight
from inference.report import report_of
from inference.stats import resolve_block_size
from models.config import DFlashConfig
from models.mask_token import choose_mask_token, tokenizer_emitted_ids

# torch, transformers and the modules that import them are imported inside the functions that use them: a CLI's
# start-up time (seconds that --help and the argument errors do without).

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain, step by step, why the sky is blue.",
    "List five uses of a hash map with one sentence each.",
]


def tiny_folders(arch: str, root: str) -> tuple[str, str]:
    """A tiny target and a random drafter saved as folders (speed plumbing only: tau ~ 1)."""
    import torch

    from models.drafter import DFlashDraftModel
    from models.target import TargetModel
    from models.tiny import save_tiny_target

    target_dir = save_tiny_target(f"{root}/target", arch)
    t = TargetModel.from_pretrained(target_dir)
    cfg = DFlashConfig.for_target(hidden_size=t.hidden_size, vocab_size=t.vocab_size, num_target_layers=t.num_layers,
                                  max_position_embeddings=t.max_position_embeddings, num_hidden_layers=2,
                                  mask_token_id=choose_mask_token(t.vocab_size, tokenizer_emitted_ids(t.tokenizer)),
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_taps=3,
                                  torch_dtype="float32")
    torch.manual_seed(0)
    DFlashDraftModel(cfg).save_pretrained(f"{root}/draft")
    return str(target_dir), f"{root}/draft"


def random_models(recipe: str, device: str, seed: int = 0, dtype: str | None = None):
    """A random target of ``recipe``'s shape and a random drafter of the recipe's shape (paper recipes: 5 layers,
    5 taps, block 16), both in ``dtype`` (``--dtype``; default bf16 on CUDA, fp32 on the CPU)."""
    import torch

    from models.drafter import DFlashDraftModel
    from models.random_target import recipe_spec, recipe_target

    d = recipe_spec(recipe).get("drafter") or {}
    dtype = getattr(torch, dtype) if dtype else torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = recipe_target(recipe, device, dtype)
    c = target.config
    cfg = DFlashConfig.for_target(hidden_size=c.hidden_size, vocab_size=target.vocab_size,
                                  num_target_layers=target.num_layers,
                                  max_position_embeddings=min(c.max_position_embeddings, 32768),
                                  num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                                  head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                                  num_hidden_layers=d.get("num_hidden_layers", 5), num_taps=d.get("num_taps", 5),
                                  mask_token_id=target.vocab_size - 1, block_size=d.get("block_size", 16),
                                  torch_dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = DFlashDraftModel(cfg).to(dtype).eval()
    return target, drafter


def torch_runs(target, drafter, prompts: list[list[int]], loops: list[str], max_new: int, block_size: int | None,
               repeat: int, profile: int = 0, cycles: tuple[str, ...] = ("resident",)) -> None:
    """Both loops of the torch backend on loaded models: decode lines, cycle cost and per-part times.

    ``cycles`` (static and compiled loops): ``resident``, the greedy cycle and baseline step as one graph
    each; ``two-graph``, the passes' own graphs with the acceptance (the baseline's token) read on the
    host between them. Both kinds run on the same built loop, so one compile serves them."""
    from inference import static_loop as sl
    from inference import torch_loop as tl

    B = resolve_block_size(block_size, drafter.config.block_size)
    warm = 2 * B  # tokens of the warm-up generation below
    # The static caches must hold the longest generation the bench runs, the warm-up included, plus a
    # block of overshoot on each side (as Session sizes them); sizing from --max-new-tokens alone
    # broke short runs, whose warm-up asks for more.
    max_len = max(len(p) for p in prompts) + max(max_new, warm) + 2 * B
    for loop in loops:
        # (line label, resident flag): None lets the static loop choose (the parts run below, the profile)
        kinds = [(c, c == "resident") for c in cycles] if loop in ("static", "compiled") else [(None, None)]
        if loop in ("static", "compiled"):
            st, proposer = sl.build_static_loop(target, drafter, max_len, B, compile=loop == "compiled")
            gen = lambda ids, resident, **kw: sl.static_dflash_generate(  # noqa: E731
                st, proposer, ids, resident=resident, **kw)
            base = lambda ids, resident, **kw: sl.static_target_generate(  # noqa: E731
                st, ids, resident=resident, **kw)
        else:
            proposer = tl.DrafterProposer(drafter, target)
            gen = lambda ids, resident, **kw: tl.dflash_generate(target, proposer, ids, **kw)  # noqa: E731
            base = lambda ids, resident, **kw: tl.target_generate(target, ids, **kw)  # noqa: E731
        for _, resident in kinds:
            gen(prompts[0], resident, max_new_tokens=warm, block_size=B, eos_token_ids=[])  # warm-up: graphs
            base(prompts[0], resident, max_new_tokens=4, eos_token_ids=[])
        for rep in range(repeat):
            for i, ids in enumerate(prompts):
                for kind, resident in kinds:
                    r = gen(ids, resident, max_new_tokens=max_new, block_size=B, eos_token_ids=[])
                    b = base(ids, resident, max_new_tokens=max_new, eos_token_ids=[])
                    print(json.dumps({"bench": "decode", "backend": "torch", "loop": loop,
                                      **({"cycle": kind} if kind else {}), "device": str(target.device),
                                      "repeat": rep, "prompt": i, "prompt_tokens": len(ids),
                                      **_decode_figures(r, b)}), flush=True)
        parts: dict[str, float] = {}
        r = gen(prompts[0], None, max_new_tokens=max_new, block_size=B, eos_token_ids=[], parts=parts)
        n = max(len(r.acceptance_lengths), 1)
        print(json.dumps({"bench": "decode_parts", "loop": loop, "cycles": n,
                          **{f"{k}_ms_per_cycle": round(1e3 * v / n, 3) for k, v in parts.items()}}), flush=True)
        if profile:
            profile_loop(loop, st if loop != "eager" else None, proposer, prompts[0], B, profile,
                         lambda: gen(prompts[0], None, max_new_tokens=max_new, block_size=B, eos_token_ids=[]))


def _decode_figures(r, b) -> dict:
    """One DFlash generation ``r`` against its baseline ``b``: tau, speeds, cycle cost, agreement."""
    cycles, steps = len(r.acceptance_lengths), max(len(b.tokens) - 1, 1)
    first = next((k for k, (x, y) in enumerate(zip(r.tokens, b.tokens)) if x != y), None)
    return {"tokens": len(r.tokens), "tau": round(r.tau, 3), "dflash_tok_s": round(r.decode_tokens_per_s, 2),
            "baseline_tok_s": round(b.decode_tokens_per_s, 2),
            "speedup": round(r.decode_tokens_per_s / max(b.decode_tokens_per_s, 1e-9), 3),
            "baseline_ms_per_token": round(1e3 * b.decode_s / steps, 3),
            "cycle_ms": round(1e3 * r.decode_s / max(cycles, 1), 3),
            "cycle_cost": round((r.decode_s / max(cycles, 1)) / (b.decode_s / steps), 3),
            "matches_baseline": first is None, "first_divergence": first}


def profile_loop(loop: str, st, proposer, prompt: list[int], B: int, n: int, generation) -> None:
    """``profile`` lines: the top ``n`` kernels of each fixed-shape pass of a static loop (replayed as the
    loop replays it: a CUDA graph on a GPU), or of one whole generation of the eager loop.

    The passes replay on whatever the last generation left in their buffers: speed only.
    """
    from models.support import top_ops

    if st is None:
        print(json.dumps({"bench": "profile", "loop": loop, "what": "generation", **top_ops(generation, n)}),
              flush=True)
        return
    passes = {"decode": st.graphed_pass(1), "verify": st.graphed_pass(B), "draft": proposer.graphed_pass()}
    for what, fn in passes.items():
        print(json.dumps({"bench": "profile", "loop": loop, "what": what, **top_ops(fn, n, calls=10)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    from data.bench import check_at_least, check_device
    from inference.session import Session, pick_backend
    from models.random_target import recipe_runs_on_cpu, recipe_spec

    p = argparse.ArgumentParser(prog="python -m inference.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target folder or Hub id (with --draft)")
    p.add_argument("--draft", help="drafter folder or Hub id (with --target)")
    p.add_argument("--tiny", choices=["qwen3", "llama", "qwen3_5"], help="use a random tiny target + drafter")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "mlx"],
                   help="torch (CUDA or CPU), mlx (Metal, or CPU on Linux); auto: mlx on Apple Silicon (default auto)")
    p.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS,
                   help="chat prompts (default: three built-in; --random-target: only their count is used)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt (default 256)")
    p.add_argument("--block-size", type=int, default=None,
                   help="draft block size (default: the drafter's trained block size)")
    p.add_argument("--device", default=None,
                   help="torch device: cpu, cuda or cuda:N (default: cuda when there is one, else cpu)")
    p.add_argument("--dtype", default=None,
                   help="compute dtype, e.g. float32 (torch default: bfloat16 on cuda, float32 on cpu; "
                        "mlx: the checkpoint's)")
    p.add_argument("--random-target", metavar="RECIPE", default=None,
                   help="random target of a recipe's shape (qwen3-8b, llama31-8b, ...: CUDA, or an explicit "
                        "--device cpu; tiny: anywhere) + random recipe drafter, built on the device")
    p.add_argument("--loop", nargs="+", choices=["eager", "static", "compiled"], default=None,
                   help="torch loops to time, each with cycle cost and a decode_parts line (compiled = static "
                        "with compiled layers). Default: --random-target times static and eager; otherwise one "
                        "line per prompt through generate's auto loop (static on CUDA for full-attention "
                        "targets, else eager; MLX: its own loop)")
    p.add_argument("--cycle", choices=["resident", "two-graph", "both"], default="resident",
                   help="static/compiled loops at temperature 0: 'resident' runs each cycle (verify, acceptance, "
                        "next draft) and each baseline step as one graph with one read, as generate does; "
                        "'two-graph' replays the draft and verify graphs with the acceptance read on the host "
                        "between them (and the baseline's token read before its next step); 'both' times both "
                        "on the same built loop, a 'cycle' field telling the lines apart (default resident)")
    p.add_argument("--repeat", type=int, default=1, help="timed passes over the prompts (default 1)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="--random-target: random prompt length (default 64)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="with --loop: 'profile' lines of each loop's N most expensive kernels (GPU) or operators "
                        "(CPU): per pass (decode, verify, draft) for static/compiled, one generation for eager "
                        "(default 0: off)")
    args = p.parse_args(argv)
    # Everything that can be refused is refused here, before a model is built or loaded.
    check_at_least(p, args, max_new_tokens=1, block_size=2, repeat=1, prompt_tokens=1, profile=0)
    args.dtype = check_dtype(args.dtype)
    sources = [f for f, given in (("--target/--draft", args.target or args.draft), ("--tiny", args.tiny),
                                  ("--random-target", args.random_target)) if given]
    if len(sources) > 1:  # one took precedence without a word: the line printed did not say which was timed
        p.error(f"{' and '.join(sources)} each name the models to time: give one of them")
    if not args.random_target and not args.tiny and not (args.target and args.draft):
        p.error("give --target and --draft, --tiny ARCH or --random-target RECIPE")
    if args.prompt_tokens != p.get_default("prompt_tokens") and not args.random_target:
        p.error(f"--prompt-tokens {args.prompt_tokens} sets the random prompts of --random-target; the other models "
                "time --prompts: drop it, or add --random-target RECIPE")
    if args.profile and not (args.loop or args.random_target):
        p.error(f"--profile {args.profile} profiles the torch loops: add --loop (static, compiled or eager) or "
                "--random-target")
    timed_loops = args.loop or (["static", "eager"] if args.random_target else [])
    if args.cycle != p.get_default("cycle") and not {"static", "compiled"} & set(timed_loops):
        p.error(f"--cycle {args.cycle} chooses how the static and compiled loops run a cycle: add --loop static "
                "or --loop compiled (with --random-target, or --target/--draft or --tiny)")
    if args.backend == "mlx" and (args.loop or args.random_target):
        p.error(f"{'--loop' if args.loop else '--random-target'} times the torch loops; the MLX backend runs its "
                "own: drop it, or use --backend torch")
    explicit_cpu = args.device == "cpu"
    device = check_device(p, args.device)
    if args.random_target:
        spec = recipe_spec(args.random_target)
        if device == "cpu" and not explicit_cpu and not recipe_runs_on_cpu(spec):
            raise ValueError(f"--random-target {args.random_target} builds a full-size target: it needs a CUDA GPU "
                             "(none found). On the CPU use --random-target tiny or --tiny qwen3, or pass --device "
                             "cpu to build it here anyway (tens of GB of memory, minutes)")
    elif not args.tiny:
        preflight(args.target, args.draft, args.block_size)  # a swapped --target/--draft, as generate names it
    if args.random_target or (args.loop and args.backend != "mlx"):
        import torch

        if args.random_target:
            target, drafter = random_models(args.random_target, device, dtype=args.dtype)  # --dtype was ignored
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, target.vocab_size - 2, (args.prompt_tokens,), generator=g).tolist()
                       for _ in args.prompts]
        else:
            with tempfile.TemporaryDirectory() as root:
                target_dir, draft_dir = tiny_folders(args.tiny, root) if args.tiny else (args.target, args.draft)
                session = Session("torch", target_dir, draft_dir, device, args.dtype)
            target, drafter = session.target, session.proposer.drafter
            prompts = [_chat_ids(target.tokenizer, x) for x in args.prompts]
        cycles = ("resident", "two-graph") if args.cycle == "both" else (args.cycle,)
        torch_runs(target, drafter, prompts, args.loop or ["static", "eager"], args.max_new_tokens, args.block_size,
                   args.repeat, args.profile, cycles)
        return
    with tempfile.TemporaryDirectory() as root:
        target, draft = tiny_folders(args.tiny, root) if args.tiny else (args.target, args.draft)
        session = Session(pick_backend(args.backend), target, draft, args.device, args.dtype,
                          block_size=args.block_size)
        prompts = [_chat_ids(session.tokenizer, x) for x in args.prompts]
        session.run(prompts[0], baseline=True, max_new_tokens=16)  # warm-up: one-time costs are not timed
        for rep in range(args.repeat):
            for i, ids in enumerate(prompts):
                r = report_of(session.backend, *session.run(ids, baseline=True, block_size=args.block_size,
                                                            max_new_tokens=args.max_new_tokens))
                print(json.dumps({"bench": "decode", "backend": r["backend"], "repeat": rep, "prompt": i,
                                  "prompt_tokens": len(ids),
                                  "tokens": r["num_tokens"], "tau": round(r["tau"], 3),
                                  "dflash_tok_s": round(r["decode_tokens_per_s"], 2),
                                  "baseline_tok_s": round(r["baseline_decode_tokens_per_s"], 2),
                                  "speedup": round(r["speedup"] or 0.0, 3), "matches_baseline": r["matches_baseline"],
                                  "first_divergence": r["first_divergence"]}), flush=True)


def _chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


if __name__ == "__main__":
    from models.support import run_cli

    run_cli(main)
