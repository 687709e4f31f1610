"""Training-step speed: one JSON line per configuration (random weights; speed only, tests run toy sizes).

    python -m train.bench                                   # CPU, tiny shape
    python -m train.bench --hidden 4096 --layers 5 --heads 32 --kv-heads 8 --head-dim 128 \\
        --intermediate 12288 --vocab 151936 --seq 3072 --anchors 512 --block 16   # Qwen3-8B drafter on CUDA

    python -m train.bench --e2e qwen3-8b        # whole online step: random Qwen3-8B target + recipe drafter
    python -m train.bench --e2e qwen35-9b --batch 2
    python -m train.bench --e2e qwen3-8b --compile          # as train.compile=true (drafter + target layers)
    python -m train.bench --e2e tiny            # the same plumbing on the CPU: tiny target, tiny recipe's drafter

Times the drafter's full training step (mask build, forward, chunked LM head + CE, backward, the
acceptance counts; gradient clipping and the AdamW step once per ``--grad-accum`` micro-batches) on
random context features, as in ``train/distill.py`` (flex attention on CUDA, dense on CPU; bf16
autocast on CUDA). ``--e2e RECIPE`` times the whole online step instead: a random-weight target of
the recipe's exact shape (bf16, built on the device) runs the tapped forward
(``TargetModel.forward``: stops after the deepest tap, no logits) on random rows, and its features
feed the recipe's drafter (paper recipes: 5 layers, 5 taps, block 16, seq 3072, 512 anchors, 4
micro-batches per optimizer step; each of these flags given overrides; the drafter's width, heads,
MLP and vocabulary are the target's, and their flags are refused). Full-size recipes need a CUDA
GPU; ``tiny`` runs anywhere. ``step_s`` is one optimizer step.
Model FLOPs then add ``2 x parameters of the target layers that ran x tokens``.
Reports tokens/s (context tokens of the rows), anchors/s, peak memory, on CUDA model FLOPs
utilisation against the device's bf16 peak, and one ``train_parts`` line: each part of one step
timed alone with device syncs (mask build, the generic ``create_block_mask`` for comparison,
target forward, drafter forward + loss, backward, optimizer step). ``--profile N`` adds one
``profile`` line: the N kernels of most device time in one more step (operators on the CPU), and
``busy_share``: that step's kernel time over the timed step's (1 - busy_share: the GPU idle,
waiting for the host). ``--flex-backward`` takes the tiles a sweep found (``python -m lab.flex_sweep``,
from a checkout).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from train.flops import DrafterShape, drafter_flops, peak_tflops, tapped_parameters, target_flops
from models.config import DFlashConfig, default_layer_ids
from models.drafter import DFlashDraftModel
from models.flex_options import parse_flex_backward
from train import block_mask
from train.block_mask import documents_contiguous
from train.blocks import attention_masks, draw_blocks, flex_block_mask
from train.objective import block_loss, drafter_forward, simulated_acceptance


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=64,
                   help="drafter hidden size (and of the random context features) (default 64)")
    p.add_argument("--layers", type=int, default=2, help="drafter decoder layers (default 2; --e2e: the recipe's)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--head-dim", type=int, default=16, help="head dimension (default 16)")
    p.add_argument("--intermediate", type=int, default=128, help="MLP intermediate size (default 128)")
    p.add_argument("--vocab", type=int, default=288, help="vocabulary (LM head rows) (default 288)")
    p.add_argument("--taps", type=int, default=3, help="tapped target layers (default 3; --e2e: the recipe's)")
    p.add_argument("--seq", type=int, default=256,
                   help="tokens per row (default 256; --e2e: the recipe's data.max_length)")
    p.add_argument("--batch", type=int, default=1, help="rows per micro-batch (default 1)")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches (forward + backward each) per optimizer step, as train.grad_accum "
                        "(default 1; --e2e: the recipe's)")
    p.add_argument("--anchors", type=int, nargs="+", default=[32],
                   help="anchors per row; several values give one line each (default 32; --e2e: the recipe's)")
    p.add_argument("--block", type=int, default=8, help="block size (default 8; --e2e: the recipe's)")
    p.add_argument("--ce-chunk", type=int, default=2048, help="LM head + CE chunk (query tokens) (default 2048)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first (compile, autotune, allocator) (default 3)")
    p.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                   help="flex (CUDA only), dense, auto: flex on CUDA, dense on CPU (default auto)")
    p.add_argument("--e2e", metavar="RECIPE", default=None,
                   help="time the whole online step with a random target of this recipe's shape and its drafter "
                        "(qwen3-8b, qwen35-9b, ...: CUDA only; tiny runs on the CPU) (default: off)")
    p.add_argument("--compile", nargs="?", const="all", choices=["all", "drafter"], default=None,
                   help="as train.compile=true: compile the drafter's layers and, with --e2e, the target's; "
                        "'--compile drafter' leaves the target eager (default: off)")
    p.add_argument("--target-mixer", choices=["fused", "own"], default="fused",
                   help="with --compile and a Qwen3.5 --e2e target: each GatedDeltaNet layer as two compiled halves "
                        "around its chunked kernel (fused, as training runs them), or its mixer's own transformers "
                        "forward with its norms and MLP compiled one by one (own: the before of a before/after) "
                        "(default fused)")
    p.add_argument("--target-layers", type=int, default=None,
                   help="--e2e: fewer target layers (smoke tests) (default: the recipe's)")
    p.add_argument("--flex-backward", default="auto", metavar="TILES",
                   help="flex attention's backward tiles: auto (measured best for this GPU and head dim, else "
                        "torch's), torch, or M1,N1,M2,N2,STAGES,WARPS as python -m lab.flex_sweep prints them "
                        "(default auto)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timing, profile one more step and print its N most expensive kernels (GPU) or "
                        "operators (CPU) as a 'profile' line (default 0: off)")
    return p


def _checked(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict | None:
    """Refuse bad flags in one line each, before anything is built; the --e2e recipe's spec."""
    from data.bench import check_at_least  # start-up time (train.bench --help)
    from models.random_target import recipe_runs_on_cpu, recipe_spec  # start-up time (train.bench --help)

    spec = None
    # vocab 2: the last id is the mask token, random ids are drawn below it
    check_at_least(p, a, hidden=1, layers=1, heads=1, kv_heads=1, head_dim=2, intermediate=1, vocab=2, taps=1,
                   seq=1, batch=1, grad_accum=1, anchors=1, block=2, ce_chunk=1, steps=1, warmup=0, target_layers=1,
                   profile=0)
    if a.head_dim % 2:
        p.error(f"--head-dim {a.head_dim}: use an even size (RoPE rotates pairs)")
    if a.attention == "flex" and not torch.cuda.is_available():
        raise ValueError("--attention flex needs a CUDA GPU (flex attention has no CPU backward): "
                         "use --attention dense (or auto) on the CPU")

    try:
        parse_flex_backward(a.flex_backward)
    except ValueError as e:
        p.error(str(e))
    if a.e2e:
        # the drafter of an --e2e run takes the target's shape: these flags were replaced by it without a word
        shape = [f"--{n.replace('_', '-')}" for n in ("hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                                       "vocab") if getattr(a, n) != p.get_default(n)]
        if shape:
            p.error(f"{', '.join(shape)} with --e2e: the drafter takes the target's shape (hidden size, heads, KV "
                    "heads, head dim, MLP, vocabulary); leave them out, or drop --e2e to time a drafter of that shape")
        spec = recipe_spec(a.e2e)  # an unknown recipe or one without a target shape: one line, before any build
        if not torch.cuda.is_available() and not recipe_runs_on_cpu(spec):
            size = f"{spec['target']['params_b']}B-parameter" if "params_b" in spec["target"] else "full-size"
            raise ValueError(f"--e2e {a.e2e} builds its {size} target: it needs a CUDA GPU (none found). On the CPU "
                             "run --e2e tiny, or leave --e2e out to time the drafter step alone")
    return spec


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    a = p.parse_args(argv)
    spec = _checked(p, a)
    target = e2e_setup(a, argv, spec) if a.e2e else None
    a.grad_accum = a.grad_accum or 1
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    use_flex = a.attention == "flex" or (a.attention == "auto" and cuda)
    torch.manual_seed(0)
    H = a.hidden
    # The same resolver training and the dry-run plan use, with the bench's flags as overrides.
    cfg = DFlashConfig.for_target(hidden_size=H, vocab_size=a.vocab, num_target_layers=max(a.taps + 4, 8),
                                  mask_token_id=a.vocab - 1, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                  num_key_value_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate,
                                  target_layer_ids=list(range(1, a.taps + 1)), block_size=a.block)
    dtype = torch.bfloat16 if cuda else torch.float32
    drafter, embed, head, opt = _models(a, cfg, target, device, dtype)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    for n_anchors in a.anchors:
        ids, lm, doc, pos = random_rows(a, device)
        feats = torch.randn(a.batch, a.seq, a.taps * H, device=device, dtype=dtype)
        forward_flops = target_flops(a.target_params, a.seq * a.batch) if target is not None else 0

        def features(i: int) -> torch.Tensor:
            if target is None:
                return feats
            rows = torch.randint(0, a.vocab - 1, (a.batch, a.seq), device=device,
                                 generator=torch.Generator(device).manual_seed(i))
            return target.forward(rows, a.layer_ids, with_logits=False).features

        host = tuple(t.cpu() for t in (ids, lm, doc, pos))  # train/loop.py draws on its rows' host copy
        contiguous = documents_contiguous(host[2])

        def step(i: int) -> list:
            """One optimizer step of ``grad_accum`` micro-batches, as train/loop.py runs it; each one's
            blocks and scored count come back for the FLOPs, counted after the timing (a host read
            here would stall the queue)."""
            done = []
            for j in range(a.grad_accum):
                seed = i * a.grad_accum + j
                blocks = draw_blocks(*host, n_anchors, a.block, cfg.mask_token_id,
                                     torch.Generator().manual_seed(seed)).to(device)
                f = features(seed)
                mask = attention_masks(cfg, blocks, doc, pos, use_flex, contiguous)
                with autocast:
                    hidden = drafter_forward(drafter, embed, blocks, f, pos, mask)
                    out = block_loss(hidden, blocks, head.weight, 4.0, chunk=a.ce_chunk)
                (out.loss / a.grad_accum).backward()
                simulated_acceptance(out.correct, out.label_mask, out.valid)  # the step's logged counts
                done.append((blocks, out.scored))
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)  # train.clip's default
            opt.step()
            opt.zero_grad(set_to_none=True)
            return done

        for i in range(a.warmup):
            step(i)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        done = [micro for i in range(a.steps) for micro in step(100 + i)]
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        row = _result_row(a, target, use_flex, n_anchors, dt, done, forward_flops)
        print(json.dumps(row), flush=True)
        print(json.dumps({"bench": "train_parts", "recipe": a.e2e, "compile": a.compile, "anchors": n_anchors,
                          "batch": a.batch,
                          **_parts(a, cfg, drafter, embed, head, opt, autocast, features, host, doc, pos,
                                   n_anchors, use_flex, device)}), flush=True)
        if a.profile:
            from models.support import top_ops

            prof = top_ops(lambda: step(200), a.profile)
            # kernel time over the timed (unprofiled) step: 1 - busy_share is what the GPU sat idle, waiting
            # for the host (a read back, a launch gap)
            busy = round(prof["total_ms_per_call"] / (dt / a.steps * 1e3), 4)
            print(json.dumps({"bench": "profile", "what": "train_e2e" if target is not None else "train_step",
                              "recipe": a.e2e, "compile": a.compile, "anchors": n_anchors, "batch": a.batch,
                              "busy_share": busy, **prof}), flush=True)


def _models(a, cfg, target, device: torch.device, dtype: torch.dtype):
    """The drafter (compiled as asked, with the target's), the frozen embedding and LM head it trains
    against (the target's with --e2e, random ones otherwise), and AdamW as train/distill.py builds it."""
    drafter = DFlashDraftModel(cfg).to(device).set_flex_backward(a.flex_backward)
    if a.compile:
        drafter.compile_layers()
    if a.compile == "all" and target is not None:
        target.compile_layers(fuse_mixer=a.target_mixer == "fused")
    if target is not None:
        cfg.target_layer_ids = a.layer_ids
        embed, head = target.embed_tokens, target.lm_head
    else:
        embed = torch.nn.Embedding(a.vocab, a.hidden).to(device, dtype).requires_grad_(False)
        head = torch.nn.Linear(a.hidden, a.vocab, bias=False).to(device, dtype).requires_grad_(False)
    drafter.bind_target(embed, head)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=device.type == "cuda")
    return drafter, embed, head, opt


