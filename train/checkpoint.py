"""Self-describing checkpoints: ``checkpoints/step_<N>/`` holds everything to resume or to serve.

    step_<N>/drafter/        HF drafter folder (config.json, safetensors, modeling file): loads directly
    step_<N>/state/          accelerate state: model, optimizer, scheduler, RNG of every process
    step_<N>/config.yaml     the resolved run config
    step_<N>/trainer_state.json  step, epoch, step in epoch (the data order is a pure function of
                             seed and epoch, so this is the whole data-order state), metrics so far

A checkpoint is written to ``step_<N>.tmp`` and renamed when complete, so a kill mid-save never
leaves a half checkpoint that ``resume=true`` would pick. Only the newest ``keep_last`` are kept.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dirs(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(out_dir)
    return dirs[-1] if dirs else None


def save_drafter(accelerator, model, directory: Path, dtype: torch.dtype | None = None) -> None:
    """The HF drafter folder, from the full state dict (works under DDP / FSDP / DeepSpeed)."""
    from models.drafter import DFlashDraftModel

    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        copy = DFlashDraftModel(unwrapped.config)
        copy.load_state_dict({k: v.detach().cpu() for k, v in state.items()})
        copy.save_pretrained(directory, dtype=dtype)


def save_checkpoint(accelerator, model, out_dir: Path, step: int, trainer_state: dict, config_yaml: str,
                    keep_last: int) -> Path:
    root = Path(out_dir) / "checkpoints"
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"))
    save_drafter(accelerator, model, tmp / "drafter")
    if accelerator.is_main_process:
        (tmp / "config.yaml").write_text(config_yaml)
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoint_dirs(out_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, directory: Path) -> dict:
    """Restore model / optimizer / scheduler / RNG state; returns the trainer state."""
    accelerator.load_state(str(Path(directory) / "state"))
    return json.loads((Path(directory) / "trainer_state.json").read_text())
