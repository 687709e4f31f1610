"""``dry_run=true``: print what a run would do (sizes, tokens, steps, memory) and exit.

Nothing heavy is downloaded: the target's shape comes from a local ``config.json``, else from the
Hub's ``config.json`` alone (a few KB) when the Hub is reachable, else from the shape facts the
recipe carries (``target.num_layers``, ``target.hidden_size``, ...); the plan says which, and what
it could not fetch. Data size comes from a prepared data set's ``stats.json`` when one exists.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

TEXT_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "max_position_embeddings", "model_type")


def _hub_resolves() -> bool:
    """Whether the Hub endpoint's host name resolves (no name means no network: fail in milliseconds)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
        return True
    except (socket.gaierror, UnicodeError):
        return False


def _fetch_config(cfg) -> tuple[dict | None, str]:
    """(config dict, where it came from or why not)."""
    from train.tiny import parse_tiny

    path = cfg.target.path
    arch = parse_tiny(path)
    if arch:  # its shape is fixed in code: plan it as built
        from models.tiny import TINY_VOCAB, tiny_config
        from train.tiny import NUM_LAYERS

        return (tiny_config(arch, TINY_VOCAB, NUM_LAYERS).to_dict(),
                f"{path}: the tiny target built at train time ({NUM_LAYERS} layers)")
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return json.loads(local.read_text()), f"local {local}"
    from models.hub import is_hub_id

    if not is_hub_id(path):  # a local path (a typo, a folder not copied yet): not the Hub's network to blame
        what = "has no config.json" if local.parent.is_dir() else "does not exist"
        return None, f"the local folder {path} {what}; using the recipe's shape facts"
    offline = False
    try:
        from huggingface_hub import hf_hub_download

        # The plan only refines the recipe's facts: when the Hub's host does not even resolve, read
        # the cache alone instead of sitting through huggingface_hub's ~25 s of connection retries.
        offline = not _hub_resolves()
        f = hf_hub_download(path, "config.json", revision=cfg.target.revision, local_files_only=offline)
        return json.loads(Path(f).read_text()), f"Hub config.json of {path} (config only, no weights)"
    except Exception as e:  # offline, gated, unknown id: all mean "use the recipe's facts"
        reason = ("the Hub's host name does not resolve (no network?) and it is not in the local cache"
                  if offline else str(e).splitlines()[0])
        reason = textwrap.shorten(reason, 160, placeholder=" ...")  # whole words
        return None, (f"could not fetch config.json of {path} ({type(e).__name__}: {reason}); "
                      "using the recipe's shape facts")


def target_shape(cfg) -> tuple[dict, str]:
    t = cfg.target
    shape = {"num_hidden_layers": t.num_layers, "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
             "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
             "head_dim": t.head_dim, "vocab_size": t.vocab_size, "max_position_embeddings": t.max_position_embeddings,
             "model_type": t.model_type, "rope_theta": t.rope_theta}
    fetched, source = _fetch_config(cfg)
    if fetched:
        from models.config import TargetShape

        shape["rope_theta"] = TargetShape.from_config(fetched).rope_theta or shape["rope_theta"]
        text = fetched.get("text_config") or fetched  # Qwen3.5 multimodal checkpoints nest the text tower
        for k in TEXT_KEYS:
            if text.get(k) is not None:
                shape[k] = text[k]
        shape["model_type"] = fetched.get("model_type", shape["model_type"])
        if text.get("kv_lora_rank") and text.get("num_attention_heads"):  # latent attention: no K/V head width
            from models.config import mla_drafter_heads

            shape["num_key_value_heads"], shape["head_dim"] = mla_drafter_heads(text)
        if not shape.get("head_dim") and shape.get("hidden_size") and shape.get("num_attention_heads"):
            shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    return shape, source


def parse_devices(spec: str) -> tuple[int, float] | None:
    """``devices=8x80`` -> (8, 80.0) GPUs x GiB; empty -> this machine's GPUs, or None without one."""
    if spec:
        count, _, gib = spec.lower().replace("gib", "").replace("gb", "").partition("x")
        try:
            n, cap = int(count), float(gib)
        except ValueError:
            n, cap = 0, 0.0
        if n < 1 or cap <= 0:
            raise ValueError(f"devices={spec!r}: write COUNTxGiB, e.g. devices=8x80 for 8 GPUs of 80 GB")
        return n, cap
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.device_count(), round(torch.cuda.get_device_properties(0).total_memory / 1024 ** 3, 1)


GPU_GIB, NODE_GPUS, LARGE_GPU_GIB = 80, 8, 141  # the reference GPU and node (8 x 80 GB), and an H200