def _result_row(a, target, use_flex: bool, n_anchors: int, dt: float, done: list, forward_flops: float) -> dict:
    """The JSON line of one timed run: ``done`` holds each micro-batch's (blocks, scored slots)."""
    cuda = torch.cuda.is_available()
    blocks_done = sum(int(b.valid.sum()) for b, _ in done)
    flops = sum(step_flops(a, b, scored) + forward_flops for b, scored in done)
    row = {"bench": "train_e2e" if target is not None else "train_step", "recipe": a.e2e,
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "attention": "flex" if use_flex else "dense", "compile": a.compile,
           **({"target_mixer": a.target_mixer} if target is not None and target.is_hybrid else {}),
           "hidden": a.hidden, "layers": a.layers, "seq": a.seq, "batch": a.batch, "grad_accum": a.grad_accum,
           "anchors": n_anchors, "block": a.block,
           "steps": a.steps, "step_s": round(dt / a.steps, 4),
           "tokens_per_s": round(a.seq * a.batch * a.grad_accum * a.steps / dt, 1),
           # tflops to 4 significant digits: a tiny CPU shape's is ~1e-4, which 3 decimals round to 0
           "anchors_per_s": round(blocks_done / dt, 1), "tflops": float(f"{flops / dt / 1e12:.4g}")}
    if cuda:
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 1024 ** 3, 2)
        name = torch.cuda.get_device_name()
        peak = peak_tflops(name)
        row["mfu"] = round(flops / dt / 1e12 / peak, 4) if peak else None
        row["peak_tflops"] = peak  # what mfu divides by
    else:
        row["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2, 2)
    return row


def step_flops(a, blocks, scored: int) -> float:
    """Model FLOPs of one drafter micro-batch at the bench's shape (``train.flops.drafter_flops``, as training
    logs them)."""
    shape = DrafterShape(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                         intermediate=a.intermediate, taps=a.taps, vocab=a.vocab, block=a.block)
    return drafter_flops(shape, blocks, scored, a.seq * a.batch)


def random_rows(a, device):
    """Random token rows: ids, loss mask (a prompt, then the answer), document ids, positions."""
    ids = torch.randint(0, a.vocab - 1, (a.batch, a.seq), device=device)
    lm = torch.ones_like(ids)
    lm[:, : a.seq // 4] = 0
    doc = torch.zeros_like(ids)
    pos = torch.arange(a.seq, device=device).expand(a.batch, -1)
    return ids, lm, doc, pos


def e2e_setup(a, argv, spec: dict, device: str | None = None):
    """Recipe shapes for ``--e2e``: the drafter's from the target's, the rest from the recipe (paper
    recipes: 5 layers, 5 taps, block 16, seq 3072, 512 anchors) unless a flag gives it. ``device``
    ``meta``: the target's shapes alone, no weights (``lab.flex_sweep``)."""
    from models.random_target import recipe_target  # start-up time (train.bench --help)

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    drafter, data, train = spec.get("drafter") or {}, spec.get("data") or {}, spec.get("train") or {}
    given = set(x.split("=")[0] for x in (sys.argv[1:] if argv is None else argv) if x.startswith("--"))
    taps = a.taps if "--taps" in given else drafter.get("num_taps", 5)
    # checked before the target is built: a CPU tiny build is quick, a CUDA 8B one is not
    target_layers = a.target_layers or spec["target"].get("num_layers") or 6  # 6: tiny:<arch>
    layer_ids = default_layer_ids(target_layers, taps)
    target = recipe_target(a.e2e, device, torch.bfloat16 if device != "cpu" else torch.float32,
                           num_layers=a.target_layers)
    c = target.config
    a.hidden, a.heads, a.kv_heads = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    a.head_dim, a.intermediate, a.vocab = c.head_dim, c.intermediate_size, target.vocab_size
    a.taps, a.layer_ids = taps, layer_ids
    if "--layers" not in given:
        a.layers = drafter.get("num_hidden_layers", 5)
    if "--seq" not in given:
        a.seq = data.get("max_length", 3072)
    if "--anchors" not in given:
        a.anchors = [train.get("anchors", 512)]
    if "--block" not in given:
        a.block = drafter.get("block_size", 16)
    if a.grad_accum is None:
        a.grad_accum = train.get("grad_accum", 1)
    a.target_params = tapped_parameters(target, a.layer_ids)  # the tapped forward stops after the deepest tap
    return target


def _parts(a, cfg, drafter, embed, head, opt, autocast, features, host, doc, pos, n_anchors, use_flex,
           device) -> dict:
    """Each part of one step alone, with device syncs around it (seconds)."""
    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return r, round(time.perf_counter() - t0, 4)

    out = {}
    blocks, out["draw_blocks_s"] = timed(lambda: draw_blocks(*host, n_anchors, a.block, cfg.mask_token_id,
                                                             torch.Generator().manual_seed(7)).to(device))
    f, out["target_forward_s"] = timed(lambda: features(7))
    mask, out["mask_s"] = timed(lambda: attention_masks(cfg, blocks, doc, pos, use_flex))
    if use_flex:
        real, block_mask.direct_block_mask = block_mask.direct_block_mask, lambda *x: None  # the generic builder
        try:
            _, out["mask_generic_s"] = timed(lambda: flex_block_mask(blocks, doc))
        finally:
            block_mask.direct_block_mask = real

    def fwd():
        with autocast:
            return block_loss(drafter_forward(drafter, embed, blocks, f, pos, mask), blocks, head.weight, 4.0,
                              chunk=a.ce_chunk)
    loss, out["drafter_forward_loss_s"] = timed(fwd)
    _, out["backward_s"] = timed(lambda: loss.loss.backward())
    _, out["optimizer_s"] = timed(lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
    out["sum_s"] = round(sum(v for k, v in out.items() if k != "mask_generic_s"), 4)
    return out


if __name__ == "__main__":
    from models.support import run_cli

    run_cli(main)
