"""Train a DFlash drafter: block-diffusion distillation from a target model (docs/design.md).

    draftsmith train recipe=tiny                                         # laptop CPU, under a minute
    draftsmith train recipe=qwen35-9b --dry-run                          # the plan, no download
    accelerate launch --no_python --num_processes 8 draftsmith train recipe=qwen3-8b   # installed, 8 GPUs
    python train/distill.py recipe=tiny                                  # the same from a checkout
    accelerate launch train/distill.py recipe=qwen35-9b                  # one GPU node
    accelerate launch --num_processes 8 train/distill.py recipe=qwen3-8b train.lr=3e-4
    accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_machines 4 --machine_rank $RANK \\
        --main_process_ip $HEAD --main_process_port 29500 --num_processes 32 \\
        train/distill.py recipe=qwen35-27b features.mode=offline features.store=/data/feat-27b
    python train/distill.py recipe=tiny resume=true                      # continue from the newest checkpoint
    python train/distill.py recipe=tiny resume=true train.epochs=4       # ...and train longer than planned

Arguments are ``recipe=NAME|PATH.yaml`` then dotted ``key=value`` overrides (see train/config.py;
an unknown key is an error naming the closest valid one). Everything goes under ``out_dir``:
``config.yaml``, ``metrics.jsonl``, ``checkpoints/step_<N>/`` and ``final/drafter/``.

The script reads top to bottom: ``train()`` is a sequence of named stages, config -> target ->
data -> drafter config (shape, mask token) -> features -> drafter -> optimizer -> resume ->
metrics -> loop (micro-batches, accumulation, clip, step, log, eval, checkpoint; parts in
train/loop.py) -> final drafter. accelerate only prepares the model and optimizer (devices,
DDP/FSDP/DeepSpeed, mixed precision), skips the gradient sync of non-final micro-batches, and
saves/loads state; the loop is ours. Its whole state is ``train.loop.LoopState``, which is exactly
what a checkpoint saves. Ctrl-C prints the newest checkpoint and the command that resumes from it.

Determinism: the data order of epoch e is a permutation drawn from (seed, e), and the anchors of
each row from (seed, epoch, row), both from their own generators (train/rng.py). So the data-order
state is just (epoch, step in epoch), a resumed run draws exactly the same anchors as an
uninterrupted one, and a row's blocks do not depend on the batch size, gradient accumulation or
process count. The loss of an optimizer step is normalised over the whole step (the slot-weight sum, or
D-PACE's ``train.dpace_normaliser``; see the loop), so ``batch_size=2 grad_accum=1`` and
``batch_size=1 grad_accum=2`` take the same step.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
from dataclasses import fields
from pathlib import Path

if __package__ in (None, ""):  # `python train/distill.py` / `accelerate launch train/distill.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from models.provenance import data_provenance, provenance_of_run
from train.config import RunConfig, load_config, valid_keys
from train.metrics import closing_summary, open_metrics, run_header, step_line
from train.overrides import recipe_names

LOCK = ".draftsmith.lock"  # in out_dir, held by the main process while the run writes there


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print_help()
        return {}
    cfg = load_config(argv)  # a mistyped key or recipe ends in models.support.run_cli's one-line error
    if cfg.dry_run:
        from train.plan import print_plan  # start-up time: `train.distill --help` imports no torch

        return print_plan(cfg)
    return train(cfg, argv)


def print_help() -> None:
    print(__doc__)
    print("recipes:", ", ".join(recipe_names()))
    print("config keys (README 'Train' explains each):")
    keys = valid_keys()
    print("  " + ", ".join(k for k in keys if "." not in k and not any(o.startswith(k + ".") for o in keys)))
    for section in fields(RunConfig):
        sub = [k.split(".", 1)[1] for k in keys if k.startswith(section.name + ".")]
        if sub:
            print(f"  {section.name}.: " + ", ".join(sub))


def setup_run(cfg, held: contextlib.ExitStack | None = None):
    """The accelerator (mixed precision, devices), the seed, ``out_dir`` with the resolved ``config.yaml``; None
    when ``resume=true`` finds the run finished (nothing to train).
    ``held``: where the main process keeps its lock on ``out_dir`` until the run ends (``models.support``)."""
    from models.support import run_on_main
    # start-up time: `train.distill --help` imports no torch
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from train.checkpoint import nothing_to_train, refuse_unfinished_run, resume_checkpoint, set_aside_damaged
    from train.export_stage import check_export_stage
    from train.loop import Run, true_tau_cadence_note
    from train.setup import check_inputs

    cuda = torch.cuda.is_available()
    if cfg.train.attention == "flex" and not cuda:  # torch's NotImplementedError at the first backward otherwise
        raise ValueError("train.attention=flex needs a CUDA GPU (flex attention has no backward on the CPU): use "
                         "train.attention=auto (dense on the CPU, flex on CUDA) or train.attention=dense")
    if cfg.train.mixed_precision == "fp16" and not cuda:  # accelerate runs it in fp32 there, and the run said fp16
        raise ValueError("train.mixed_precision=fp16 has no effect on the CPU (accelerate trains in float32 there, "
                         "while the run would record fp16): use train.mixed_precision=auto (no on the CPU), no, or "
                         "bf16")
    mp = cfg.train.mixed_precision if cfg.train.mixed_precision != "auto" else ("bf16" if cuda else "no")
    accelerator = Accelerator(mixed_precision=mp, cpu=not cuda)
    # the main process exports after training: what would fail there (no MLX, no Hub token) fails now instead
    run_on_main(lambda: check_export_stage(cfg.export), accelerator, what="the export settings' check")
    set_seed(cfg.train.seed)
    out_dir = cfg.resolved_out_dir()
    log = (lambda msg: tqdm.write(str(msg))) if accelerator.is_main_process else (lambda msg: None)
    check_inputs(cfg, out_dir)  # what it reads, where it writes, the drafter's shape: before anything loads
    if accelerator.is_main_process and held is not None:
        # a second run into out_dir (resumed or not) would write the same checkpoints; the lock (and out_dir, if
        # this run made it) goes again when the run stops on a refusal below
        from models.support import hold

        held.enter_context(hold(out_dir, LOCK, "out_dir", "wait for it to end, or give this run its own "
                                "out_dir=...", log))
    if cfg.resume and (done := nothing_to_train(cfg, out_dir)):  # a finished run: final/ stays, nothing loads
        log(done)
        return None
    if cfg.resume:  # checkpoints damaged since they were written are set aside, named: the newest intact one resumes
        run_on_main(lambda: set_aside_damaged(out_dir, log), accelerator, what="the checkpoints' checksums")
    # Refuse a resume with changed settings before anything is loaded or the run's config.yaml is rewritten.
    ckpt = resume_checkpoint(cfg, out_dir, log) if cfg.resume else None
    # An unfinished run is refused now; a finished one's checkpoints (and its config.yaml) are replaced once
    # the inputs have loaded: a rerun that stops on a mistake leaves that run as it was.
    replaces = refuse_unfinished_run(out_dir) if not cfg.resume else False
    run = Run(cfg, accelerator, out_dir, cfg.to_yaml(), mp, log, ckpt)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        # the resolved settings go to out_dir/config.yaml, not the console (a hundred lines before anything ran)
        log(f"train: recipe {cfg.recipe} into {out_dir} (every setting: {out_dir / 'config.yaml'})")
        if note := true_tau_cadence_note(cfg):
            log(f"note: {note}")
    if not replaces:
        write_run_config(run)
    return run


def write_run_config(run) -> None:
    """``out_dir/config.yaml``: the resolved settings of the run that owns ``out_dir``."""
    if run.is_main:
        (run.out_dir / "config.yaml").write_text(run.config_yaml)


def build_drafter(run, drafter_cfg, target):
    """A fresh drafter (Qwen3 init from the seed) or ``drafter.init_from``, in fp32 on the device, bound to
    the target's frozen embedding and LM head (``train.compile``: both models' layers compiled, ``run.compiled``)."""
    # start-up time: `train.distill --help` imports no torch
    import torch

    from models.drafter2 import new_drafter
    from train.compiling import compile_models

    torch.manual_seed(run.cfg.train.seed)
    # the run's config (checked against init_from's): what is saved. A v1 init_from of a DFlash2 run gives the
    # backbone, identity convs and a fresh selector.
    drafter = new_drafter(drafter_cfg, run.cfg.drafter.init_from)
    drafter = drafter.float().to(run.device).train()
    drafter.bind_target(target.embed_tokens, target.lm_head)
    drafter.gradient_checkpointing = run.cfg.train.grad_checkpointing
    drafter.set_flex_backward(run.cfg.train.flex_backward)
    run.compiled = compile_models(run.cfg, run.device.type, drafter, target)  # None: eager (train.compile)
    return drafter


def build_optimizer(run, drafter, sched):
    """AdamW + the warmup/cosine schedule; accelerate wraps the model (DDP/FSDP) and the optimizer."""
    # start-up time: `train.distill --help` imports no torch
    import torch

    from train.loop import lr_lambda

    tr = run.cfg.train
    # fused: one kernel for the whole ~1B-parameter update on CUDA (31 -> ~7 ms per H100 step).
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=tr.lr, betas=tuple(tr.betas),
                                  weight_decay=tr.weight_decay, fused=run.device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(sched.total_steps, tr.warmup_ratio, tr.schedule, tr.min_lr_ratio))
    model, optimizer = run.accelerator.prepare(drafter, optimizer)
    run.accelerator.register_for_checkpointing(scheduler)  # stepped by us once per optimizer step
    return model, optimizer, scheduler


def resume_state(run, sched, scheduler, rows: str, model=None):
    """A fresh ``LoopState``, or (``resume=true``) the state of the checkpoint ``setup_run`` checked.

    The run's length may have changed since (``train.checkpoint.LENGTH_KEYS``): never to before the
    checkpoint's step, and the learning rate follows the new length's schedule from the first resumed step.
    ``rows``: the identity of the rows this run loaded, which must be the checkpoint's; ``model``: the restored
    drafter, whose weights must be finite.
    """
    # start-up time: `train.distill --help` imports no torch
    from train.checkpoint import ResumeConfigError, load_checkpoint, nonfinite_checkpoint
    from train.loop import LoopState, nonfinite_weights, reshard_position, resync_lr

    if run.resume_from is None:
        return LoopState(world_size=run.world, rows=rows)
    state = LoopState.from_dict(load_checkpoint(run.accelerator, run.resume_from))
    if model is not None and nonfinite_weights(run, model):  # else "training diverged ... lower train.lr" at step 1
        raise nonfinite_checkpoint(run.resume_from)
    if state.rows is None:
        run.log("warning: the checkpoint predates recorded row identities: cannot check that the prepared rows "
                "are the ones it trained on")
    elif state.rows != rows:
        raise ResumeConfigError(
            f"resume=true, but the prepared rows differ from those the checkpoint {run.resume_from} trained on "
            f"(identity {state.rows} -> {rows}), so the data order would change: point data.prepared at the data "
            "it trained on, or start a new run with another out_dir")
    state.rows = rows
    resharded = ""
    if state.world_size != run.world:
        tr = run.cfg.train
        per_step = tr.batch_size * tr.grad_accum
        state.step_in_epoch, again = reshard_position(state.step_in_epoch, per_step * state.world_size,
                                                      per_step * run.world)
        if state.step_in_epoch >= sched.steps_per_epoch:  # the old size's last rows: the next epoch
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
        resharded = (f"; with {run.world} process(es) an epoch is {sched.steps_per_epoch} steps, not the "
                     f"{state.world_size} process(es) of the checkpoint: resume with {state.world_size}, or")
        run.log(f"warning: the checkpoint was written by {state.world_size} process(es), this run has {run.world}: "
                f"epoch {state.epoch} goes on at step {state.step_in_epoch} of {sched.steps_per_epoch}, after the "
                f"rows already trained on ({again} trained again); optimizer steps go on from {state.step}")
        state.world_size = run.world
    if state.step > sched.total_steps:
        raise ResumeConfigError(
            f"resume=true, but the checkpoint {run.resume_from} is at step {state.step}, past this run's "
            f"{sched.total_steps} steps (train.epochs={run.cfg.train.epochs}, train.max_steps="
            f"{run.cfg.train.max_steps}){resharded or ':'} raise them to train longer, or export that checkpoint as "
            "it is")
    before, after = resync_lr(scheduler)
    if not math.isclose(before, after, rel_tol=1e-6, abs_tol=1e-12):
        run.log(f"resume: the schedule now spans {sched.total_steps} steps: learning rate at step {state.step} "
                f"{before:.3g} -> {after:.3g} (as a run of this length would have it)")
    run.log(f"resumed from {run.resume_from} (step {state.step}, epoch {state.epoch}, step in epoch "
            f"{state.step_in_epoch})")
    return state


def train_loop(run, model, optimizer, scheduler, target, train_ds, feats, eval_ds, eval_feats, drafter_cfg, sched,
               state, logger) -> tuple[dict, dict, list[dict], int]:
    """Optimizer steps until ``total_steps``: log, evaluate and checkpoint on their cadence. Returns (the last
    logged step row, the eval row of the untrained drafter or {}, every eval row, the true-tau prompts)."""
    # start-up time: `train.distill --help` imports no torch
    from train.checkpoint import save_checkpoint
    from train.eval import true_tau_prompt_set
    from train.interrupt import Preempted
    from train.loop import (Throughput, advance, checkpoint_due, diverged, draw_step, eval_due, flop_counter,
                            nonfinite_weights, run_eval, step_row, stop_due, train_step)
    from train.rng import epoch_order

    cfg, total = run.cfg, sched.total_steps
    drafter = run.accelerator.unwrap_model(model)
    compiled = run.compiled  # train.compile: what compiles runs through it, with its fall-back to eager
    guarded = compiled.call if compiled is not None else (lambda fn, optimizer=None: fn())
    prompts = true_tau_prompt_set(eval_ds, cfg.eval.true_tau_prompts, run.log)
    first_eval = (guarded(lambda: run_eval(run, drafter, target, eval_feats, prompts, 0, True, logger, total))
                  if cfg.eval.at_start and state.step == 0 else {})
    evals = [first_eval] if first_eval else []
    bar = tqdm(total=total, initial=state.step, disable=not (run.is_main and cfg.logging.progress),
               unit="step", dynamic_ncols=True)
    speed, last, started, first_step = Throughput(), {}, time.perf_counter(), state.step
    count_flops, compile_row = flop_counter(cfg, drafter_cfg, target), compiled is not None

    def checkpoint() -> None:
        if nonfinite_weights(run, model):  # never saved: keep_last would delete the good checkpoints
            raise diverged(run, state.step, "the drafter's weights hold NaN / inf")
        state.wandb_run_id = logger.wandb_run_id
        save_checkpoint(run.accelerator, model, run.out_dir, state.step, state.to_dict(), run.config_yaml,
                        cfg.checkpoint.keep_last)

    def stop(saved: bool) -> None:
        if not saved:
            checkpoint()
        raise Preempted()

    run.stop.deferring = True  # a SIGTERM from now on ends the step under way, then stops (train.interrupt.StopRequest)
    while state.step < sched.total_steps:
        epoch = state.epoch
        order = epoch_order(len(train_ds), cfg.train.seed, epoch, run.rank, run.world)
        while state.epoch == epoch and state.step < sched.total_steps:
            micro = draw_step(run, train_ds, order, state, sched, drafter_cfg, count_flops)

            def step():
                return train_step(run, model, optimizer, scheduler, target, feats, micro, drafter_cfg)
            stats = compiled.step(step, optimizer, run.log) if compiled is not None else step()
            speed.add(stats)
            progress = state.epoch + (state.step_in_epoch + 1) / sched.steps_per_epoch
            advance(state, sched, stats)
            final = state.step == sched.total_steps
            logged = state.step % cfg.logging.every == 0 or final
            if state.step == first_step + 1 and not logged:
                speed.reset()  # the first step builds kernels (flex attention, the loss; train.compile's layers)
            if logged:
                last = step_row(run, state, stats, scheduler, speed, progress)
                if compile_row and compiled.first_step_s is not None:  # the one-time cost, in the first row
                    compile_row = False
                    if compiled.active and compiled.compile_s() is not None:
                        last["compile_s"] = round(compiled.compile_s(), 1)
                if not math.isfinite(last["loss"]):
                    raise diverged(run, state.step, f"the loss is {last['loss']}")
                # No bar (logs, CI): the console still gets every logged step, as a line (the bar shows it otherwise).
                elapsed = time.perf_counter() - started
                left = elapsed / (state.step - first_step) * (total - state.step)
                logger.log(last, echo=None if cfg.logging.progress else step_line(last, total, elapsed, left))
                bar.set_postfix(loss=f"{last['loss']:.4f}", tau=f"{last['tau']:.2f}",
                                tok_s=f"{last['tokens_per_s']:.0f}")
                speed.reset()
            bar.update(1)
            paused = time.perf_counter()  # checkpoints and evals are left out of the next logged rates
            # Checkpoint before evaluating: an eval that fails (a true-tau generation out of memory) must not
            # cost the steps since the last checkpoint. Nothing an eval does is in the checkpoint.
            saved = checkpoint_due(cfg, state.step, final)
            if saved:
                checkpoint()
            if stop_due(run, stats):  # SIGTERM (preemption): this step's state on disk, then stop as Ctrl-C does
                stop(saved)
            evaluate, with_true = eval_due(cfg, state.step, final)
            if evaluate:
                evals.append(guarded(lambda: run_eval(run, drafter, target, eval_feats, prompts, state.step,
                                                      with_true, logger, total)))
                if stop_due(run):  # a SIGTERM during the eval
                    stop(saved)
            speed.skip(time.perf_counter() - paused)
    bar.close()
    run.stop.deferring = False
    return last, first_eval, [r for r in evals if len(r) > 1], len(prompts)  # {"step": N} alone: no held-out rows


def save_final(run, model, step: int) -> Path:
    """``out_dir/final/``: ``drafter/`` (bf16 when trained in bf16), the config it was trained with and
    ``trained.json`` (its optimizer steps). Written as ``final.tmp/`` and renamed when complete, so a kill
    never leaves a new config beside old weights; the previous ``final/`` goes only then."""
    # start-up time: `train.distill --help` imports no torch
    import torch

    from models.support import share_like_umask
    from train.checkpoint import (FINAL_STATE, CheckpointError, free_space, latest_checkpoint, save_drafter,
                                  write_failure)
    from train.loop import diverged, nonfinite_weights

    final, tmp, old = (run.out_dir / name for name in ("final", "final.tmp", "final.old"))
    if nonfinite_weights(run, model):
        raise diverged(run, None, "the drafter's weights hold NaN / inf")
    if run.is_main:
        for stale in (tmp, old):  # left by a kill during an earlier save: never complete
            shutil.rmtree(stale, ignore_errors=True)
    run.accelerator.wait_for_everyone()
    try:
        save_drafter(run.accelerator, model, tmp / "drafter",
                     dtype=torch.bfloat16 if run.mixed_precision == "bf16" else None)
        if run.is_main:
            (tmp / "config.yaml").write_text(run.config_yaml)
            (tmp / FINAL_STATE).write_text(json.dumps({"step": step}) + "\n")
            share_like_umask(tmp)
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
    except (KeyboardInterrupt, Exception) as e:
        reason = None if isinstance(e, KeyboardInterrupt) else write_failure(e)
        if run.is_main and (reason or isinstance(e, KeyboardInterrupt)):
            if old.exists() and not final.exists():  # cut between the two renames: the previous final/ back
                old.rename(final)
            shutil.rmtree(tmp, ignore_errors=True)
        if reason is None:  # Ctrl-C, or a bug
            raise
        # the last step's checkpoint (always written) holds the same weights
        newest = latest_checkpoint(run.out_dir)
        raise CheckpointError(f"could not write the final drafter to {final} ({reason}; {free_space(run.out_dir)}), "
                              f"the half-written {tmp.name} removed: the checkpoint of the last step, {newest}, holds "
                              f"the same weights: free space and rerun with resume=true (it writes final/ again), or "
                              f"export it (python -m export.hf --checkpoint {newest} --out DIR)") from e
    run.accelerator.wait_for_everyone()
    return final / "drafter"  # the closing summary names it


def train(cfg, argv: list[str] | None = None) -> dict:
    """The whole run, stage by stage. ``argv`` (the command's arguments) only shapes the resume hint."""
    from train.interrupt import StopRequest, sigterm_as_interrupt

    with contextlib.ExitStack() as held:  # out_dir is this run's until it returns or fails
        stop = held.enter_context(sigterm_as_interrupt(StopRequest()))  # SIGTERM: as Ctrl-C
        run = setup_run(cfg, held)
        if run is None:  # resume=true on a finished run: final/ stays as it is
            from train.checkpoint import FINAL_STATE

            step = json.loads((cfg.resolved_out_dir() / "final" / FINAL_STATE).read_text())["step"]
            return {"out_dir": str(cfg.resolved_out_dir()), "steps": step, "last": {}, "first_eval": {},
                    "last_eval": {}, "nothing_to_train": True}
        run.stop = stop
        return run_stages(run, cfg, argv)


def run_stages(run, cfg, argv: list[str] | None) -> dict:
    """``train`` once ``out_dir`` is held: target, data, drafter, the loop, the final drafter, the exports."""
    # start-up time: `train.distill --help` imports no torch
    from data.rows import rows_identity
    from train.checkpoint import clear_for_fresh_start
    from train.loop import interrupted_message
    from train.plan import make_schedule
    from train.setup import (data_token_ids, load_data, load_target, make_features, resolve_drafter_config,
                             warm_start_config)

    target, target_path = load_target(cfg, run.out_dir, run.accelerator, run.log)
    train_ds, eval_ds, meta = load_data(cfg, target_path, target, run.out_dir, run.accelerator, run.log)
    drafter_cfg = resolve_drafter_config(cfg, target, data_token_ids(train_ds), run.mixed_precision, run.log)
    # Checkpoints and final/drafter name their target, so the loops warn when run with another one.
    provenance = provenance_of_run(cfg.to_dict(), run.out_dir)
    if data_provenance(meta):  # the rows read (data.prepared is used as it is), not the recipe's data keys
        provenance["data"] = data_provenance(meta)
    drafter_cfg = drafter_cfg.replace(draftsmith=provenance)
    if cfg.drafter.init_from:
        drafter_cfg = warm_start_config(cfg.drafter.init_from, drafter_cfg)
    feats, eval_feats = make_features(cfg, target, drafter_cfg.target_layer_ids, train_ds, eval_ds, run.device)
    sched = make_schedule(cfg, len(train_ds), run.world, run.rank)
    drafter = build_drafter(run, drafter_cfg, target)
    n_params = sum(p.numel() for p in drafter.parameters())  # before accelerate wraps it (FSDP shards it)
    model, optimizer, scheduler = build_optimizer(run, drafter, sched)
    state = resume_state(run, sched, scheduler, rows_identity(train_ds, eval_ds), model)
    if not cfg.resume:  # every input is loaded and checked: only now are the earlier (finished) run's checkpoints
        clear_for_fresh_start(run.out_dir, run.log, run.accelerator)  # replaced (a failed rerun kept them)
        write_run_config(run)
    logger = open_metrics(cfg, run.out_dir, run.is_main, resumed_step=state.step, wandb_run_id=state.wandb_run_id,
                          log=run.log)
    run.log(run_header(run, target, target_path, train_ds, eval_ds, drafter_cfg, n_params, sched, state.step))
    resumed_at = state.step
    try:
        last, first_eval, evals, prompts = train_loop(run, model, optimizer, scheduler, target, train_ds, feats,
                                                      eval_ds, eval_feats, drafter_cfg, sched, state, logger)
        final_drafter = save_final(run, model, state.step)  # Ctrl-C here too: resume=true writes final/ again
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (train.interrupt.Preempted)
        args = argv if argv is not None else [f"recipe={cfg.recipe}", f"out_dir={run.out_dir}"]
        run.log(interrupted_message(run.out_dir, state, args, run.world, getattr(e, "what", "interrupted")))
        raise
    finally:  # also on an error (a diverged run): the wandb run is closed
        logger.close()
    run.accelerator.end_training()
    if run.is_main:  # the drafter is on disk first: an export failure never costs the training
        from train.export_stage import run_export_stage  # start-up time: `train.distill --help` imports no torch

        run_export_stage(cfg.export, final_drafter, run.out_dir, run.log)
        run.log(closing_summary(run, state.step, resumed_at, evals, prompts, final_drafter, target_path))
    return {"out_dir": str(run.out_dir), "steps": state.step, "last": last, "first_eval": first_eval,
            "last_eval": evals[-1] if evals else {}}


def cli() -> None:
    """``draftsmith train`` and ``draftsmith-distill``: ``main`` with one-line user errors, as ``python -m`` runs it."""
    from models.support import run_cli

    run_cli(main)


if __name__ == "__main__":
    cli()