def placement(mem: dict, slack: float = 1.15) -> str:
    """Where the target goes, whatever GPUs this machine has: one 80 GB GPU, a node's GPUs (``target.device_map``),
    or, past one node of 8 x 80 GB, offline features extracted on larger nodes (the training processes then
    hold the embedding and LM head only)."""
    target, borrowed = mem["target_weights_gib"], mem["embedding_lm_head_gib"]
    rest = sum(v for k, v in mem.items() if k not in ("target_weights_gib", "embedding_lm_head_gib", "total_gib"))
    if (target + rest) * slack <= GPU_GIB:
        return f"the target (~{target:.0f} GiB of weights) and the drafter fit one {GPU_GIB} GB GPU"
    gpus = next((k for k in range(2, NODE_GPUS + 1) if (target / k + rest) * slack <= GPU_GIB), None)
    if gpus is not None:
        return (f"the target (~{target:.0f} GiB of weights) does not fit one {GPU_GIB} GB GPU: target.device_map=auto "
                f"spreads it over {gpus} or more GPUs of a node (one training process per node, the drafter on GPU 0; "
                f"devices={NODE_GPUS}x{GPU_GIB} plans it), or features.mode=offline (extracted once with "
                f"--device-map auto; training processes then hold {borrowed:.1f} GiB of it)")
    large = -(-target * slack // (LARGE_GPU_GIB * 0.9))
    return (f"the target (~{target:.0f} GiB of weights) does not fit one node of {NODE_GPUS} x {GPU_GIB} GB even "
            f"spread (target.device_map) beside the drafter: train on offline features (features.mode=offline). "
            f"Extract them on nodes whose GPUs hold the whole target (python -m data.extract --device-map auto, e.g. "
            f"{int(large)} or more {LARGE_GPU_GIB} GB GPUs; several such nodes extract in parallel, one process "
            f"each), then train on any GPUs: each process holds the target's embedding and LM head "
            f"({borrowed:.1f} GiB), the drafter and its optimizer state (eval.true_tau_prompts=0, or the main "
            "process loads the whole target for true tau)")


def device_plan(cfg, mem: dict, slack: float = 1.15) -> dict:
    """Memory per GPU for this layout, and what to change when it does not fit (before anything loads).

    One process per GPU holds the whole target and a drafter replica with its AdamW state and
    activations. With offline features a process loads only the target's embedding and LM head,
    except the main one when it generates for true tau (``train.setup.loads_whole_target``).
    ``target.device_map`` instead spreads the target over the node's GPUs, with the drafter on GPU 0.
    """
    from train.setup import borrows_target, loads_whole_target

    devices = parse_devices(cfg.devices)
    if devices is None:
        return {"count": 0, "note": "no GPU here: pass devices=COUNTxGiB (e.g. devices=8x80) to plan for a node"}
    n, cap = devices
    target, borrowed = mem["target_weights_gib"], mem["embedding_lm_head_gib"]
    rest = sum(v for k, v in mem.items() if k not in ("target_weights_gib", "embedding_lm_head_gib", "total_gib"))
    spread = bool(cfg.target.device_map)
    offline = borrows_target(cfg)
    if spread:
        per = [(target / n + rest) * slack] + [target / n * slack] * (n - 1)
        layout = f"1 process per node, target spread over its {n} GPUs (target.device_map), drafter on GPU 0"
    elif offline:
        main, others = (target if loads_whole_target(cfg, is_main, False) else borrowed for is_main in (True, False))
        per = [(main + rest) * slack] + [(others + rest) * slack] * (n - 1)
        layout = (f"{n} processes (one per GPU), each with a drafter replica and the target's embedding and LM head "
                  "(offline features)" + (", the whole target on GPU 0 for true tau" if main == target else ""))
    else:
        per = [(target + rest) * slack] * n
        layout = f"{n} processes (one per GPU), each with the whole target and a drafter replica"
    out = {"count": n, "gib_each": cap, "from": f"devices={cfg.devices}" if cfg.devices else "this machine",
           "layout": layout, "per_device_gib": [round(g, 1) for g in per], "fits": max(per) <= cap}
    if not out["fits"]:
        fixes = []
        spread_gib = (target / n + rest) * slack
        if offline and per[0] > cap >= per[-1]:
            fixes.append("eval.true_tau_prompts=0 (then no process loads the whole target; measure true tau after "
                         "training with python -m inference.validate)")
        if not spread and spread_gib <= cap:
            fixes.append(f"target.device_map=auto (one process per node spreads the target over its {n} GPUs: "
                         f"~{spread_gib:.1f} GiB on GPU 0)")
        if not offline and spread_gib > cap:  # not even spread over this node's GPUs, beside the drafter
            fixes.append(f"features.mode=offline with the features extracted on nodes that hold the whole target "
                         f"(~{target:.0f} GiB: python -m data.extract --device-map auto); then each process here "
                         f"holds its embedding and LM head ({borrowed:.1f} GiB)")
        fixes.append("more or larger GPUs, or less per GPU: train.batch_size, train.anchors, "
                     "train.grad_checkpointing=true, drafter.num_hidden_layers")
        worst = max(range(n), key=lambda i: per[i])
        out["warning"] = (f"does not fit: ~{per[worst]:.1f} GiB needed on GPU {worst}, which has {cap:g} GiB. "
                          "Use " + "; or ".join(fixes))
    return out


def plan(cfg) -> dict:
    shape, source = target_shape(cfg)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if not shape.get(k)]
    out: dict = {"recipe": cfg.recipe, "target": cfg.target.path, "target_shape_from": source}
    if missing:
        keys = " ".join(f"target.{k.replace('num_hidden_layers', 'num_layers')}=N" for k in missing)
        out["error"] = f"cannot plan: the target's {', '.join(missing)} unknown (set {keys})"
        return out
    from models.config import DFlashConfig, TargetShape
    from models.provenance import describe_objective, objective_of_run

    d, tr = cfg.drafter, cfg.train
    L, H, V = shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]
    facts = {k: v for k, v in shape.items() if k not in ("num_hidden_layers", "model_type")}
    target = TargetShape(num_layers=L, **{k: v for k, v in facts.items() if v is not None})
    # The same resolver as training; the mask token does not change the plan, so any valid row stands in.
    draft = DFlashConfig.for_target(
        target, mask_token_id=d.mask_token_id or 0, num_hidden_layers=d.num_hidden_layers, num_taps=d.num_taps,
        target_layer_ids=d.target_layer_ids, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim, intermediate_size=d.intermediate_size,
        block_size=d.block_size, rope_theta=d.rope_theta, variant=d.variant)
    heads, kv, hd, inter = (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim,
                            draft.intermediate_size)
    taps = draft.target_layer_ids
    B, N, S = d.block_size, tr.anchors, cfg.data.max_length
    n_draft = draft.num_parameters()
    params_b = cfg.target.params_b or (12 * L * H * H + 2 * V * H) / 1e9
    active_b = cfg.target.active_params_b or params_b

    # Data size: a prepared set's stats when present; else per-row figures only.
    prepared = Path(cfg.data.prepared) if cfg.data.prepared else cfg.resolved_out_dir() / "data"
    stats_file = prepared / "stats.json"
    rows = tokens = None
    if stats_file.is_file():
        stats = json.loads(stats_file.read_text())
        rows, tokens = stats.get("rows"), stats.get("tokens")
    rows_per_step = tr.batch_size * tr.grad_accum  # per process
    # Every process trains its own rows of a step: 8 GPUs take an epoch in an eighth of the steps of one.
    devices = parse_devices(cfg.devices)
    processes = 1 if cfg.target.device_map or devices is None else devices[0]
    steps = None
    if rows:
        from train.loop import make_schedule
        from train.setup import held_out_rows

        steps = make_schedule(cfg, rows - held_out_rows(cfg.data.eval_rows, rows), processes, 0).total_steps

    # Memory per GPU (bf16 target, fp32 drafter + AdamW, bf16 activations). Rough, on purpose.
    gib = 1024 ** 3
    q = N * B  # drafter query tokens per row
    mem = {
        "target_weights_gib": round(cfg.target.weights_gib or params_b * 1e9 * 2 / gib, 2),
        "embedding_lm_head_gib": round(2 * V * H * 2 / gib, 2),  # all that offline features load on most GPUs
        "drafter_weights_grads_adam_gib": round(n_draft * 16 / gib, 2),
        "features_gib": round(tr.batch_size * S * len(taps) * H * 2 / gib, 3),
        "drafter_activations_gib": round(tr.batch_size * d.num_hidden_layers * q * (12 * H + 3 * inter) * 2
                                         / (gib * (4 if tr.grad_checkpointing else 1)), 2),
        "lm_head_chunk_gib": round(min(tr.ce_chunk, q) * V * 4 * 3 / gib, 2),
    }
    mem["total_gib"] = round((sum(mem.values()) - mem["embedding_lm_head_gib"]) * 1.15, 1)  # + allocator slack
    draft_fwd = draft.flops_per_token(S / 2 + B)
    flops_row = 3 * draft_fwd * q + 2 * active_b * 1e9 * S  # drafter fwd+bwd + target fwd
    out.update({
        "target_shape": {k: shape.get(k) for k in TEXT_KEYS}, "target_params_b": params_b,
        "target_layer_ids": taps,
        "drafter": {"layers": d.num_hidden_layers, "hidden": H, "heads": heads, "kv_heads": kv, "head_dim": hd,
                    "intermediate": inter, "block_size": B, "params_m": round(n_draft / 1e6, 1),
                    "rope_theta": draft.rope_theta, "variant": draft.variant,
                    # per part (DFlash2: the convs and the selector), and forward FLOPs per block token
                    "params_m_by_part": {k: round(v / 1e6, 2) for k, v in draft.parameter_counts().items()},
                    "flops_per_token": draft_fwd},
        "objective": {"anchors_per_row": N, "weighting": describe_objective(objective_of_run(cfg.to_dict())),
                      "gamma": cfg.loss_weighting()["gamma"], "loss": tr.loss, "query_tokens_per_row": q,
                      "max_length": S},
        "data": {"source": cfg.data.source, "prepared": str(prepared), "rows": rows, "tokens": tokens,
                 "regenerate": cfg.data.regenerate, "thinking": cfg.data.thinking, "features": cfg.features.mode},
        "schedule": {"rows_per_step_per_process": rows_per_step, "processes": processes, "epochs": tr.epochs,
                     "steps": steps, "lr": tr.lr, "schedule": tr.schedule, "warmup_ratio": tr.warmup_ratio},
        "memory_per_gpu": mem,
        "placement": placement(mem),
        "devices": device_plan(cfg, mem),
        "tflops_per_row": round(flops_row / 1e12, 2),
    })
    if steps is None:
        out["schedule"]["note"] = (f"data not prepared yet ({stats_file} missing): steps = "
                                   f"epochs x rows / {rows_per_step * processes} rows per step")
    return out


