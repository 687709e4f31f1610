"""Train a DFlash drafter: block-diffusion distillation from a target model (DESIGN.md section 2).

    python train/distill.py recipe=tiny                                  # laptop CPU, under a minute
    python train/distill.py recipe=qwen35-9b --dry-run                   # the plan, no download
    accelerate launch train/distill.py recipe=qwen35-9b                  # one GPU node
    accelerate launch --num_processes 8 train/distill.py recipe=qwen3-8b train.lr=3e-4
    accelerate launch --config_file fsdp.yaml --num_machines 4 --machine_rank $RANK \\
        --main_process_ip $HEAD --main_process_port 29500 --num_processes 32 \\
        train/distill.py recipe=qwen35-27b features.mode=offline features.store=/data/feat-27b
    python train/distill.py recipe=tiny resume=true                      # continue from the newest checkpoint

Arguments are ``recipe=NAME|PATH.yaml`` then dotted ``key=value`` overrides (see train/config.py;
an unknown key is an error naming the closest valid one). Everything goes under ``out_dir``:
``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_<N>/`` and ``final/drafter/``.

The script reads top to bottom: config -> target -> data -> features -> drafter -> optimizer ->
loop (micro-batches, accumulation, clip, step, log, eval, checkpoint) -> final drafter. accelerate
only prepares the model and optimizer (devices, DDP/FSDP/DeepSpeed, mixed precision), skips the
gradient sync of non-final micro-batches, and saves/loads state; the loop is ours.

Determinism: the data order of epoch e is a permutation drawn from (seed, e), and the anchors of
each row from (seed, epoch, row), both from their own generators. So the data-order state is just
(epoch, step in epoch), a resumed run draws exactly the same anchors as an uninterrupted one, and
a row's blocks do not depend on the batch size, gradient accumulation or process count. The loss
of an optimizer step is normalised by the slot-weight sum of the whole step (see the loop), so
``batch_size=2 grad_accum=1`` and ``batch_size=1 grad_accum=2`` take the same step.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # `python train/distill.py` / `accelerate launch train/distill.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch


def main(argv: list[str] | None = None) -> dict:
    from train.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print_help()
        return {}
    cfg = load_config(argv)  # a mistyped key or recipe ends in models.cli.run_cli's one-line error
    if cfg.dry_run:
        from train.plan import print_plan

        return print_plan(cfg)
    return train(cfg)


def print_help() -> None:
    from dataclasses import fields

    from train.config import RunConfig, recipe_path, valid_keys

    print(__doc__)
    recipes = sorted(p.stem for p in recipe_path("tiny").parent.glob("*.yaml"))
    print("recipes:", ", ".join(recipes))
    print("config keys (README 'Train' explains each):")
    keys = valid_keys()
    print("  " + ", ".join(k for k in keys if "." not in k and not any(o.startswith(k + ".") for o in keys)))
    for section in fields(RunConfig):
        sub = [k.split(".", 1)[1] for k in keys if k.startswith(section.name + ".")]
        if sub:
            print(f"  {section.name}.: " + ", ".join(sub))


def lr_lambda(total_steps: int, warmup_ratio: float, schedule: str, min_ratio: float):
    warmup = int(round(warmup_ratio * total_steps))

    def f(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def epoch_order(n: int, seed: int, epoch: int, rank: int, world: int) -> list[int]:
    """This process's share of epoch ``epoch``'s permutation (equal share per process)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
    perm = perm[: len(perm) - len(perm) % world] if world > 1 else perm
    return perm[rank::world]


