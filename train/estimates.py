"""What a run costs besides its steps, as the dry run (``train/plan.py``) estimates it: the time on each GPU kind
whose steps were measured (:data:`MEASURED_STEPS`, scaled by FLOPs per row), what regenerating the answers costs
and the memory its server needs beside training, and the disk offline features take; and the plan's lines that
print the first two.
"""

from __future__ import annotations

import math
from pathlib import Path

from models.config import DFlashConfig


# ----------------------------------------------------------------------------- how long a run takes
# Whole online training steps as measured (docs/performance.md, "Whole online step, H100 and H200"): random-weight
# targets of the recipe's shape, rows of 3072 tokens, 512 anchors, block 16, a 5-layer drafter, bf16, flex
# attention. Seconds per row: one optimizer step's time over its rows. A dry run takes the closest measurement on
# each card (the same recipe, else the nearest FLOPs per row; train.compile as the run has it where measured) and
# scales it by FLOPs per row: an estimate, as another shape reaches another share of the card's peak.
MEASURED_STEPS = (
    # card, recipe shape, train.compile, seconds per row, commit, command
    ("H100", "qwen3-8b", False, 0.296, "52d3549", "python -m train.bench --e2e qwen3-8b"),
    ("H100", "qwen3-8b", True, 0.221, "52d3549", "python -m train.bench --e2e qwen3-8b --compile"),
    ("H100", "qwen35-9b", False, 0.359, "52d3549", "python -m train.bench --e2e qwen35-9b"),
    ("H100", "qwen35-9b", True, 0.296, "52d3549", "python -m train.bench --e2e qwen35-9b --compile"),
    ("H200", "qwen35-9b", True, 0.973 / 4, "8a48cc6",
     "python -m train.bench --e2e qwen35-9b --compile --steps 3 --warmup 1"),
)
MEASURED_ROW_TOKENS = 3072


def row_flops(cfg, draft, active_b: float, tokens: float, online: bool | None = None) -> float:
    """Model FLOPs of one row: the drafter's forward and backward over its anchors' blocks (3 x forward), and with
    online features the target's forward over the row's ``tokens``."""
    q = cfg.train.anchors * draft.block_size
    online = cfg.features.mode == "online" if online is None else online
    return 3 * draft.flops_per_token(tokens / 2 + draft.block_size) * q + (2 * active_b * 1e9 * tokens if online else 0)


def _drafter_of(cfg, target):

    d = cfg.drafter
    return DFlashConfig.for_target(
        target, mask_token_id=d.mask_token_id or 0, num_hidden_layers=d.num_hidden_layers, num_taps=d.num_taps,
        target_layer_ids=d.target_layer_ids, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim, intermediate_size=d.intermediate_size,
        block_size=d.block_size, rope_theta=d.rope_theta, variant=d.variant)


def _measured_row_flops(recipe: str) -> float:
    """FLOPs of a row of the measured step: the recipe's shape facts (no download), rows of 3072 tokens, online."""
    from models.target_shape import TargetShape
    from train.config import load_config

    ref = load_config([f"recipe={recipe}"])
    t = ref.target
    target = TargetShape(hidden_size=t.hidden_size, vocab_size=t.vocab_size, num_layers=t.num_layers,
                         num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                         head_dim=t.head_dim, intermediate_size=t.intermediate_size, rope_theta=t.rope_theta)
    return row_flops(ref, _drafter_of(ref, target), t.active_params_b or t.params_b, MEASURED_ROW_TOKENS, online=True)


def compiles(value) -> bool:
    """Whether ``train.compile`` compiles on a GPU (true, or auto)."""
    return value is True or str(value).lower() in ("true", "auto", "on", "yes")