def print_plan(cfg) -> dict:
    p = plan(cfg)
    print(f"dry run: recipe {p['recipe']!r}, target {p['target']}")
    print(f"  target shape from: {p['target_shape_from']}")
    if "error" in p:
        print(f"  {p['error']}")
    else:
        s = p["target_shape"]
        print(f"  target: {s['model_type']}, {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
              f"vocab {s['vocab_size']}, ~{p['target_params_b']:.1f}B params; taps {p['target_layer_ids']}")
        dr = p["drafter"]
        parts = dr["params_m_by_part"]
        extra = (f" (convs {parts['convs']}M, selector {parts['selector']}M; {dr['flops_per_token'] / 1e9:.3g} "
                 "GFLOPs per block token with both)") if dr["variant"] == "dflash2" else ""
        print(f"  drafter: {dr['variant']}, {dr['layers']} layers x hidden {dr['hidden']} ({dr['heads']} heads / "
              f"{dr['kv_heads']} kv x {dr['head_dim']}, mlp {dr['intermediate']}), block {dr['block_size']}, "
              f"RoPE base {dr['rope_theta']:g}, {dr['params_m']}M params{extra}")
        o = p["objective"]
        print(f"  objective: {o['anchors_per_row']} anchors/row, {o['weighting']}, loss {o['loss']}, "
              f"{o['query_tokens_per_row']} query tokens/row, max length {o['max_length']}")
        dt = p["data"]
        print(f"  data: {dt['source']} -> {dt['prepared']} (rows {dt['rows']}, tokens {dt['tokens']}), "
              f"regenerate {dt['regenerate']}, thinking {dt['thinking']}, features {dt['features']}")
        sc = p["schedule"]
        print(f"  schedule: {sc['epochs']} epochs, steps {sc['steps']} ({sc['processes']} process(es) x "
              f"{sc['rows_per_step_per_process']} rows per step), lr {sc['lr']} {sc['schedule']}, warmup "
              f"{sc['warmup_ratio']:.0%}" + (f" ({sc['note']})" if "note" in sc else ""))
        m = p["memory_per_gpu"]
        # the parts for one process holding the whole target; the devices line says what each GPU gets
        print(f"  memory parts (whole target in one process ~{m['total_gib']} GiB): "
              + ", ".join(f"{k} {v}" for k, v in m.items() if k != "total_gib"))
        print(f"  placement: {p['placement']}")
        dv = p["devices"]
        if not dv["count"]:
            print(f"  devices: {dv['note']}")
        else:
            per = dv["per_device_gib"]
            load = f"~{per[0]} GiB each" if len(set(per)) == 1 else \
                f"GPU 0 ~{per[0]} GiB, GPUs 1-{len(per) - 1} ~{per[1]} GiB each"
            print(f"  devices: {dv['count']} x {dv['gib_each']:g} GiB ({dv['from']}): {dv['layout']}: {load}"
                  + ("" if dv["fits"] else " (DOES NOT FIT)"))
            if "warning" in dv:
                print(f"  warning: {dv['warning']}")
        print(f"  compute: {p['tflops_per_row']} TFLOPs per row (drafter fwd+bwd + target fwd)")
    print(json.dumps({"plan": p}))
    return p
