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

from models.config import ARCHITECTURE

# Keys of the run config worth recording: enough to say how the drafter was trained, no paths to caches.
DATA_KEYS = ("source", "split", "subset", "limit", "regenerate", "thinking", "max_length", "pack")
TRAIN_KEYS = ("epochs", "max_steps", "batch_size", "grad_accum", "lr", "schedule", "anchors", "loss", "seed")


class NotADrafterError(ValueError):
    """The folder given is not a drafter, a checkpoint or a run folder."""


@dataclass
class Source:
    drafter_dir: Path
    kind: str  # checkpoint | final | run | drafter
    provenance: dict[str, Any] = field(default_factory=dict)


def is_drafter_dir(path: Path) -> bool:
    """A folder whose config.json names the DFlash architecture."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        d = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NotADrafterError(f"{cfg} is not valid JSON: re-export the drafter") from None
    return isinstance(d, dict) and (ARCHITECTURE in (d.get("architectures") or []) or "dflash_config" in d)


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
    if (p / "drafter").is_dir() and (p / "trainer_state.json").is_file():
        if not is_drafter_dir(p / "drafter"):
            raise NotADrafterError(f"checkpoint {p}: drafter/ holds no DFlash config.json (the checkpoint is "
                                   "incomplete): pass another step_N or the final drafter")
        prov = _from_run(p / "config.yaml", p / "trainer_state.json", p / "drafter", run_root=p.parent.parent)
        return Source(p / "drafter", "checkpoint", prov)
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


def full_precision_source(checkpoint: str | Path, command: str) -> Source:
    """``resolve_source`` for an export, refusing a quantized MLX export as the source (both exports
    need the full-precision drafter: re-exporting quantized weights would compound the error)."""
    from models.config import DFlashConfig

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


def provenance_of_run(run: dict[str, Any], run_root: Path | None) -> dict[str, Any]:
    """:func:`provenance_from_run` with the target as a folder the loops can load: the tiny target training
    built in the run folder for ``tiny:<arch>``, a local folder by its absolute path (the recorded target is
    compared with ``--target`` wherever the command runs)."""
    prov = provenance_from_run(run)
    target = str(prov.get("target", ""))
    tiny = run_root / "tiny_target" if run_root is not None else None
    if target.startswith("tiny:") and tiny is not None and (tiny / "config.json").is_file():
        prov["target"] = str(tiny.resolve())
        quant = (run.get("target") or {}).get("quantization")
        prov["target_quantization"] = describe_target_quantization(prov["target"], quant)
    elif target and Path(target).expanduser().is_dir():
        prov["target"] = str(Path(target).expanduser().resolve())
    return prov


def data_provenance(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``data`` entry of the block from a prepared folder's ``draftsmith_data.json``: what training read."""
    return {k: meta.get("packed" if k == "pack" else k) for k in DATA_KEYS
            if meta.get("packed" if k == "pack" else k) is not None}


def provenance_from_run(run: dict[str, Any]) -> dict[str, Any]:
    """The ``draftsmith`` block from a resolved run config (as training saves it in config.yaml)."""
    target = run.get("target") or {}
    data = run.get("data") or {}
    train = run.get("train") or {}
    prov: dict[str, Any] = {
        "target": target.get("path") or None,
        "target_revision": target.get("revision"),
        "target_quantization": describe_target_quantization(target.get("path"), target.get("quantization")),
        "recipe": run.get("recipe") or None,
        "data": {k: data[k] for k in DATA_KEYS if data.get(k) is not None},
        "features": (run.get("features") or {}).get("mode"),
        "train": {k: train[k] for k in TRAIN_KEYS if train.get(k) is not None},
    }
    return {k: v for k, v in prov.items() if v not in (None, {}, "")}


def describe_target_quantization(path: str | None, quantization: str | None = None) -> str | None:
    """The "trained against" line: ``models.quant.trained_against`` (train's ``target.quantization``, or an
    MLX-quantized target folder), else a transformers ``quant_method`` the target folder declares."""
    from models.quant import trained_against

    try:
        line = trained_against(path or "", quantization)
    except ValueError:  # a value this version does not parse: record it as written
        return quantization
    folder = target_quantization(path)
    return folder if line.startswith("none") and folder not in (None, "none") else line


def target_quantization(target: str | None) -> str | None:
    """How the target the drafter was trained against is quantized, when its folder is here to read.

    ``mlx-affine-4bit-g64`` for an MLX quantized checkpoint, the ``quant_method`` of a transformers
    ``quantization_config``, ``none`` for plain weights; None when the target is not a local folder.
    """
    if not target or not (Path(target) / "config.json").is_file():
        return None
    try:
        cfg = json.loads((Path(target) / "config.json").read_text())
    except (json.JSONDecodeError, OSError):
        return None
    q = cfg.get("quantization") or (cfg.get("text_config") or {}).get("quantization")
    if isinstance(q, dict) and "bits" in q:
        return f"mlx-{q.get('mode', 'affine')}-{q['bits']}bit-g{q.get('group_size', 64)}"
    qc = cfg.get("quantization_config") or {}
    if isinstance(qc, dict) and qc.get("quant_method"):
        return str(qc["quant_method"])
    return "none"


def _checkpoint_after_final(run: Path) -> tuple[Path, int] | None:
    """(the newest checkpoint, final/drafter's steps) when that checkpoint is past final/drafter's step."""
    from train.checkpoint import STEP_DIR, latest_checkpoint

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
    from train.checkpoint import FINAL_STATE

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
