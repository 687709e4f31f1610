"""Where a drafter came from: a training run folder's file layout and the ``draftsmith`` provenance block.

Training writes the block into every drafter folder it saves (``train/distill.py``) and exports
record it (``export/source.py``), so both read it from here: ``train/`` and ``export/`` never import
each other (docs/design.md, "Import directions"). The run folder, as plain files:

    checkpoints/step_<N>/      a checkpoint (``STEP_DIR``; written by ``train/checkpoint.py``)
    final/trained.json         ``FINAL_STATE``: {"step": N}, the optimizer steps of ``final/drafter``
    config.yaml                the resolved run config, read as plain YAML
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from models.quantization import describe_mlx, is_mlx_quantized, parse_quantization

STEP_DIR = re.compile(r"^step_(\d+)$")
FINAL_STATE = "trained.json"  # in final/: {"step": N}, the optimizer steps of final/drafter


def replaced_by_training(path: str | Path) -> Path | None:
    """The part of a training run folder that ``path`` lies in and training replaces whole, or None:
    ``final/`` (rewritten by every save of the final drafter: a resumed or repeated run) or a
    ``checkpoints/step_<N>/`` (removed when newer ones pass ``checkpoint.keep_last``). A report or an
    export written there would be lost without a word; the tools that write one refuse such an ``--out``."""
    p = Path(path).absolute()
    for part in (p, *p.parents):
        if part.name == "final" and (part / FINAL_STATE).is_file():
            return part
        if STEP_DIR.match(part.name) and part.parent.name == "checkpoints":
            return part
    return None


def refuse_training_output(out: str | Path, what: str, beside: str) -> None:
    """``ValueError`` when ``out`` lies where training replaces files (``replaced_by_training``);
    ``what``: what would be written there, ``beside``: a folder name to suggest next to the run."""
    part = replaced_by_training(out)
    if part is None:
        return
    run = part.parent if part.name == "final" else part.parent.parent
    why = ("every save of the final drafter (a resumed or repeated run) replaces it whole" if part.name == "final"
           else "newer checkpoints remove it")
    raise ValueError(f"--out {out} is inside the training output {part}: {why}, and the {what} would go with it. "
                     f"Write it beside the run instead, e.g. --out {run / beside}")


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


# The decay weighting's paper gamma by block size (docs/design.md, "Training objective"): train/config.py resolves
# train.gamma with it, and the block below names the objective of a run config that left gamma unset.
GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}
DPACE_ALPHA = 0.5  # D-PACE's smoothing when train.dpace_alpha is unset (the paper's and its ports' value)
NORMALISER_WORDS = {"weights": "weight sum", "tokens": "scored tokens", "rows": "rows"}

# Keys of the run config worth recording: enough to say how the drafter was trained, no paths to caches.
DATA_KEYS = ("source", "split", "subset", "limit", "regenerate", "thinking", "max_length", "pack")
TRAIN_KEYS = ("epochs", "max_steps", "batch_size", "grad_accum", "lr", "schedule", "anchors", "loss", "seed")


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
        "objective": objective_of_run(run),
        "quantized_target": quantized_target(target.get("quantization")),
    }
    return {k: v for k, v in prov.items() if v not in (None, {}, "")}


def quantized_target(quantization: str | None) -> str | None:
    """``target.quantization=mlx:DIR``: DIR, the weights the drafter was trained against (a local folder by its
    absolute path, as the target is recorded); its MLX commands and card name it. None for any other value."""
    try:
        spec = parse_quantization(quantization)
    except ValueError:
        return None
    if spec.kind != "mlx" or not spec.path:
        return None
    folder = Path(spec.path).expanduser()
    return str(folder.resolve()) if folder.is_dir() else spec.path


def trained_against(path: str, quantization: str | None) -> str:
    """The "trained against" line of exports and model cards, from a run's ``target.path`` and
    ``target.quantization`` (a ``target.path`` that is itself an MLX folder counts as ``mlx:PATH``)."""
    spec = parse_quantization(quantization)
    if spec.kind == "none":
        folder = Path(str(path)).expanduser()
        if folder.is_dir() and is_mlx_quantized(folder):
            return f"mlx:{path} ({describe_mlx(json.loads((folder / 'config.json').read_text()))})"
        return "none (unquantized weights)"
    folder = Path(spec.path).expanduser() if spec.kind == "mlx" and spec.path else None
    if folder is not None and folder.is_dir() and is_mlx_quantized(folder):  # mlx:DIR: the folder, by its full path
        return f"mlx:{folder.resolve()} ({describe_mlx(json.loads((folder / 'config.json').read_text()))})"
    return spec.describe()


def objective_of_run(run: dict[str, Any]) -> dict[str, Any] | None:
    """The loss weighting a run config trained with: ``{"weighting": "decay", "gamma": 7.0}`` or ``{"weighting":
    "dpace", "alpha": 0.5, "normaliser": "weights"}``. A config saved before ``train.loss_weighting`` existed trained
    with decay; None for a config that records neither (not a saved run config)."""
    train = run.get("train") or {}
    if "loss_weighting" not in train and "gamma" not in train:
        return None
    if train.get("loss_weighting", "decay") == "dpace":
        alpha = train.get("dpace_alpha")
        return {"weighting": "dpace", "alpha": DPACE_ALPHA if alpha is None else alpha,
                "normaliser": train.get("dpace_normaliser") or "weights"}
    gamma = train.get("gamma")
    if gamma is None:
        gamma = GAMMA_BY_BLOCK.get((run.get("drafter") or {}).get("block_size", 16))
    return {"weighting": "decay", "gamma": gamma}


def describe_objective(objective: dict[str, Any]) -> str:
    """``decay (gamma 7)`` or ``D-PACE (alpha 0.5, normalised by weight sum)``: the loss weighting in words."""
    if objective.get("weighting") == "dpace":
        alpha, norm = objective.get("alpha", DPACE_ALPHA), objective.get("normaliser", "weights")
        return f"D-PACE (alpha {alpha:g}, normalised by {NORMALISER_WORDS.get(norm, norm)})"
    gamma = objective.get("gamma")
    return "decay" if gamma is None else f"decay (gamma {gamma:g})"


def describe_target_quantization(path: str | None, quantization: str | None = None) -> str | None:
    """The "trained against" line: ``trained_against`` (train's ``target.quantization``, or an
    MLX-quantized target folder), else a transformers ``quant_method`` the target folder declares."""
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