def train(cfg) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm import tqdm

    from models.config import DFlashConfig, choose_mask_token, tokenizer_emitted_ids
    from models.drafter import DFlashDraftModel
    from train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_drafter
    from train.eval import evaluate_sim, held_out_prompts, stream_seed, true_tau
    from train.objective import (attention_masks, block_loss, drafter_forward, draw_blocks, loss_weight,
                                 simulated_acceptance)
    from train.setup import check_same_rows, load_data, load_target, make_features, token_batch

    # ------------------------------------------------------------------ config, accelerator, out_dir
    cuda = torch.cuda.is_available()
    mp = cfg.train.mixed_precision if cfg.train.mixed_precision != "auto" else ("bf16" if cuda else "no")
    accelerator = Accelerator(mixed_precision=mp, cpu=not cuda)
    set_seed(cfg.train.seed)
    out_dir = cfg.resolved_out_dir()
    is_main = accelerator.is_main_process
    log = (lambda msg: tqdm.write(str(msg))) if is_main else (lambda msg: None)
    config_yaml = cfg.to_yaml()
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(config_yaml)
        log(f"resolved config ({out_dir / 'config.yaml'}):\n{config_yaml}")
    device = accelerator.device

    # ------------------------------------------------------------------ target, data, features
    target, target_path = load_target(cfg, out_dir, accelerator, log)
    train_ds, eval_ds, meta = load_data(cfg, target_path, target, out_dir, accelerator, log)
    H = target.hidden_size
    d = cfg.drafter
    tcfg = target.config
    drafter_cfg = DFlashConfig.for_target(
        hidden_size=H, vocab_size=target.vocab_size, num_target_layers=target.num_layers,
        max_position_embeddings=target.max_position_embeddings,
        mask_token_id=d.mask_token_id if d.mask_token_id is not None else
        choose_mask_token(target.vocab_size, tokenizer_emitted_ids(target.tokenizer)),
        num_hidden_layers=d.num_hidden_layers, num_taps=d.num_taps, target_layer_ids=d.target_layer_ids,
        num_attention_heads=d.num_attention_heads or tcfg.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads or getattr(tcfg, "num_key_value_heads", None),
        head_dim=d.head_dim or getattr(tcfg, "head_dim", None) or H // tcfg.num_attention_heads,
        intermediate_size=d.intermediate_size or getattr(tcfg, "intermediate_size", None),
        block_size=d.block_size, rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
        torch_dtype="bfloat16" if mp == "bf16" else "float32")
    drafter_cfg.check_target(hidden_size=H, vocab_size=target.vocab_size, num_layers=target.num_layers,
                             emitted_ids=tokenizer_emitted_ids(target.tokenizer))
    train_feats, eval_feats = make_features(cfg, target, drafter_cfg.target_layer_ids, train_ds, eval_ds, device)
    log(f"drafter: {drafter_cfg.num_hidden_layers} layers, taps {drafter_cfg.target_layer_ids}, block "
        f"{drafter_cfg.block_size}, mask token {drafter_cfg.mask_token_id}")

    # ------------------------------------------------------------------ drafter, optimizer, schedule
    torch.manual_seed(cfg.train.seed)
    if d.init_from:
        drafter = DFlashDraftModel.from_pretrained(d.init_from, dtype=torch.float32)
    else:
        drafter = DFlashDraftModel(drafter_cfg)
        for m in drafter.modules():  # Qwen3 init (std 0.02); norms stay at 1
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=0.02)
    drafter = drafter.float().to(device).train()
    drafter.bind_target(target.embed_tokens, target.lm_head)
    log(f"drafter parameters: {drafter.num_parameters / 1e6:.2f}M")
    if cfg.train.grad_checkpointing:
        from torch.utils.checkpoint import checkpoint

        for layer in drafter.layers:
            layer.forward = (lambda f: (lambda *a: checkpoint(f, *a, use_reentrant=False)))(layer.forward)
    use_flex = cfg.train.attention == "flex" or (cfg.train.attention == "auto" and device.type == "cuda")

    world, rank = accelerator.num_processes, accelerator.process_index
    micro_per_epoch = len(epoch_order(len(train_ds), 0, 0, rank, world)) // cfg.train.batch_size
    if micro_per_epoch == 0:
        raise ValueError(f"{len(train_ds)} training rows is less than one micro-batch per process "
                         f"({cfg.train.batch_size} x {world})")
    steps_per_epoch = math.ceil(micro_per_epoch / cfg.train.grad_accum)
    total_steps = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    # fused: one kernel for the whole ~1B-parameter update on CUDA (31 -> ~7 ms per H100 step).
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                  weight_decay=cfg.train.weight_decay, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(total_steps, cfg.train.warmup_ratio, cfg.train.schedule, cfg.train.min_lr_ratio))
    model, optimizer = accelerator.prepare(drafter, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by us once per optimizer step

    step, epoch, step_in_epoch = 0, 0, 0
    if cfg.resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is None:
            log(f"resume=true but no checkpoint under {out_dir / 'checkpoints'}: starting from scratch")
        else:
            state = load_checkpoint(accelerator, ckpt)
            step, epoch, step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
            log(f"resumed from {ckpt} (step {step}, epoch {epoch}, step in epoch {step_in_epoch})")

    # ------------------------------------------------------------------ logging
    metrics_path = out_dir / "metrics.jsonl"
    if is_main and not cfg.resume:
        metrics_path.write_text("")
    wandb_run = None
    if cfg.logging.wandb and is_main:
        try:
            import wandb

            wandb_run = wandb.init(project=cfg.logging.wandb_project, config=cfg.to_dict(), dir=str(out_dir),
                                   mode=cfg.logging.wandb_mode, resume="allow" if cfg.resume else None)
        except ImportError:
            msg = ("logging.wandb=true but wandb is not importable (pip install wandb): logging to the console and "
                   f"{metrics_path} only")
            warnings.warn(msg, stacklevel=1)
            log(f"warning: {msg}")

    def emit(row: dict) -> None:
        if not is_main:
            return
        with metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if wandb_run is not None:
            wandb_run.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])

    unwrapped = accelerator.unwrap_model(model)
    eval_idx = list(range(len(eval_ds)))
    prompts = held_out_prompts(eval_ds, cfg.eval.true_tau_prompts) if cfg.eval.true_tau_prompts else []

    def run_eval(with_true: bool) -> dict:
        row = {"step": step}
        if is_main and eval_idx:
            row.update(evaluate_sim(unwrapped, target, eval_feats, eval_idx, batch_size=cfg.train.batch_size,
                                    num_anchors=cfg.train.anchors, gamma=cfg.gamma, seed=cfg.train.seed,
                                    max_batches=cfg.eval.batches, use_flex=use_flex, ce_chunk=cfg.train.ce_chunk,
                                    autocast=accelerator.autocast))
            if with_true and prompts:
                with accelerator.autocast():
                    row.update(true_tau(unwrapped, target, prompts, cfg.eval.true_tau_max_new_tokens))
            emit(row)
            log("eval " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                                      if not isinstance(v, (list, dict))}))
        accelerator.wait_for_everyone()
        return row

    def trainer_state() -> dict:
        # At an epoch's end the next step's data is the next epoch's first step.
        e, s = (epoch + 1, 0) if step_in_epoch >= steps_per_epoch else (epoch, step_in_epoch)
        return {"step": step, "epoch": e, "step_in_epoch": s, "total_steps": total_steps,
                "steps_per_epoch": steps_per_epoch, "seed": cfg.train.seed, "world_size": world}

    # ------------------------------------------------------------------ loop
    log(f"training: {len(train_ds)} rows, {steps_per_epoch} steps/epoch, {total_steps} steps, "
        f"{world} process(es), {'flex' if use_flex else 'dense'} attention, mixed precision {mp}")
    first_eval = run_eval(with_true=True) if (cfg.eval.at_start and step == 0) else {}
    bar = tqdm(total=total_steps, initial=step, disable=not (is_main and cfg.logging.progress), unit="step",
               dynamic_ncols=True)
    t_log, tokens_since, anchors_since = time.perf_counter(), 0, 0
    last: dict = {}
    while step < total_steps:
        order = epoch_order(len(train_ds), cfg.train.seed, epoch, rank, world)
        while step_in_epoch < steps_per_epoch and step < total_steps:
            first = step_in_epoch * cfg.train.grad_accum
            micro_ids = range(first, min(first + cfg.train.grad_accum, micro_per_epoch))
            # The step's loss is sum(w_k * loss_k) / sum(w_k) over every scored slot of the whole
            # optimizer step (all micro-batches, all processes), as if it were one big batch: a
            # mean of per-micro-batch means would weigh a slot of a row with few anchors more than
            # one of a row with many, so batch_size=2 x grad_accum=1 and 1 x 2 would train
            # differently. The denominator must be known before the first backward, so the
            # blocks of every micro-batch are drawn first, from the token columns alone (cheap; no
            # features). Anchors come from one stream per (seed, epoch, data row), so a row's
            # blocks do not depend on how rows are grouped into micro-batches or processes.
            plans = []
            for micro in micro_ids:
                rows = order[micro * cfg.train.batch_size:(micro + 1) * cfg.train.batch_size]
                tok = token_batch(train_ds, rows)
                ids, lm = tok.input_ids.to(device), tok.loss_mask.to(device)
                doc, pos = tok.doc_ids.to(device).long(), tok.position_ids.to(device)
                gens = [torch.Generator().manual_seed(stream_seed(cfg.train.seed, epoch, r)) for r in rows]
                blocks = draw_blocks(ids, lm, doc, pos, cfg.train.anchors, drafter_cfg.block_size,
                                     drafter_cfg.mask_token_id, gens)
                plans.append((rows, tok, blocks, doc, pos))
            step_weight = accelerator.reduce(sum(loss_weight(p[2], cfg.gamma) for p in plans).float(), "sum")
            # DDP / FSDP average gradients over processes: scale by `world` so they sum instead.
            scale = world / step_weight.clamp_min(1e-12)
            loss_acc = torch.zeros((), device=device)
            ce_acc, kl_acc, scored_acc = torch.zeros((), device=device), torch.zeros((), device=device), 0
            acc_stats: dict[str, torch.Tensor] = {}
            for i, (rows, tok, blocks, doc, pos) in enumerate(plans):
                batch = train_feats.get_batch(rows)
                check_same_rows(tok, batch, cfg.features.store)
                mask = attention_masks(drafter_cfg, blocks, doc, pos, use_flex)
                sync = i == len(plans) - 1
                with (contextlib.nullcontext() if sync else accelerator.no_sync(model)), accelerator.autocast():
                    hidden = drafter_forward(model, target.embed_tokens, blocks, batch.features.to(device), pos, mask)
                    out = block_loss(hidden, blocks, target.lm_head.weight, cfg.gamma, chunk=cfg.train.ce_chunk,
                                     mode=cfg.train.loss, kl_weight=cfg.train.kl_weight,
                                     topk_ids=None if batch.topk_ids is None else batch.topk_ids.to(device),
                                     topk_logprobs=None if batch.topk_logprobs is None else batch.topk_logprobs.to(device))
                    accelerator.backward(out.weighted_sum * scale)
                loss_acc += out.weighted_sum.detach() / step_weight.clamp_min(1e-12)
                ce_acc, kl_acc, scored_acc = ce_acc + out.ce_sum, kl_acc + out.kl_sum, scored_acc + out.scored
                for k, v in simulated_acceptance(out.correct, out.label_mask, out.valid).items():
                    acc_stats[k] = acc_stats[k] + v if k in acc_stats else v
                tokens_since += int(batch.lengths.sum())
                anchors_since += out.num_blocks
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.train.clip) if cfg.train.clip > 0 else None
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_in_epoch += 1

            if step % cfg.logging.every == 0 or step == total_steps:
                loss_mean = accelerator.reduce(loss_acc.float(), "sum")  # each process holds its share
                scored = accelerator.reduce(torch.tensor(float(scored_acc), device=device), "sum").clamp_min(1)
                ce_mean = accelerator.reduce(ce_acc.float(), "sum") / scored
                kl_mean = accelerator.reduce(kl_acc.float(), "sum") / scored
                tau_sum = accelerator.reduce(acc_stats["tau_sum"], "sum")
                nblk = accelerator.reduce(acc_stats["blocks"], "sum")
                dt = time.perf_counter() - t_log
                tok_s = tokens_since * world / dt
                last = {"step": step, "epoch": round(epoch + step_in_epoch / steps_per_epoch, 4),
                        "loss": float(loss_mean), "ce": float(ce_mean), "tau": float(tau_sum / nblk.clamp_min(1)),
                        **({"kl": float(kl_mean)} if cfg.train.loss != "ce" else {}),
                        "lr": scheduler.get_last_lr()[0],
                        "grad_norm": None if grad_norm is None else float(grad_norm),
                        "tokens_per_s": round(tok_s, 1), "anchors_per_s": round(anchors_since * world / dt, 1)}
                emit(last)
                bar.set_postfix(loss=f"{last['loss']:.4f}", tau=f"{last['tau']:.2f}", tok_s=f"{tok_s:.0f}")
                if not cfg.logging.progress:  # no bar (logs, CI): the console still gets every logged step
                    log("step " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in last.items()}))
                t_log, tokens_since, anchors_since = time.perf_counter(), 0, 0
            bar.update(1)
            final_step = step == total_steps
            if (cfg.eval.every and step % cfg.eval.every == 0) or final_step:
                with_true = final_step or (cfg.eval.true_tau_every and step % cfg.eval.true_tau_every == 0)
                run_eval(bool(with_true))
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or final_step:
                save_checkpoint(accelerator, model, out_dir, step, trainer_state(), config_yaml, cfg.checkpoint.keep_last)
        if step_in_epoch >= steps_per_epoch:
            epoch, step_in_epoch = epoch + 1, 0
    bar.close()

    # ------------------------------------------------------------------ final drafter
    final = out_dir / "final"
    save_drafter(accelerator, model, final / "drafter", dtype=torch.bfloat16 if mp == "bf16" else None)
    if is_main:
        (final / "config.yaml").write_text(config_yaml)
        log(f"final drafter: {final / 'drafter'}")
    if wandb_run is not None:
        wandb_run.finish()
    accelerator.end_training()
    return {"out_dir": str(out_dir), "steps": step, "last": last, "first_eval": first_eval}


if __name__ == "__main__":
    from models.cli import run_cli

    run_cli(main)
