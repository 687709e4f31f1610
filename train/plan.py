"""``dry_run=true``: print what a run would do (sizes, tokens, steps, memory) and exit.

Nothing heavy is downloaded: the target's shape comes from a local ``config.json``, else from the
Hub's ``config.json`` alone (a few KB) when the Hub is reachable, else from the shape facts the
recipe carries (``target.num_layers``, ``target.hidden_size``, ...); the plan says which, and what
it could not fetch. Data size comes from a prepared data set's ``stats.json`` when one exists, else from
the source: a local file is counted, a Hub data set's row count read from its metadata when the Hub is
reachable. From those: steps, epochs and tokens, memory per GPU and where the target goes; and, from
``train/estimates.py``, the time a run takes on the GPUs whose steps were measured (scaled by FLOPs per row:
an estimate), what regenerating the answers costs, and the memory a regeneration server needs beside
training, and the disk offline features take.

What a run and its plan decide alike lives here, and training imports it: the schedule
(``make_schedule``), the held-out rows, and which parts of the target a process loads. So the plan
needs none of the training modules (no datasets, accelerate or transformers' model code to import).
"""

from __future__ import annotations

import json
import math
import socket
import textwrap
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import huggingface_hub  # hf_hub_download looked up at each call (tests stand in for it)
import torch
from huggingface_hub import constants

from models.hub import is_hub_id
from models.provenance import describe_objective, objective_of_run
from models.quantization import parse_quantization
from models.target_shape import TargetShape
from train.estimates import (_count, _drafter_of, feature_disk, print_regeneration, print_time, regeneration_cost,
                             row_flops, time_estimates)
from train.rng import epoch_order

TEXT_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "max_position_embeddings", "model_type")


# ----------------------------------------------------------------------------- what a run loads and how long
# it runs (training decides by the same functions: train/setup.py, train/loop.py)
@dataclass
class Schedule:
    micro_per_epoch: int  # micro-batches per process per epoch
    steps_per_epoch: int
    total_steps: int


def make_schedule(cfg, n_rows: int, world: int, rank: int) -> Schedule:
    micro = len(epoch_order(n_rows, 0, 0, rank, world)) // cfg.train.batch_size
    if micro == 0:
        raise ValueError(f"{n_rows} training rows is less than one micro-batch per process "
                         f"({cfg.train.batch_size} x {world}): lower train.batch_size or add data")
    steps_per_epoch = math.ceil(micro / cfg.train.grad_accum)
    total = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    return Schedule(micro, steps_per_epoch, total)


