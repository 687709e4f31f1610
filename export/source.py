"""What an export reads: a drafter folder and where it came from (target, recipe, steps, data).

``--checkpoint`` accepts, in this order of precedence:

    runs/NAME/checkpoints/step_N/   a training checkpoint (drafter/ + config.yaml + trainer_state.json)
    runs/NAME/final/drafter/        the final drafter (its run config is ../config.yaml)
    runs/NAME/                      a run folder (its final/drafter/)
    any drafter folder              config.json + safetensors (e.g. an earlier export)

The provenance block (``draftsmith`` in config.json) is built from the run config saved next to the
drafter, read as plain YAML: export never imports ``train/``. A folder that already carries one
(an earlier export) keeps it; command-line values (``--target``) win over both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from models.config import DFlashConfig
from models.config_layout import is_drafter_config
# The block's builders and the run folder's layout are shared with train/ (which writes them): models/provenance.py.
# describe_target_quantization and provenance_from_run are imported from here by export.hf and the tests.
from models.provenance import (FINAL_STATE, STEP_DIR, checkpoint_dirs, describe_target_quantization,  # noqa: F401
                               latest_checkpoint, provenance_from_run, provenance_of_run)


class NotADrafterError(ValueError):
    """The folder given is not a drafter, a checkpoint or a run folder."""


@dataclass
class Source:
    drafter_dir: Path
    kind: str  # checkpoint | final | run | drafter
    provenance: dict[str, Any] = field(default_factory=dict)


def is_drafter_dir(path: Path) -> bool:
    """A folder whose config.json names a DFlash architecture (v1 or DFlash2) or has ``dflash_config``."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        d = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NotADrafterError(f"{cfg} is not valid JSON: re-export the drafter") from None
    return is_drafter_config(d)


def training_output(folder: Path) -> Path | None:
    """For a training run's drafter folder (``final/drafter``, ``checkpoints/step_N/drafter``), what
    ``--checkpoint`` takes to export it (the run folder, the checkpoint); None for any other folder."""
    if folder.name != "drafter":
        return None
    if (folder.parent / "trainer_state.json").is_file():
        return folder.parent
    if folder.parent.name == "final" and (folder.parent / "config.yaml").is_file():
        return folder.parent.parent
    return None


