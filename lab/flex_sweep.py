"""Time the drafter's flex attention backward under several tiles, and pick the fastest that computes the same.

    python -m lab.flex_sweep --e2e qwen35-9b                      # the recipe's shape, the built-in candidates
    python -m lab.flex_sweep --e2e qwen3-8b 64,64,64,64,2,8 torch  # these candidates
    python -m lab.flex_sweep --heads 32 --kv-heads 8 --head-dim 128 --seq 3072 --anchors 512 --block 16

At ``train.bench``'s drafter shape (its flags and defaults), or ``--e2e RECIPE``'s (the recipe's target built on
the meta device: only its shape is read), on one mask drawn as training draws it, each candidate
(``models/flex_options.py`` format; ``torch`` = torch's own choice) is compiled afresh and timed forward
and forward + backward. Its gradients are held against torch's tiles, so a tile that computes something
else is reported, never chosen. One JSON line per candidate, then the best; give the best to
``train.flex_backward=`` (or ``python -m train.bench --flex-backward``) for the same GPU and head dim, and
to ``models/flex_options.py``'s measured table. CUDA only.
"""

from __future__ import annotations

import argparse
import json

import torch

from data.bench import check_at_least
from models.flex_options import format_tiles, kernel_options, parse_flex_backward
from models.random_target import recipe_spec
from train.bench import e2e_setup, random_rows
from train.blocks import draw_blocks, flex_block_mask

# Candidates by head dim. At head_dim 256 a 64-row tile's fp32 gradient accumulators (64 x 256 for
# dK and dV each) overflow 4 warps' registers: more warps, or 32-row tiles.
CANDIDATES_LARGE_HEAD = ["torch", "64,64,64,64,1,8", "64,64,64,64,2,8", "32,64,64,32,2,8", "32,64,64,32,2,4",
                         "32,32,32,32,2,4", "32,32,32,32,3,4", "16,32,32,16,3,4"]
CANDIDATES = ["torch", "64,128,128,64,3,8", "64,128,128,64,2,8", "64,64,64,64,3,4", "32,128,128,32,3,4",
              "32,64,64,32,3,4", "64,64,64,64,2,8"]
GRAD_TOLERANCE = 2e-2  # relative to the largest reference gradient; bf16 accumulation orders differ


def parse_candidates(texts: list[str]) -> list[tuple[int, ...] | None]:
    """Each candidate's tiles (None: torch's own); a malformed one, or ``auto``, raises."""
    out = []
    for text in texts:
        parsed = parse_flex_backward(text)
        if parsed == "auto":
            raise ValueError("auto is not a candidate: give tiles M1,N1,M2,N2,STAGES,WARPS (or torch); finding what "
                             "auto should mean is what the sweep is for")
        out.append(None if parsed == "torch" else parsed)
    return out


def candidates_for(head_dim: int, given: list[str]) -> list[tuple[int, ...] | None]:
    """Parsed candidates, torch's own first (the reference the others' gradients are held to)."""
    out: list[tuple[int, ...] | None] = [None]
    for tiles in parse_candidates(given or (CANDIDATES_LARGE_HEAD if head_dim > 128 else CANDIDATES)):
        if tiles not in out:
            out.append(tiles)
    return out


