"""Decode speed of the DFlash loop vs the target alone, one JSON line per (backend, prompt) result.

    python -m inference.bench --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --backend torch
    python -m inference.bench --tiny qwen3_5 --backend torch      # random tiny target + drafter, no download

Each line: backend, device, prompt index, tokens, tau, dflash and baseline decode tokens/s, speedup,
and whether the greedy outputs match (first divergence index otherwise). A warm-up generation
runs first so that one-time costs (kernel selection, allocation) are not timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain, step by step, why the sky is blue.",
    "List five uses of a hash map with one sentence each.",
]


def tiny_folders(arch: str, root: str) -> tuple[str, str]:
    """A tiny target and a random drafter saved as folders (speed plumbing only: tau ~ 1)."""
    import torch

    from models.config import DFlashConfig, choose_mask_token, tokenizer_emitted_ids
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


def main(argv: list[str] | None = None) -> None:
    from inference.generate import Session, pick_backend, report_of

    p = argparse.ArgumentParser(prog="python -m inference.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target folder or Hub id")
    p.add_argument("--draft", help="drafter folder or Hub id")
    p.add_argument("--tiny", choices=["qwen3", "llama", "qwen3_5"], help="use a random tiny target + drafter")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "mlx"])
    p.add_argument("--prompts", nargs="*", default=DEFAULT_PROMPTS, help="chat prompts (default: three built-in)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    args = p.parse_args(argv)
    if not args.tiny and not (args.target and args.draft):
        p.error("give --target and --draft, or --tiny ARCH")
    with tempfile.TemporaryDirectory() as root:
        target, draft = tiny_folders(args.tiny, root) if args.tiny else (args.target, args.draft)
        session = Session(pick_backend(args.backend), target, draft, args.device, args.dtype)
        tok = session.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
                   for p in args.prompts]
        prompts = [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in prompts]
        session.run(prompts[0], baseline=True, max_new_tokens=16)  # warm-up: one-time costs are not timed
        for i, ids in enumerate(prompts):
            r = report_of(session.backend, *session.run(ids, baseline=True, block_size=args.block_size,
                                                        max_new_tokens=args.max_new_tokens))
            print(json.dumps({"bench": "decode", "backend": r["backend"], "prompt": i, "prompt_tokens": len(ids),
                              "tokens": r["num_tokens"], "tau": round(r["tau"], 3),
                              "dflash_tok_s": round(r["decode_tokens_per_s"], 2),
                              "baseline_tok_s": round(r["baseline_decode_tokens_per_s"], 2),
                              "speedup": round(r["speedup"] or 0.0, 3), "matches_baseline": r["matches_baseline"],
                              "first_divergence": r["first_divergence"]}), flush=True)

if __name__ == "__main__":
    from models.cli import run_cli

    run_cli(main)