def resolve_source(path: str | Path) -> Source:
    """The drafter folder inside ``path`` and its provenance (see the module docstring for layouts)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"--checkpoint {p} does not exist: pass a checkpoint (runs/NAME/checkpoints/step_N), "
                                "a run folder (runs/NAME) or a drafter folder")
    if not p.is_dir():
        raise NotADirectoryError(f"--checkpoint {p} is a file: pass the folder that holds config.json "
                                 "(or a checkpoint / run folder)")
    if p.name == "drafter" and (p.parent / "trainer_state.json").is_file():
        p = p.parent  # a checkpoint's drafter/: read as its checkpoint (run config, steps), not a bare folder
    if (p / "drafter").is_dir() and (p / "trainer_state.json").is_file():
        if not is_drafter_dir(p / "drafter"):
            raise NotADrafterError(f"checkpoint {p}: drafter/ holds no DFlash config.json (the checkpoint is "
                                   "incomplete): pass another step_N or the final drafter")
        prov = _from_run(p / "config.yaml", p / "trainer_state.json", p / "drafter", run_root=p.parent.parent)
        return Source(p / "drafter", "checkpoint", prov)
    incomplete_checkpoint(p)
    if is_drafter_dir(p):
        run_cfg = p.parent / "config.yaml"
        kind = "final" if run_cfg.is_file() and p.parent.name == "final" else "drafter"
        return Source(p, kind, _from_run(run_cfg if kind == "final" else None, _final_state(p.parent), p,
                                         run_root=p.parent.parent))
    if is_drafter_dir(p / "final" / "drafter"):
        d = p / "final" / "drafter"
        newer = _checkpoint_after_final(p)
        if newer is not None:  # a finished run resumed to train longer, stopped before its new end
            raise NotADrafterError(
                f"{p} holds two drafters: final/drafter ({newer[1]} steps) and the newer {newer[0]} (training "
                f"was resumed and has not finished): pass {d} for the finished one, or {newer[0]}")
        return Source(d, "run", _from_run(p / "final" / "config.yaml", _final_state(p / "final"), d, run_root=p))
    if (p / "checkpoints").is_dir():
        raise NotADrafterError(f"{p} is a run folder without final/drafter (training did not finish): pass one of "
                               f"its checkpoints, e.g. {p}/checkpoints/step_N")
    what = "config.json is not a DFlash drafter's" if (p / "config.json").is_file() else "no config.json"
    raise NotADrafterError(f"{p} is not a drafter folder ({what}), a checkpoint or a run folder: pass "
                           "runs/NAME/checkpoints/step_N, runs/NAME/final/drafter or runs/NAME")


def incomplete_checkpoint(p: Path) -> None:
    """A checkpoint folder (``checkpoints/step_N``, or one holding ``trainer_state.json`` or ``state/``) without
    its ``drafter/`` or ``trainer_state.json``: name the missing part (the generic "not a drafter folder, pass
    runs/NAME/checkpoints/step_N" repeated what the user had passed) and a complete checkpoint beside it."""
    named = bool(STEP_DIR.match(p.name)) and p.parent.name == "checkpoints"
    if not (named or (p / "trainer_state.json").is_file() or (p / "state").is_dir()):
        return
    missing = [part for part, there in (("drafter/", is_drafter_dir(p / "drafter")),
                                        ("trainer_state.json", (p / "trainer_state.json").is_file())) if not there]
    if not missing:
        return
    holds = sorted(f.name + ("/" if f.is_dir() else "") for f in p.iterdir())
    others = [c for c in checkpoint_dirs(p.parent.parent) if c != p and is_drafter_dir(c / "drafter")
              and (c / "trainer_state.json").is_file()] if named else []
    fix = (f"pass another checkpoint (the newest complete one: {others[-1]})" if others else
           "pass another checkpoint or the run's final drafter")
    if missing == ["trainer_state.json"]:
        fix += f", or --checkpoint {p / 'drafter'} to export its drafter without the run's step count"
    what = " and ".join(f"no {m}" + (" (or no config.json in it)" if m == "drafter/" and (p / "drafter").is_dir()
                                     else "") for m in missing)
    raise NotADrafterError(f"checkpoint {p} is incomplete: {what} (it holds {', '.join(holds) or 'nothing'}; a "
                           f"checkpoint holds drafter/, state/, config.yaml and trainer_state.json): {fix}")


def full_precision_source(checkpoint: str | Path, command: str) -> Source:
    """``resolve_source`` for an export, refusing a quantized MLX export as the source (both exports
    need the full-precision drafter: re-exporting quantized weights would compound the error)."""
    src = resolve_source(checkpoint)
    if DFlashConfig.load(src.drafter_dir).quantization:
        raise ValueError(f"{src.drafter_dir} is already a quantized MLX export: {command} needs the full-precision "
                         "drafter (the training checkpoint or final/drafter)")
    return src


def _from_run(run_config: Path | None, trainer_state: Path | None, drafter_dir: Path,
              run_root: Path | None = None) -> dict[str, Any]:
    # The drafter's own block wins: training writes it from the data it actually trained on (a prepared
    # folder named by data.prepared may differ from the recipe's data keys); older drafters have none.
    existing = json.loads((drafter_dir / "config.json").read_text()).get("draftsmith") or {}
    prov: dict[str, Any] = {}
    if run_config is not None and run_config.is_file():
        try:
            run = yaml.safe_load(run_config.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{run_config} is not valid YAML ({e}); it is the run config saved by training") from None
        prov.update(provenance_of_run(run, run_root))
    prov.update(existing)
    steps = _steps(trainer_state, run_config)
    if steps is not None:
        prov["steps"] = steps
    return prov


def _checkpoint_after_final(run: Path) -> tuple[Path, int] | None:
    """(the newest checkpoint, final/drafter's steps) when that checkpoint is past final/drafter's step."""
    state, newest = _final_state(run / "final"), latest_checkpoint(run)
    if state is None or newest is None:
        return None
    try:
        final_step = int(json.loads(state.read_text())["step"])
    except (ValueError, KeyError, TypeError):
        return None  # unreadable: the provenance reader names it
    return (newest, final_step) if int(STEP_DIR.match(newest.name).group(1)) > final_step else None


def _final_state(final: Path) -> Path | None:
    """``final/trained.json``: the step count training wrote with ``final/drafter`` (None before it did)."""
    return final / FINAL_STATE if (final / FINAL_STATE).is_file() else None


def _steps(trainer_state: Path | None, run_config: Path | None) -> int | None:
    """Optimizer steps: the drafter's own count (a checkpoint's trainer state, ``final/trained.json``),
    else, for a final drafter written before it was recorded, the last step in the run's metrics (a
    resumed run killed later may have logged more steps than ``final/`` holds: hence the own count first)."""
    if trainer_state is not None and trainer_state.is_file():
        try:
            return int(json.loads(trainer_state.read_text())["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{trainer_state} holds no integer 'step': the folder is damaged: pass another "
                             "checkpoint (step_N) or rerun training with resume=true to write final/ again") from None
    if run_config is None:
        return None
    metrics = run_config.parent.parent / "metrics.jsonl"  # final/config.yaml -> runs/NAME/metrics.jsonl
    if not metrics.is_file():
        return None
    last = None
    for line in metrics.read_text().splitlines():
        try:
            last = max(last or 0, int(json.loads(line)["step"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return last
