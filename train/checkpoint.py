"""Self-describing checkpoints: ``checkpoints/step_<N>/`` holds everything to resume or to serve.

    step_<N>/drafter/        HF drafter folder (config.json, safetensors, modeling file): loads directly
    step_<N>/state/          accelerate state: model, optimizer, scheduler, RNG of every process
    step_<N>/config.yaml     the resolved run config
    step_<N>/trainer_state.json  the loop state (``train.loop.LoopState``): step, epoch, step in
                             epoch (the data order is a pure function of seed and epoch, so this
                             is the whole data-order state), tokens seen, the wandb run id, and
                             the identity of the prepared rows (a resume on other rows is refused)

A checkpoint is written to ``step_<N>.tmp`` and renamed when complete, so a kill mid-save never
leaves a half checkpoint that ``resume=true`` would pick. Only the newest ``keep_last`` are kept.

``resume=true`` first compares the run's config with the checkpoint's ``config.yaml``
(:func:`check_resume_config`): a changed key that alters the model, the objective or the data
order is refused, naming each one; a change to one of the short list of :data:`HARMLESS_KEYS`
(logging, eval and checkpoint cadence, settings the loop never reads) is only reported, as is a
new length (:data:`LENGTH_KEYS`) that does not end before the checkpoint's step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml

from models.support import UserError
# The run folder's file layout lives in models/provenance.py: export/ reads run folders too, and never imports train/
from models.provenance import FINAL_STATE, STEP_DIR, checkpoint_dirs, latest_checkpoint  # noqa: F401


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be written (a full disk) or read back (damaged after it was written)."""


def save_drafter(accelerator, model, directory: Path, dtype: torch.dtype | None = None) -> None:
    """The HF drafter folder, from the full state dict (works under DDP / FSDP / DeepSpeed)."""
    from models.drafter2 import drafter_class

    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        copy = drafter_class(unwrapped.config)(unwrapped.config)
        copy.load_state_dict({k: v.detach().cpu() for k, v in state.items()})
        copy.save_pretrained(directory, dtype=dtype)


def save_checkpoint(accelerator, model, out_dir: Path, step: int, trainer_state: dict, config_yaml: str,
                    keep_last: int) -> Path:
    root = Path(out_dir) / "checkpoints"
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if accelerator.is_main_process:
        for stale in root.glob("step_*.tmp"):  # cut short by an earlier kill: never complete, only space
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp / "state"))
        save_drafter(accelerator, model, tmp / "drafter")
        # save_state has every process write its own RNG state file, with no barrier after: a rename before
        # the slowest process was done left it writing into a folder that was gone (its launch failed after
        # the training had finished), or into a new step_N.tmp while step_N lacked its RNG state.
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "config.yaml").write_text(config_yaml)
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    except KeyboardInterrupt:  # Ctrl-C mid-save: the half-written one goes, the earlier ones are untouched
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as e:  # a full disk, a quota, a vanished mount: the earlier checkpoints are untouched
        shutil.rmtree(tmp, ignore_errors=True)  # the half-written one only takes space
        newest = latest_checkpoint(out_dir)
        raise CheckpointError(
            f"could not write the checkpoint of step {step} under {root} ({e.strerror or e}): "
            + (f"the newest complete one, {newest}, is intact: free space (or fix the folder) and rerun with "
               "resume=true" if newest else "no earlier checkpoint to resume from: free space and rerun")) from e
    if accelerator.is_main_process:
        for old in checkpoint_dirs(out_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, directory: Path) -> dict:
    """Restore model / optimizer / scheduler / RNG state; returns the trainer state."""
    import pickle

    from safetensors import SafetensorError

    from torch.distributed.checkpoint.api import CheckpointException

    state = read_trainer_state(directory)
    try:
        accelerator.load_state(str(Path(directory) / "state"))
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, SafetensorError, CheckpointException) as e:
        # torch.load, safetensors, pickle and (FSDP's sharded state) torch.distributed.checkpoint each raise
        # their own type for a damaged file; the last is a BaseException
        raise CheckpointError(f"could not restore the checkpoint {directory} ({type(e).__name__}: {_reason(e)}): "
                              f"a file under {Path(directory) / 'state'} is damaged or missing. "
                              + _fallback(directory)) from e
    return state