def held_out_rows(eval_rows: int, rows: int) -> int:
    """Rows held out from the end of a prepared set of ``rows``: ``data.eval_rows``, at most a fifth of them."""
    return min(eval_rows, rows // 5) if eval_rows else 0


def loads_whole_target(cfg, is_main: bool, fsdp: bool) -> bool:
    """Whether this process needs the target's decoder layers, not only its embedding and LM head.

    Online features run the target in every step. Offline ones only borrow its embedding (the
    drafter's input) and LM head (the loss), except where held-out text is generated for true tau:
    the main process, or every process under FSDP (each takes part in the drafter's all-gathers).
    """
    if cfg.features.mode == "online":
        return True
    return bool(cfg.eval.true_tau_prompts and cfg.data.eval_rows) and (is_main or fsdp)


def borrows_target(cfg) -> bool:
    """Offline features with an unquantized target on one device per process: its embedding and LM head
    can be loaded alone (quantized targets come through their quantizer, spread ones through device_map)."""
    return (cfg.features.mode == "offline" and not cfg.target.device_map
            and parse_quantization(cfg.target.quantization).kind == "none")


# ----------------------------------------------------------------------------- the dry run
def _hub_resolves() -> bool:
    """Whether the Hub endpoint's host name resolves (no name means no network: fail in milliseconds)."""
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
        return True
    except (socket.gaierror, UnicodeError):
        return False


def _fetch_config(cfg) -> tuple[dict | None, str]:
    """(config dict, where it came from or why not)."""
    path = cfg.target.path
    if str(path).startswith("tiny:"):  # its shape is fixed in code: plan it as built
        # start-up time: the plan of a real target imports no transformers
        from models.tiny import TINY_VOCAB, tiny_config
        from train.tiny import NUM_LAYERS, parse_tiny

        return (tiny_config(parse_tiny(path), TINY_VOCAB, NUM_LAYERS).to_dict(),
                f"{path}: the tiny target built at train time ({NUM_LAYERS} layers)")
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return json.loads(local.read_text()), f"local {local}"

    if not is_hub_id(path):  # a local path (a typo, a folder not copied yet): not the Hub's network to blame
        what = "has no config.json" if local.parent.is_dir() else "does not exist"
        return None, f"the local folder {path} {what}; using the recipe's shape facts"
    offline = False
    try:
        # The plan only refines the recipe's facts: when the Hub's host does not even resolve, read
        # the cache alone instead of sitting through huggingface_hub's ~25 s of connection retries.
        offline = not _hub_resolves()
        f = huggingface_hub.hf_hub_download(path, "config.json", revision=cfg.target.revision, local_files_only=offline)
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
        shape["rope_theta"] = TargetShape.from_config(fetched).rope_theta or shape["rope_theta"]
        text = fetched.get("text_config") or fetched  # Qwen3.5 multimodal checkpoints nest the text tower
        for k in TEXT_KEYS:
            if text.get(k) is not None:
                shape[k] = text[k]
        shape["model_type"] = fetched.get("model_type", shape["model_type"])
        if text.get("kv_lora_rank") and text.get("num_attention_heads"):  # latent attention: no K/V head width
            from models.target_shape import mla_drafter_heads

            shape["num_key_value_heads"], shape["head_dim"] = mla_drafter_heads(text)
        if text.get("layer_types"):  # linear-attention layers (Qwen3.5's GatedDeltaNet) keep no KV cache
            shape["kv_cache_layers"] = sum(t != "linear_attention" for t in text["layer_types"])
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
    except the main one when it generates for true tau (``loads_whole_target``).
    ``target.device_map`` instead spreads the target over the node's GPUs, with the drafter on GPU 0.
    """
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

    d, tr = cfg.drafter, cfg.train
    L, H, V = shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]
    facts = {k: v for k, v in shape.items() if k not in ("num_hidden_layers", "model_type", "kv_cache_layers")}
    target = TargetShape(num_layers=L, **{k: v for k, v in facts.items() if v is not None})
    # The same resolver as training; the mask token does not change the plan, so any valid row stands in.
    draft = _drafter_of(cfg, target)
    heads, kv, hd, inter = (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim,
                            draft.intermediate_size)
    taps = draft.target_layer_ids
    B, N, S = d.block_size, tr.anchors, cfg.data.max_length
    n_draft = draft.num_parameters()
    params_b = cfg.target.params_b or (12 * L * H * H + 2 * V * H) / 1e9
    active_b = cfg.target.active_params_b or params_b

    # Data size: a prepared set's stats when present (exact); else the source's conversations (counted, or from a
    # Hub data set's metadata), each of at most data.max_length tokens.
    prepared = Path(cfg.data.prepared) if cfg.data.prepared else cfg.resolved_out_dir() / "data"
    stats_file = prepared / "stats.json"
    rows = tokens = None
    conversations, rows_from = source_rows(cfg)
    if stats_file.is_file():
        stats = json.loads(stats_file.read_text())
        rows, tokens = stats.get("rows"), stats.get("tokens")
        rows_from = f"prepared data {stats_file}"
    else:
        rows = conversations
    exact = stats_file.is_file() and rows is not None
    tokens_per_row = tokens / rows if exact and tokens and rows else S  # at most data.max_length each
    rows_per_step = tr.batch_size * tr.grad_accum  # per process
    # Every process trains its own rows of a step: 8 GPUs take an epoch in an eighth of the steps of one.
    devices = parse_devices(cfg.devices)
    processes = 1 if cfg.target.device_map or devices is None else devices[0]
    steps = steps_per_epoch = None
    schedule_note = None
    if rows:
        try:
            sched = make_schedule(cfg, rows - held_out_rows(cfg.data.eval_rows, rows), processes, 0)
            steps, steps_per_epoch = sched.total_steps, sched.steps_per_epoch
        except ValueError as e:  # fewer rows than one micro-batch per process
            schedule_note = str(e)
    if tr.max_steps:  # known whatever the data: train.max_steps
        steps = tr.max_steps
    epochs = steps / steps_per_epoch if steps and steps_per_epoch else (None if tr.max_steps else tr.epochs)

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
    flops_row = row_flops(cfg, draft, active_b, S, online=True)  # drafter fwd+bwd + target fwd, a full-length row
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
        "data": {"source": cfg.data.source, "prepared": str(prepared), "rows": rows, "rows_from": rows_from,
                 "rows_exact": exact, "tokens": tokens if exact else (rows * S if rows else None),
                 "regenerate": cfg.data.regenerate, "thinking": cfg.data.thinking, "features": cfg.features.mode,
                 "pack": cfg.data.pack},
        "schedule": {"rows_per_step_per_process": rows_per_step, "processes": processes, "epochs": epochs,
                     "steps": steps, "steps_exact": bool(steps and (exact or tr.max_steps)),
                     "tokens_trained": round(steps * rows_per_step * processes * tokens_per_row) if steps else None,
                     "lr": tr.lr, "schedule": tr.schedule, "warmup_ratio": tr.warmup_ratio},
        "memory_per_gpu": mem,
        "placement": placement(mem),
        "devices": device_plan(cfg, mem),
        "tflops_per_row": round(flops_row / 1e12, 2),
        "time": time_estimates(cfg, draft, active_b, tokens_per_row, steps, processes, exact),
        "regeneration": regeneration_cost(cfg, shape, params_b, conversations, stats_file.is_file(),
                                          mem["total_gib"], devices),
        "offline_features": feature_disk(cfg, taps, H, tokens if exact else (rows * S if rows else None), exact),
    })
    if steps is None:
        out["schedule"]["note"] = schedule_note or (f"steps = epochs x rows / {rows_per_step * processes} rows per "
                                                    "step: set train.max_steps, or prepare the data first")
    elif not exact and not tr.max_steps:
        out["schedule"]["note"] = ("estimated from the source's conversations before preparation"
                                   + (" (packing joins them into fewer rows)" if cfg.data.pack else ""))
    return out


# ----------------------------------------------------------------------------- rows of the source
def source_rows(cfg) -> tuple[int | None, str]:
    """(conversations ``data.source`` holds, ``data.limit`` applied; where the figure comes from)."""
    source, limit = cfg.data.source, cfg.data.limit
    if not source:
        return None, "no data.source"
    if source == "tiny":
        n, how = cfg.data.tiny_conversations, "data.tiny_conversations"
    else:
        path = Path(source).expanduser()
        try:
            n, how = (_local_rows(path, cfg.data.split), f"counted in {path}") if path.exists() else \
                _hub_rows(source, cfg.data.split, cfg.data.subset)
        except Exception as e:  # a file no reader reads, a Hub error: the plan goes on without the count
            return None, f"unknown ({type(e).__name__}: {textwrap.shorten(str(e), 120, placeholder=' ...')})"
    if n is not None and limit and limit < n:
        n, how = limit, f"data.limit of {n} in {how.removeprefix('counted in ')}"
    return n, how


def _local_rows(path: Path, split: str) -> int:
    """Rows of a local source, as ``data.readers`` reads them: a JSONL file's non-blank lines, a JSON document's
    items, a Parquet file's metadata, a ``save_to_disk`` folder's split(s), a folder's files."""
    from data.readers import _folder_files, _is_saved_dataset

    if path.is_file():
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8-sig"))
            return len(data) if isinstance(data, list) else 1
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if _is_saved_dataset(path):
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(path))
        return sum(len(ds[s]) for s in split.split("+")) if isinstance(ds, DatasetDict) else len(ds)
    return sum(_local_rows(f, split) for f in _folder_files(path, split))