def time_estimates(cfg, draft, active_b: float, tokens_per_row: float, steps: int | None, processes: int,
                   exact: bool) -> list[dict]:
    """Per measured card: seconds per row and per step, and the run's time when its steps are known; none for a
    shape far smaller than the measured ones."""
    flops = row_flops(cfg, draft, active_b, tokens_per_row)
    compiled = compiles(cfg.train.compile)
    rows_per_step = cfg.train.batch_size * cfg.train.grad_accum
    out = []
    for card in dict.fromkeys(m[0] for m in MEASURED_STEPS):
        measured = [m for m in MEASURED_STEPS if m[0] == card]
        measured = [m for m in measured if m[2] == compiled] or measured
        ref_flops = {m[1]: _measured_row_flops(m[1]) for m in measured}
        ref = next((m for m in measured if m[1] == Path(cfg.recipe).stem), None) or \
            min(measured, key=lambda m: abs(math.log(ref_flops[m[1]] / flops)))
        if flops < ref_flops[ref[1]] / 100:  # a tiny shape: its steps are bound by kernel launches, not by FLOPs
            return []
        per_row = ref[3] * flops / ref_flops[ref[1]]
        out.append({"card": card, "seconds_per_row": round(per_row, 4),
                    "seconds_per_step": round(per_row * rows_per_step, 3),
                    "hours": round(steps * rows_per_step * per_row / 3600, 2) if steps else None,
                    # rows unknown: an epoch of 100k rows, spread over the processes
                    "hours_per_100k_rows": round(1e5 / processes * per_row / 3600, 2),
                    "gpus": processes, "exact_steps": exact or bool(cfg.train.max_steps),
                    "same_compile": ref[2] == compiled, "rows_known_length": exact,
                    "measured": {"recipe": ref[1], "compiled": ref[2], "seconds_per_row": round(ref[3], 4),
                                 "commit": ref[4], "command": ref[5]}})
    return out


# ----------------------------------------------------------------------------- regeneration, offline features
def regeneration_cost(cfg, shape: dict, params_b: float, conversations: int | None, prepared: bool,
                      training_gib: float, devices) -> dict | None:
    """Answers to generate (rows x data.regenerate_max_tokens at most) and the GPU memory the engine needs: the
    target's weights and the KV cache of the answers in flight (the layers that keep one, by the target's
    ``layer_types``; every layer when the config could not be read, an upper bound), beside training's when both
    share a GPU."""
    mode = cfg.data.regenerate
    if mode in (None, "", "none"):
        return None
    if prepared:
        return {"mode": mode, "note": "done: the data is prepared"}
    from data.regenerate import make_generator

    gib = 1024 ** 3
    M = cfg.data.regenerate_max_tokens
    in_flight = cfg.data.regenerate_batch_size if mode == "local" else make_generator.__kwdefaults__["concurrency"]
    heads = shape.get("num_attention_heads") or 1
    kv_heads = shape.get("num_key_value_heads") or heads
    head_dim = shape.get("head_dim") or shape["hidden_size"] // heads
    cached = shape.get("kv_cache_layers") or shape["num_hidden_layers"]  # unknown: every layer, an upper bound
    kv_per_token = 2 * cached * kv_heads * head_dim * 2  # K and V, bf16
    context = cfg.data.max_length + M
    weights = params_b * 1e9 * 2 / gib
    kv = in_flight * context * kv_per_token / gib
    server = weights + kv + 1.0  # + ~1 GiB of the engine's own buffers (CUDA graphs, activations)
    out = {"mode": mode, "answers": conversations, "max_new_tokens": M,
           "tokens": conversations * M if conversations else None, "in_flight": in_flight, "context": context,
           "weights_gib": round(weights, 1), "kv_cache_gib": round(kv, 1), "server_gib": round(server, 1),
           "with_training_gib": round(server + training_gib, 1), "kv_layers_known": bool(shape.get("kv_cache_layers"))}
    cap = devices[1] if devices else None
    if cap:
        out["gpu_gib"] = cap
        out["fits_beside_training"] = server + training_gib <= cap
        out["memory_fraction"] = math.ceil(server / cap * 20) / 20  # vLLM / SGLang take a share of the whole GPU
    return out


def feature_disk(cfg, taps: list[int], hidden: int, tokens: int | None, exact: bool) -> dict:
    """Disk a ``data.extract`` store of these rows takes: per token the tapped layers' hidden states (bf16, or
    fp8 with one bf16 scale per layer), the token columns (13 bytes) and, with ``--topk K``, K ids and log-probs."""
    per_100k = not tokens  # rows unknown: 100k rows of data.max_length tokens
    tokens = tokens or 100_000 * cfg.data.max_length
    gib = 1024 ** 3
    k = cfg.train.kl_topk
    return {"tokens": tokens, "tokens_exact": exact, "per_100k_rows": per_100k, "layers": list(taps),
            "bf16_gib": round(tokens * (len(taps) * hidden * 2 + 13) / gib, 1),
            "fp8_gib": round(tokens * (len(taps) * (hidden + 2) + 13) / gib, 1),
            "topk": k, "topk_gib": round(tokens * k * 6 / gib, 1)}