def _reason(e: BaseException) -> str:
    """The first sentence of a reader's error (torch's go on for lines); for a sharded (FSDP) read, the first
    failing rank's own error."""
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        rank, wrapped = next(iter(failures.items()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {type(inner).__name__}: {_reason(inner)}"
    return (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]


def read_trainer_state(directory: Path) -> dict:
    path = Path(directory) / "trainer_state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is missing or not JSON ({e}): the checkpoint is incomplete. "
                              + _fallback(directory)) from e


def _fallback(directory: Path) -> str:
    """What to do about a broken checkpoint: resume from the one before it, if any."""
    directory = Path(directory)
    m = STEP_DIR.match(directory.name)
    step = lambda d: int(STEP_DIR.match(d.name).group(1))  # noqa: E731
    older = [d for d in checkpoint_dirs(directory.parent.parent) if m and step(d) < int(m.group(1))]
    if older:
        return f"Delete (or move away) {directory} to resume from {older[-1]}"
    return f"Delete (or move away) {directory} to start over: it is the only checkpoint"


# ----------------------------------------------------------------------------- resume: changed settings
# Keys a resumed run may change: they steer logging, evaluation, checkpointing or the plan, never the
# model, the objective or the data order. A prefix ending in "." covers a whole section. Everything
# else is refused on resume, so a key added later is safe by default.
HARMLESS_KEYS = (
    "recipe", "out_dir", "resume", "dry_run", "devices", "logging.", "eval.", "checkpoint.", "export.",
    "train.attention", "train.ce_chunk", "train.grad_checkpointing",  # same math, other kernels / memory
    "train.compile", "train.flex_backward",  # the same attention, other kernel tiles
    "target.model_type", "target.num_layers", "target.hidden_size", "target.intermediate_size",  # dry-run facts
    "target.num_attention_heads", "target.num_key_value_heads", "target.head_dim", "target.vocab_size",
    "target.max_position_embeddings", "target.rope_theta", "target.params_b", "target.active_params_b",
    "target.weights_gib",
    "target.device_map", "target.max_memory",  # where the target's layers live, not what it computes
    # Where the prepared rows are read from, and whether they were rebuilt: the checkpoint records the rows'
    # identity (LoopState.rows), and a resume on other rows is refused by that, not by the folder's name.
    "data.prepared", "data.rebuild",
)
# The run's length may change on resume, to train longer (or stop sooner, though not before the
# checkpoint's step): the data order is a function of (seed, epoch) whatever the length, and the
# learning rate from the resumed step on follows the schedule of a run of the new length
# (``train.loop.resync_lr``), as if it had been started with it.
LENGTH_KEYS = ("train.epochs", "train.max_steps")


# What a checkpoint saved before a key existed trained with, where that is not necessarily the key's default
# now: the loss weighting was decay before train.loss_weighting existed, whatever the default becomes.
BEFORE_THE_KEY = {"train.loss_weighting": "decay"}


class ResumeConfigError(UserError, ValueError):
    """``resume=true`` with settings that would mix two different runs in one checkpoint."""


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and not prefix:  # sections are one level deep; values may be dicts
            out.update(_flat(v, f"{k}."))
        else:
            out[prefix + str(k)] = v
    return out


def is_harmless(key: str) -> bool:
    return any(key == h or (h.endswith(".") and key.startswith(h)) for h in HARMLESS_KEYS)


# Keys naming files or folders: ./run/target and run/target (or an absolute path) are the same folder.
PATH_KEYS = ("target.path", "data.source", "features.store")


def _same_path(a, b) -> bool:
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def config_changes(saved: dict, now: dict, defaults: dict) -> tuple[list[str], list[str]]:
    """(refused, harmless) changes between a checkpoint's config and this run's, as ``key: old -> new``.
    A key the checkpoint predates counts as its value before it existed (:data:`BEFORE_THE_KEY`), else as its
    default there."""
    old, new, dflt = _flat(saved), _flat(now), _flat(defaults)
    refused, harmless = [], []
    for key in sorted((set(old) | set(new)) - {"resume", "dry_run"}):  # the flags of this very command
        a, b = old.get(key, BEFORE_THE_KEY.get(key, dflt.get(key))), new.get(key, dflt.get(key))
        if a != b and not (key in PATH_KEYS and _same_path(a, b)):
            (harmless if is_harmless(key) or key in LENGTH_KEYS else refused).append(f"{key}: {a!r} -> {b!r}")
    return refused, harmless


def check_resume_config(ckpt: Path, cfg, log) -> None:
    """Refuse a resume whose settings change the model, the objective or the data order (see module doc)."""
    saved_file = Path(ckpt) / "config.yaml"
    if not saved_file.is_file():
        log(f"warning: {saved_file} is missing: cannot check that the settings match the checkpoint")
        return
    saved = yaml.safe_load(saved_file.read_text()) or {}
    refused, harmless = config_changes(saved, cfg.to_dict(), type(cfg)().to_dict())
    if refused:
        raise ResumeConfigError(
            f"resume=true, but {len(refused)} setting(s) differ from the checkpoint {ckpt} and would change the "
            f"model, the objective or the data order: {'; '.join(refused)}. Set them back (the checkpoint's "
            f"settings are in {saved_file}), or start a new run with another out_dir")
    if harmless:
        log(f"resume: settings changed since the checkpoint (harmless): {'; '.join(harmless)}")


def refuse_unfinished_run(out_dir: Path) -> bool:
    """Refuse a run without ``resume=true`` over an unfinished earlier one (no ``final/`` newer than its newest
    checkpoint: a crash, a forgotten ``resume=true``); True when a finished earlier run's checkpoints are there.

    Called before anything loads; the finished run's checkpoints are removed only by
    :func:`clear_for_fresh_start`, once the new run has loaded and checked all its inputs."""
    newest = latest_checkpoint(out_dir)
    if newest is None:
        return False
    final = Path(out_dir) / "final" / "config.yaml"
    state = newest / "trainer_state.json"
    finished = final.is_file() and (not state.is_file() or final.stat().st_mtime >= state.stat().st_mtime)
    if not finished:
        raise ResumeConfigError(
            f"{out_dir} holds an unfinished run (newest checkpoint {newest}, step "
            f"{read_trainer_state(newest).get('step', '?')}): resume=true continues it; to start over, delete "
            f"{Path(out_dir) / 'checkpoints'} (or choose another out_dir)")
    return True


def clear_for_fresh_start(out_dir: Path, log, accelerator) -> None:
    """A run without ``resume=true`` in an ``out_dir`` that holds an earlier run's checkpoints.

    Left there, they would mix with the new run's (the older steps stay, and a later ``resume=true``
    would pick the earlier run's newest). An unfinished earlier run is refused, never overwritten; a
    finished one is replaced, as its ``final/`` and ``metrics.jsonl`` are. Training calls this just
    before its first step: a rerun that stops on a mistake (a mistyped data.source) removed them at
    start, and the finished run could no longer be resumed to train longer.
    """
    if not refuse_unfinished_run(out_dir):
        return
    accelerator.wait_for_everyone()  # every process has decided before one of them removes anything
    if accelerator.is_main_process:
        old = checkpoint_dirs(out_dir)
        log(f"starting over in {out_dir}: removing the earlier (finished) run's checkpoints "
            f"{', '.join(p.name for p in old)} (resume=true continues a run instead)")
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()


def resume_checkpoint(cfg, out_dir: Path, log) -> Path | None:
    """The newest checkpoint under ``out_dir`` (None: start from scratch), its settings checked against ``cfg``."""
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None:
        log(f"resume=true but no checkpoint under {Path(out_dir) / 'checkpoints'}: starting from scratch")
        return None
    check_resume_config(ckpt, cfg, log)
    step = read_trainer_state(ckpt).get("step", 0)
    if cfg.train.max_steps is not None and step > cfg.train.max_steps:  # epochs: checked once the data is known
        raise ResumeConfigError(f"resume=true, but the checkpoint {ckpt} is at step {step}, past train.max_steps="
                                f"{cfg.train.max_steps}: raise it to train longer, or export that checkpoint as it is")
    return ckpt