def _hub_rows(name: str, split: str, subset: str | None) -> tuple[int | None, str]:
    """A Hub data set's rows in ``split`` (``a+b``: both) from its card's metadata, without downloading it."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE or not _hub_resolves():
        return None, "unknown (offline)"
    info = HfApi().dataset_info(name, timeout=10)
    card = (info.card_data.to_dict() if info.card_data else {}).get("dataset_info") or []
    configs = card if isinstance(card, list) else [card]
    config = next((c for c in configs if c.get("config_name", "default") == (subset or "default")),
                  configs[0] if len(configs) == 1 else None)
    counts = {s.get("name"): s.get("num_examples") for s in (config or {}).get("splits", [])}
    wanted = split.split("+")
    if all(isinstance(counts.get(w), int) for w in wanted):
        return sum(counts[w] for w in wanted), f"the Hub's metadata of {name}"
    return None, f"unknown (the Hub's metadata of {name} gives no row count for split {split})"


# ----------------------------------------------------------------------------- the plan's lines
def _size(gib: float) -> str:
    return f"{gib / 1024:.1f} TiB" if gib >= 1024 else f"{gib:.1f} GiB"


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
        if dt["rows"] is None:
            size = f"rows {dt['rows_from']}"
        elif dt["rows_exact"]:
            size = f"{dt['rows']:,} rows, {_count(dt['tokens'] or 0)} tokens ({dt['rows_from']})"
        else:
            size = (f"~{dt['rows']:,} rows ({dt['rows_from']}), at most {_count(dt['tokens'])} tokens (rows are cut "
                    f"at data.max_length={o['max_length']})")
        print(f"  data: {dt['source']} -> {dt['prepared']}: {size}; regenerate {dt['regenerate']}, thinking "
              f"{dt['thinking']}, features {dt['features']}")
        sc = p["schedule"]
        approx = "" if sc["steps_exact"] else "~"
        steps = "steps unknown" if sc["steps"] is None else f"{approx}{sc['steps']:,} steps"
        epochs = (f"{sc['epochs']:.3g} epochs" if sc["epochs"] else "epochs unknown") + (
            f", {'' if dt['rows_exact'] else 'at most '}{_count(sc['tokens_trained'])} tokens"
            if sc["tokens_trained"] else "")
        print(f"  schedule: {steps}, {epochs} ({sc['processes']} process(es) x {sc['rows_per_step_per_process']} rows "
              f"per step), lr {sc['lr']} {sc['schedule']}, warmup {sc['warmup_ratio']:.0%}"
              + (f" ({sc['note']})" if "note" in sc else ""))
        print_time(p["time"], sc["steps"] is not None and sc["steps_exact"])
        print_regeneration(p["regeneration"])
        f = p["offline_features"]
        at_most = "" if f["tokens_exact"] else "at most "
        rows = (f" (the run's rows are unknown: 100k rows of {o['max_length']} tokens)" if f["per_100k_rows"]
                else "")
        print(f"  offline features (python -m data.extract --layers {','.join(map(str, f['layers']))}): "
              f"{at_most}~{_size(f['bf16_gib'])} in bf16, {at_most}~{_size(f['fp8_gib'])} in fp8 (+ "
              f"~{_size(f['topk_gib'])} with --topk {f['topk']}) for {at_most}{_count(f['tokens'])} tokens{rows}")
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