def _time(fn, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def sweep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, keys: int, candidates: list, steps: int,
          info: dict) -> list[dict]:
    """One row per candidate (printed as it finishes); ``keys``: (query, key) pairs the mask lets through."""
    from torch.nn.attention.flex_attention import flex_attention

    heads, head_dim = q.shape[1], q.shape[-1]
    fwd_flops = 4 * heads * head_dim * keys * q.shape[0]  # QK^T and PV
    grad_out = torch.randn_like(q)
    rows, reference = [], None
    for tiles in candidates:
        row = {"bench": "flex_sweep", **info, "tiles": format_tiles(tiles)}
        torch._dynamo.reset()  # a fresh compile: past dynamo's recompile limit it would fall back to eager
        fn = torch.compile(flex_attention)
        extra = {"kernel_options": kernel_options(tiles)} if tiles else {}

        def forward():
            return fn(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], **extra)

        def both():
            q.grad = k.grad = v.grad = None
            forward().backward(grad_out)

        try:
            both()
            both()  # compiled and autotuned; the allocator warm
            grads = [t.grad.float() for t in (q, k, v)]
            fwd_ms, both_ms = _time(forward, steps), _time(both, steps)
        except Exception as e:  # a tile that does not fit this GPU (shared memory) fails to compile
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        if reference is None:
            reference = grads
        err = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for g, r in zip(grads, reference))
        bwd_ms = both_ms - fwd_ms
        row.update(fwd_ms=round(fwd_ms, 3), bwd_ms=round(bwd_ms, 3), fwd_bwd_ms=round(both_ms, 3),
                   bwd_over_fwd=round(bwd_ms / fwd_ms, 2), fwd_tflops=round(fwd_flops / fwd_ms / 1e9, 1),
                   bwd_tflops=round(2.5 * fwd_flops / bwd_ms / 1e9, 1), grad_rel_err=float(f"{err:.2e}"),
                   same_grads=err <= GRAD_TOLERANCE)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def best(rows: list[dict]) -> dict | None:
    """The fastest forward + backward among the candidates whose gradients match torch's tiles."""
    ok = [r for r in rows if r.get("same_grads")]
    if not ok:
        return None
    win = min(ok, key=lambda r: r["fwd_bwd_ms"])
    base = next((r for r in ok if r["tiles"] == "torch"), None)
    out = {"bench": "flex_sweep_best", "tiles": win["tiles"], "fwd_bwd_ms": win["fwd_bwd_ms"]}
    if base:
        out["torch_fwd_bwd_ms"] = base["fwd_bwd_ms"]
        out["speedup_vs_torch"] = round(base["fwd_bwd_ms"] / win["fwd_bwd_ms"], 3)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The sweep's flags, checked in one line each before anything is built."""
    p = argparse.ArgumentParser(prog="python -m lab.flex_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tiles", nargs="*", metavar="TILES",
                   help="candidates, M1,N1,M2,N2,STAGES,WARPS or torch (none: a built-in list for the head dim)")
    p.add_argument("--e2e", metavar="RECIPE", default=None,
                   help="the drafter attention's shape of this recipe (qwen3-8b, qwen35-9b, ...; its target is built "
                        "on the meta device, no weights) (default: the flags below)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--head-dim", type=int, default=16, help="head dimension (default 16)")
    p.add_argument("--seq", type=int, default=256, help="context tokens per row (default 256; --e2e: the recipe's)")
    p.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    p.add_argument("--anchors", type=int, default=32, help="anchors per row (default 32; --e2e: the recipe's)")
    p.add_argument("--block", type=int, default=8, help="block size (default 8; --e2e: the recipe's)")
    p.add_argument("--steps", type=int, default=10, help="timed calls per candidate (default 10)")
    # what train.bench's e2e_setup reads besides the flags above (the drafter's depth and taps do not matter here)
    p.set_defaults(vocab=288, taps=3, layers=2, target_layers=None, grad_accum=None)
    a = p.parse_args(argv)
    check_at_least(p, a, heads=1, kv_heads=1, head_dim=2, seq=1, batch=1, anchors=1, block=2, steps=1)
    if a.head_dim % 2:
        p.error(f"--head-dim {a.head_dim}: use an even size (RoPE rotates pairs)")
    try:
        parse_candidates(a.tiles)
    except ValueError as e:
        p.error(str(e))
    a.spec = None
    if a.e2e:
        shape = [f"--{n.replace('_', '-')}" for n in ("heads", "kv_heads", "head_dim")
                 if getattr(a, n) != p.get_default(n)]
        if shape:
            p.error(f"{', '.join(shape)} with --e2e: the attention takes the recipe target's shape; leave them out, or "
                    "drop --e2e to sweep that shape")
        a.spec = recipe_spec(a.e2e)  # an unknown recipe or one without a target shape: one line, before any build
    if not torch.cuda.is_available():
        raise ValueError("lab.flex_sweep times compiled flex attention kernels: it needs a CUDA GPU (none found)")
    return a


def main(argv: list[str] | None = None) -> None:
    """q/k/v of the drafter's attention at the drawn blocks' shape, random values; one line per candidate."""
    a = parse(argv)
    if a.e2e:
        e2e_setup(a, argv, a.spec, "meta")  # the shapes only: no weights
    anchors = a.anchors[0] if isinstance(a.anchors, list) else a.anchors
    device = torch.device("cuda")
    ids, lm, doc, pos = random_rows(a, device)
    blocks = draw_blocks(ids, lm, doc, pos, anchors, a.block, a.vocab - 1, torch.Generator().manual_seed(0))
    candidates = candidates_for(a.head_dim, a.tiles)
    n = blocks.anchors.shape[1]
    queries, context = n * a.block, a.seq
    g = torch.Generator(device).manual_seed(0)

    def leaf(heads: int, length: int) -> torch.Tensor:
        x = torch.randn(a.batch, heads, length, a.head_dim, device=device, dtype=torch.bfloat16, generator=g)
        return x.requires_grad_(True)

    q, k, v = leaf(a.heads, queries), leaf(a.kv_heads, context + queries), leaf(a.kv_heads, context + queries)
    mask = flex_block_mask(blocks, doc)
    keys = int(((blocks.anchors + a.block) * blocks.valid).sum().item()) * a.block
    capability = ".".join(map(str, torch.cuda.get_device_capability()))
    info = {"device": torch.cuda.get_device_name(), "capability": capability, "recipe": a.e2e, "heads": a.heads,
            "kv_heads": a.kv_heads, "head_dim": a.head_dim, "batch": a.batch,
            "seq": a.seq, "anchors": n, "block": a.block}
    rows = sweep(q, k, v, mask, keys, candidates, a.steps, info)
    win = best(rows)
    print(json.dumps(win or {"bench": "flex_sweep_best", "tiles": None,
                             "error": "no candidate compiled with gradients equal to torch's tiles"}), flush=True)


if __name__ == "__main__":
    from models.support import run_cli

    run_cli(main)
