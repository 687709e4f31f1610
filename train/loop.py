"""The training loop's parts: its state, its schedule, one optimizer step, eval, checkpoint, stop.

``train/distill.py`` reads as the sequence of stages; the stages that make up the loop live here
as small functions with plain inputs and outputs. The whole mutable state of the loop is one
dataclass, :class:`LoopState`, and it is exactly what a checkpoint's ``trainer_state.json`` holds.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate.utils import DistributedType

from models.support import UserError, to_device
from train.block_mask import documents_contiguous
from train.blocks import attention_masks, draw_blocks
from train.flops import DrafterShape, drafter_flops, peak_tflops, tapped_parameters, target_flops
from train.interrupt import StopRequest, launcher_note, resume_command
from train.checkpoint import latest_checkpoint
from train.eval import evaluate_sim, true_tau
from train.metrics import eval_line
from train.objective import block_loss, drafter_forward, loss_weight, simulated_acceptance
from train.selector_loss import block_embedder, selector_term
from train.rng import row_generators
from train.plan import Schedule
from train.setup import token_batch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from train.compiling import Compiled
    from train.config import RunConfig


@dataclass
class Run:
    """What every stage needs to know about the run (fixed after setup)."""

    cfg: RunConfig
    accelerator: Accelerator
    out_dir: Path
    config_yaml: str
    mixed_precision: str
    log: Callable[[str], None]  # console lines, main process only
    resume_from: Path | None = None  # the checkpoint to resume (resume=true and one exists)
    compiled: Compiled | None = None  # train.compile's layers and their fall-back (set when the drafter is built)
    started: float = field(default_factory=time.perf_counter)  # the closing summary's elapsed time
    stop: StopRequest = field(default_factory=StopRequest)  # SIGTERM, acted on at the end of a step

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def use_flex(self) -> bool:
        a = self.cfg.train.attention
        return a == "flex" or (a == "auto" and self.device.type == "cuda")


@dataclass
class LoopState:
    """Where the loop is. The data order is a pure function of (seed, epoch), so (epoch,
    step_in_epoch) is the whole data-order state; a checkpoint saves exactly this."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps taken in `epoch` (the next step's data starts there)
    tokens_seen: int = 0  # context tokens of the rows trained on, all processes
    wandb_run_id: str | None = None
    world_size: int = 1  # processes that produced this state (the data shards depend on it)
    rows: str | None = None  # data.rows.rows_identity of the train and held-out rows it trains on

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LoopState:
        """Older checkpoints carry extra keys (total_steps, seed...) and lack newer ones: both are fine."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def lr_lambda(total_steps: int, warmup_ratio: float, schedule: str, min_ratio: float):
    """Linear warmup from lr/warmup at step 0, then cosine to ``min_ratio`` x lr (or constant).

    Why not transformers' ``get_cosine_with_min_lr_schedule_with_warmup``: its warmup starts at
    lr 0 (``step / warmup``), so the first optimizer step would not move the weights, and our
    golden losses and every recipe's first step assume ``(step + 1) / warmup``. After warmup the two
    agree (same cosine, same floor).
    """
    warmup = int(round(warmup_ratio * total_steps))

    def f(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def resync_lr(scheduler) -> tuple[float, float]:
    """Set each group's learning rate from the schedule at the scheduler's step; (before, after) of the first.

    A restored optimizer keeps the learning rate the checkpoint's schedule gave, and ``LambdaLR`` only
    rewrites it at its next ``step()``: after a resume that changed the run's length (``train.epochs``,
    ``train.max_steps``), the first resumed step would still take the old schedule's rate.
    """
    groups = scheduler.optimizer.param_groups
    before = groups[0]["lr"]
    for group, base, f in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * f(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in groups]  # what get_last_lr() (the logged lr) reports
    return before, groups[0]["lr"]


# ----------------------------------------------------------------------------- one optimizer step
@dataclass
class MicroBatch:
    rows: list[int]
    tokens: object  # data.features.FeatureBatch of the token columns (no features yet)
    blocks: object  # train.blocks.Blocks
    doc: torch.Tensor
    pos: torch.Tensor
    contiguous: bool  # each row's documents are contiguous runs (checked on the host copy)
    n_tokens: int  # context tokens of the rows (counted on the host copy; no default: a forgotten 0 would log 0 tok/s)
    flops: float = 0.0  # model FLOPs of its forward + backward (train.flops, counted on the host's blocks)


@dataclass
class StepStats:
    """Per-process sums of one optimizer step (reduced over processes only when logged)."""

    loss: torch.Tensor
    ce_sum: torch.Tensor
    kl_sum: torch.Tensor
    scored: int = 0
    tokens: int = 0  # this process's context tokens
    anchors: int | torch.Tensor = 0  # valid blocks; a device count until logged
    tokens_all: int = 0  # every process's context tokens
    flops: float = 0.0  # this process's model FLOPs
    acceptance: dict = field(default_factory=dict)
    grad_norm: float | None = None
    slot_weight: torch.Tensor | int = 0  # [B-1] loss weight per slot, summed over the scored blocks (on the device)
    selector_ce_sum: torch.Tensor | None = None  # DFlash2: the selector CE summed over the scored slots
    stop: bool = False  # some process had a SIGTERM when the step began (several processes: they agree through it)


def draw_step(run: Run, train_ds, order: list[int], state: LoopState, sched: Schedule, drafter_cfg,
              count_flops: Callable | None = None) -> list[MicroBatch]:
    """The blocks of every micro-batch of the next optimizer step, from the token columns alone.

    The step's loss is sum(w_k * loss_k) / sum(w_k) over every scored slot of the whole optimizer
    step (all micro-batches, all processes), as if it were one big batch: a mean of per-micro-batch
    means would weigh a slot of a row with few anchors more than one of a row with many, so
    batch_size=2 x grad_accum=1 and 1 x 2 would train differently. The denominator must be known
    before the first backward, so every micro-batch's blocks are drawn first (cheap; no features).
    (D-PACE's weight sum is known only after the last forward: ``train_step`` rescales the gradients.)
    ``count_flops(blocks, tokens)`` (``flop_counter``): each micro-batch's model FLOPs, from the host's blocks.
    """
    tr, dev = run.cfg.train, run.device
    first = state.step_in_epoch * tr.grad_accum
    out = []
    for micro in range(first, min(first + tr.grad_accum, sched.micro_per_epoch)):
        rows = order[micro * tr.batch_size:(micro + 1) * tr.batch_size]
        tok = token_batch(train_ds, rows)
        # Drawn on the host and sent without waiting: on the GPU the draw reads counts back, and a plain
        # copy to it waits for its queue, so each step began by draining the previous step's work.
        doc = tok.doc_ids.long()
        blocks = draw_blocks(tok.input_ids, tok.loss_mask, doc, tok.position_ids, tr.anchors, drafter_cfg.block_size,
                             drafter_cfg.mask_token_id, row_generators(tr.seed, state.epoch, rows))
        n_tokens = int(tok.lengths.numpy().sum())
        out.append(MicroBatch(rows, tok, blocks.to(dev), to_device(doc, dev), to_device(tok.position_ids, dev),
                              documents_contiguous(doc), n_tokens,
                              count_flops(blocks, n_tokens) if count_flops is not None else 0.0))
    return out


def train_step(run: Run, model, optimizer, scheduler, target, feats, micro_batches: list[MicroBatch],
               drafter_cfg) -> StepStats:
    """Forward + backward of every micro-batch (gradient sync on the last only), clip, optimizer step."""
    cfg, acc, dev = run.cfg, run.accelerator, run.device
    objective = cfg.loss_weighting()
    # The step's loss is sum(w * loss) / normaliser over all its micro-batches and processes (draw_step). The
    # normaliser is known before any forward for decay (its weight sum) and for D-PACE's tokens and rows. D-PACE's
    # weight sum is known only after the last forward: the scored-slot count stands in for it (gradients of the
    # usual size), and the gradients are rescaled by count / weight sum once every micro-batch is through.
    rescale = objective["weighting"] == "dpace" and objective["normaliser"] == "weights"
    if rescale:
        if acc.distributed_type == DistributedType.DEEPSPEED:  # DeepSpeed steps inside backward(), before a rescale
            raise UserError("train.dpace_normaliser=weights rescales the gradients after the last micro-batch, "
                            "which DeepSpeed does not allow: use train.dpace_normaliser=tokens, or DDP / FSDP")
    if objective["weighting"] == "decay":
        local = sum(loss_weight(m.blocks, cfg.gamma) for m in micro_batches).float()
    elif objective["normaliser"] == "rows":
        local = float(sum(len(m.rows) for m in micro_batches))
    else:  # tokens (and the stand-in of weights): the shapes of the scored-slot indices, known on the host
        local = float(sum(m.blocks.scored_index.shape[0] for m in micro_batches))
    # Nothing in here reads a device value back (tests/test_host_reads.py): a read waits for every queued
    # kernel, and the GPU then idles while the host queues the next ones. The host counts come from draw_step.
    tokens = float(sum(m.n_tokens for m in micro_batches))
    stop = run.stop.signalled
    if run.world > 1:  # one collective for all three: the step's normaliser (the loss denominator), its tokens and
        # whether a process had a SIGTERM (so that every process stops after the same step)
        trio = torch.stack([torch.as_tensor(local, dtype=torch.float32, device=dev),
                            torch.tensor(tokens, dtype=torch.float32, device=dev),
                            torch.tensor(float(stop), dtype=torch.float32, device=dev)])
        step_norm, tokens_all, stops = acc.reduce(trio, "sum")
        stop = bool(stops > 0)  # read with tokens_all below: no second wait
    else:  # nothing to add up: reading a GPU sum back would wait for the previous step's queue
        step_norm, tokens_all = local, tokens
    denom = step_norm.clamp_min(1e-12) if torch.is_tensor(step_norm) else max(step_norm, 1e-12)
    scale = run.world / denom  # DDP / FSDP average gradients over processes: scale so they sum instead
    zero = torch.zeros((), device=dev)
    stats = StepStats(loss=zero.clone(), ce_sum=zero.clone(), kl_sum=zero.clone(), tokens_all=int(tokens_all),
                      stop=stop)
    # DFlash2: its own block embedding and the selector term (on the unwrapped drafter: under DDP the selector is
    # used outside the wrapper's forward, and its gradients still reach the wrapper's hooks through the loss)
    drafter = acc.unwrap_model(model)
    selector = selector_term(drafter, cfg.train.selector_loss_alpha)
    embed = block_embedder(drafter, target.embed_tokens)
    if selector is not None:
        stats.selector_ce_sum = zero.clone()
    dpace_weight = zero.clone()  # this process's D-PACE weight sum (rescale)
    for i, m in enumerate(micro_batches):
        batch = feats.get_batch(m.rows)  # an offline store's provider checks its tokens against the prepared rows
        # with the host's contiguity check the mask reads nothing back: it queues behind the target's forward
        mask = attention_masks(drafter_cfg, m.blocks, m.doc, m.pos, run.use_flex, m.contiguous)
        sync = i == len(micro_batches) - 1
        # an offline store's top-k comes from the host: a plain copy would wait for the GPU's queue
        topk_ids, topk_lp = (None if t is None else to_device(t, dev) for t in (batch.topk_ids, batch.topk_logprobs))
        with (contextlib.nullcontext() if sync else acc.no_sync(model)), acc.autocast():
            hidden = drafter_forward(model, embed, m.blocks, batch.features.to(dev), m.pos, mask)
            out = block_loss(hidden, m.blocks, target.lm_head.weight, chunk=cfg.train.ce_chunk,
                             mode=cfg.train.loss, kl_weight=cfg.train.kl_weight, topk_ids=topk_ids,
                             topk_logprobs=topk_lp, selector=selector, **objective)
            acc.backward(out.weighted_sum * scale)
        stats.loss += out.weighted_sum.detach() / denom
        dpace_weight = dpace_weight + out.weight
        stats.slot_weight = stats.slot_weight + out.slot_weight
        stats.ce_sum, stats.kl_sum = stats.ce_sum + out.ce_sum, stats.kl_sum + out.kl_sum
        if out.selector_ce_sum is not None:
            stats.selector_ce_sum = stats.selector_ce_sum + out.selector_ce_sum
        stats.scored += out.scored
        for k, v in simulated_acceptance(out.correct, out.label_mask, out.valid).items():
            stats.acceptance[k] = stats.acceptance[k] + v if k in stats.acceptance else v
        stats.tokens += m.n_tokens  # the provider's rows are these rows (an offline store's are checked)
        stats.flops += m.flops
        stats.anchors = stats.anchors + out.valid.sum()  # on the device: an int() here waited for the backward
    if rescale:
        rescale_gradients(run, model, stats, denom, dpace_weight)
    if cfg.train.clip > 0:
        stats.grad_norm = acc.clip_grad_norm_(model.parameters(), cfg.train.clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


def rescale_gradients(run: Run, model, stats: StepStats, stand_in, weight: torch.Tensor) -> None:
    """D-PACE normalised by its weight sum: the micro-batches were normalised by ``stand_in`` (the step's scored
    slots); now that the step's weight sum is known (one collective, no read back), the gradients and the logged
    loss become those of ``sum w loss / sum w``. Exact: the gradients are linear in the loss."""
    total = (run.accelerator.reduce(weight, "sum") if run.world > 1 else weight).clamp_min(1e-12)
    factor = stand_in / total
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)  # a 0-dim tensor: FSDP2's DTensor gradients take it as replicated
    stats.loss = stats.loss * factor


def reshard_position(step_in_epoch: int, rows_per_step_before: int, rows_per_step_now: int) -> tuple[int, int]:
    """(step in epoch, rows trained again) for a run resumed with another process count.

    ``epoch_order`` deals one permutation out rank by rank, so after k steps the processes together have
    trained on its first ``k x rows_per_step`` rows, whatever their number: the resumed run starts at the
    step of the new size that covers no more than those (the rest of the last one, fewer rows than one
    step, is trained again; none is skipped). Keeping the step number instead repeated or skipped rows."""
    done = step_in_epoch * rows_per_step_before
    step = done // rows_per_step_now
    return step, done - step * rows_per_step_now


def advance(state: LoopState, sched: Schedule, stats: StepStats) -> None:
    """One optimizer step taken; an epoch's end moves to the next epoch's first step."""
    state.step += 1
    state.step_in_epoch += 1
    state.tokens_seen += stats.tokens_all
    if state.step_in_epoch >= sched.steps_per_epoch:
        state.epoch, state.step_in_epoch = state.epoch + 1, 0


class TrainingDiverged(UserError, RuntimeError):
    """The loss or the drafter's weights became NaN / inf: stop before anything non-finite is saved."""


def nonfinite_weights(run: Run, model) -> bool:
    """True when any process holds a NaN / inf weight (one collective, so every process agrees: an FSDP
    shard that went bad on one rank stops all of them)."""
    bad = torch.zeros((), device=run.device)
    for p in model.parameters():
        local = p.detach()
        local = local.to_local() if hasattr(local, "to_local") else local  # an FSDP2 DTensor: this rank's shard
        bad = bad + (~torch.isfinite(local)).any().float()
    return bool(run.accelerator.reduce(bad, "sum") > 0)


def diverged(run: Run, step: int | None, what: str) -> TrainingDiverged:
    """The error that ends a diverged run: what went non-finite, and what the user can change."""
    t = run.cfg.train
    newest = latest_checkpoint(run.out_dir)
    kept = f"the newest checkpoint, {newest}, was saved before it" if newest else "no checkpoint was saved"
    at = "" if step is None else f" at step {step}"
    return TrainingDiverged(
        f"training diverged{at}: {what}. Nothing non-finite was saved ({kept}). Lower train.lr "
        f"(now {t.lr}), raise train.warmup_ratio (now {t.warmup_ratio}) or keep train.clip > 0 (now {t.clip}), "
        "and start again")


def flop_counter(cfg, drafter_cfg, target) -> Callable:
    """``count(blocks, tokens)``: model FLOPs of a micro-batch as ``train.bench`` counts them (``train.flops``):
    the drafter's forward + backward and, with online features, the target's tapped forward (its LM head too
    when the loss reads the target's logits)."""
    shape = DrafterShape.of(drafter_cfg)
    per_token = 0.0
    if cfg.features.mode == "online":
        per_token = target_flops(tapped_parameters(target, list(drafter_cfg.target_layer_ids),
                                                   with_logits=cfg.train.loss != "ce"), 1)

    def count(blocks, tokens: int) -> float:
        return drafter_flops(shape, blocks, int(blocks.scored_index.numel()), tokens) + per_token * tokens
    return count


# ----------------------------------------------------------------------------- logging
class Throughput:
    """Tokens, anchors and model FLOPs per second since the last logged step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.t, self.tokens, self.anchors, self.flops = time.perf_counter(), 0, 0, 0.0

    def add(self, stats: StepStats) -> None:
        self.tokens += stats.tokens
        self.anchors += stats.anchors
        self.flops += stats.flops

    def skip(self, seconds: float) -> None:
        """Leave ``seconds`` out of the rates (an eval or a checkpoint between steps)."""
        self.t += seconds


def utilisation(run: Run, flops_per_s: float) -> dict:
    """On CUDA, ``tflops`` (model FLOP/s of every process) and ``mfu`` (per process, against the card's dense
    bf16 peak: ``train.flops.PEAK_BF16_TFLOPS``, the table ``train.bench`` divides by); nothing on a CPU."""
    if run.device.type != "cuda":
        return {}
    peak = peak_tflops(torch.cuda.get_device_name(run.device))
    row = {"tflops": round(flops_per_s / 1e12, 2)}
    if peak:
        row["mfu"] = round(flops_per_s / run.world / 1e12 / peak, 4)
    return row


def step_row(run: Run, state: LoopState, stats: StepStats, scheduler, speed: Throughput,
             epoch_progress: float) -> dict:
    """The logged row of a step: loss / CE / KL / tau reduced over processes, lr, grad norm, speed."""
    acc, dev = run.accelerator, run.device
    loss = acc.reduce(stats.loss.float(), "sum")  # each process holds its share
    scored = acc.reduce(torch.tensor(float(stats.scored), device=dev), "sum").clamp_min(1)
    ce = acc.reduce(stats.ce_sum.float(), "sum") / scored
    kl = acc.reduce(stats.kl_sum.float(), "sum") / scored
    sel_ce = None if stats.selector_ce_sum is None else acc.reduce(stats.selector_ce_sum.float(), "sum") / scored
    tau_sum = acc.reduce(stats.acceptance["tau_sum"], "sum")
    blocks = acc.reduce(stats.acceptance["blocks"], "sum")
    # The step's share of the loss weight at each block slot (sums to 1), for decay and D-PACE alike: where the loss
    # goes. D-PACE's moves to later slots as the drafter gets them right.
    w_slot = acc.reduce(torch.as_tensor(stats.slot_weight, dtype=torch.float32, device=dev), "sum")
    w_slot = w_slot / w_slot.sum().clamp_min(1e-12)
    dt = time.perf_counter() - speed.t
    return {"step": state.step, "epoch": round(epoch_progress, 4), "loss": float(loss), "ce": float(ce),
            "tau": float(tau_sum / blocks.clamp_min(1)),
            **({"kl": float(kl)} if run.cfg.train.loss != "ce" else {}),
            **({"selector_ce": float(sel_ce)} if sel_ce is not None else {}),  # DFlash2; tau is then the walk's
            "w_slot": [round(float(w), 3) for w in w_slot.tolist()],
            "lr": scheduler.get_last_lr()[0],
            "grad_norm": None if stats.grad_norm is None else float(stats.grad_norm),
            "tokens_per_s": round(speed.tokens * run.world / dt, 1),
            "anchors_per_s": round(int(speed.anchors) * run.world / dt, 1),
            **utilisation(run, speed.flops * run.world / dt)}


def run_eval(run: Run, drafter, target, eval_feats, prompts: list[list[int]], step: int, with_true: bool,
             logger, total: int | None = None) -> dict:
    """Held-out simulated tau (and true tau with the torch loop) on the main process; logged (``total``: the
    run's steps, for the console line).

    Under FSDP every process runs it too: the drafter's forward all-gathers its sharded weights, a
    collective that would wait forever for processes that skipped it.
    """
    cfg = run.cfg
    row: dict = {"step": step}
    sharded = run.accelerator.distributed_type == DistributedType.FSDP
    if (run.is_main or sharded) and len(eval_feats):
        row.update(evaluate_sim(drafter, target, eval_feats, list(range(len(eval_feats))),
                                batch_size=cfg.train.batch_size, num_anchors=cfg.train.anchors,
                                objective=cfg.loss_weighting(),
                                # eval.batches counts optimizer-step batches (batch x accum x processes rows), so
                                # the held-out rows, and the figure, do not depend on how a step is split
                                seed=cfg.train.seed, max_batches=cfg.eval.batches * cfg.train.grad_accum * run.world,
                                use_flex=run.use_flex, selector_loss_alpha=cfg.train.selector_loss_alpha,
                                ce_chunk=cfg.train.ce_chunk, autocast=run.accelerator.autocast))
        if with_true and prompts:
            with run.accelerator.autocast():
                row.update(true_tau(drafter, target, prompts, cfg.eval.true_tau_max_new_tokens))
        if run.is_main:
            logger.log(row, echo=eval_line(row, total))
    run.accelerator.wait_for_everyone()
    return row


def eval_due(cfg, step: int, final: bool) -> tuple[bool, bool]:
    """(evaluate now, with a true-tau generation)."""
    now = final or bool(cfg.eval.every and step % cfg.eval.every == 0)
    with_true = final or bool(cfg.eval.true_tau_every and step % cfg.eval.true_tau_every == 0)
    return now, now and with_true


def true_tau_cadence_note(cfg) -> str | None:
    """What ``eval.true_tau_every`` will really do, when that is not what it says: true tau runs inside an eval
    (``eval_due``), so without evals, without prompts or off the eval cadence it silently ran less or never."""
    every, ev = cfg.eval.true_tau_every, cfg.eval.every
    if not every:
        return None
    if not cfg.eval.true_tau_prompts:
        return (f"eval.true_tau_every={every} does nothing with eval.true_tau_prompts=0: give prompts to measure "
                "true tau on, or drop eval.true_tau_every")
    if not ev:
        return (f"eval.true_tau_every={every} runs with an eval and eval.every=0: true tau only at the end; set "
                f"eval.every={every} (or a divisor of it)")
    both = math.lcm(every, ev)
    if both != every:
        return (f"eval.true_tau_every={every} runs with an eval (eval.every={ev}): true tau every {both} steps; "
                f"make eval.true_tau_every a multiple of eval.every")
    return None


def checkpoint_due(cfg, step: int, final: bool) -> bool:
    return final or bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0)


def stop_due(run: Run, stats: StepStats | None = None) -> bool:
    """Whether the run stops now for a SIGTERM. One process decides alone. Several decide together, so that they
    save the same checkpoint: after a step, by the flag its collective carried (``StepStats.stop``: some process
    had one when the step began); after an eval (``stats`` None), by one collective of their own."""
    if run.world == 1:
        return run.stop.signalled
    if stats is not None:
        return stats.stop
    flag = torch.tensor(float(run.stop.signalled), device=run.device)
    return bool(run.accelerator.reduce(flag, "sum") > 0)


# ----------------------------------------------------------------------------- interruption
# (the signals and the resume command: train/interrupt.py)
def interrupted_message(out_dir: Path, state: LoopState, args: list[str], world: int,
                        what: str = "interrupted") -> str:
    """What Ctrl-C (and SIGTERM: ``what``) prints: the newest checkpoint and the exact resume command."""
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        where = ("no checkpoint was written yet (checkpoint.every sets how often), so resuming starts from "
                 "scratch; run again with")
    else:
        where = f"newest checkpoint: {ckpt}; resume from it with"
    return f"{what} at step {state.step}: {where}:\n  {resume_command(args, world)}{launcher_note(world)}"