def _duration(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def print_time(times: list[dict], exact: bool) -> None:
    """The time estimate per card, and which measurement each comes from."""
    if not times:
        print("  time: not estimated (the shape is far smaller than the measured ones, whose steps are bound by FLOPs; "
              "a step this small is bound by kernel launches)")
        return
    gpus = times[0]["gpus"]
    where = f"on {gpus} GPU{'s' if gpus > 1 else ''} of each kind"
    if times[0]["hours"] is None:
        parts = [f"{t['card']} ~{t['seconds_per_step']:.2f} s a step, ~{_duration(t['hours_per_100k_rows'])} an "
                 "epoch of 100k rows" for t in times]
        print(f"  time (an estimate) {where}: {'; '.join(parts)} (the run's rows are unknown)")
    else:
        approx = "" if exact else " from estimated steps"
        parts = [f"{t['card']} ~{_duration(t['hours'])} (~{t['seconds_per_step']:.2f} s a step)" for t in times]
        print(f"  time (an estimate{approx}) {where}: {'; '.join(parts)}")
    if not times[0]["rows_known_length"]:
        print("    (rows taken at data.max_length tokens: shorter ones take less)")
    for t in times:
        m = t["measured"]
        kind = "compiled" if m["compiled"] else "eager"
        other = "" if t["same_compile"] else f"; no {'eager' if m['compiled'] else 'compiled'} step was measured there"
        print(f"    {t['card']}: the measured {m['recipe']} step ({kind}, {m['seconds_per_row']} s a row of "
              f"{MEASURED_ROW_TOKENS} tokens, {m['commit']}: {m['command']}; docs/performance.md) scaled by FLOPs "
              f"per row{other}")


def print_regeneration(r: dict | None) -> None:
    """What regenerating the answers costs, and the memory its engine needs beside training."""
    if not r:
        return
    if "note" in r:
        print(f"  regeneration ({r['mode']}): {r['note']}")
        return
    answers = (f"up to {r['answers']:,} answers x {r['max_new_tokens']} new tokens = {_count(r['tokens'])} tokens"
               if r["answers"] else f"up to {_count(1e5 * r['max_new_tokens'])} tokens per 100k answers of "
                                    f"{r['max_new_tokens']} new tokens (the source's rows are unknown)")
    at_most = "" if r["kv_layers_known"] else "at most "
    engine = (f"~{r['weights_gib']} GiB of weights + {at_most}~{r['kv_cache_gib']} GiB of KV cache ({r['in_flight']} "
              f"answers in flight x {r['context']} tokens) + ~1 GiB = {at_most}~{r['server_gib']} GiB")
    print(f"  regeneration ({r['mode']}): {answers}")
    if r["mode"] == "local":
        print(f"    in the training process, before training: the loaded target and {engine.split(' + ', 1)[1]}")
        return
    if r["mode"] in ("vllm", "sglang"):
        print(f"    the {r['mode']} server ({engine}) runs before training, with the GPU to itself (the loaded target "
              "moves to the CPU meanwhile)")
        return
    beside = (f"    a server sharing a GPU with training needs {engine}; with training's, "
              f"~{r['with_training_gib']} GiB on that GPU")
    if "gpu_gib" not in r:
        beside += " (devices=1x80 says whether it fits, and the memory share to give the server)"
    else:
        fits = (f": fits a {r['gpu_gib']:g} GiB GPU, give the server --gpu-memory-utilization {r['memory_fraction']} "
                f"(vLLM) or --mem-fraction-static {r['memory_fraction']} (SGLang)" if r["fits_beside_training"]
                else f": more than a {r['gpu_gib']:g} GiB GPU; serve it on another GPU, or let draftsmith start it "
                     "before training (data.regenerate=vllm or sglang)")
        beside += fits
    print(beside)
