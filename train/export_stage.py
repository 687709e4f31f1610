"""The optional last stage of ``distill.py``: export (and push) the final drafter.

    python train/distill.py recipe=qwen3-8b export.hf=true export.mlx=true export.mlx_quantize=4 \\
        export.push_repo=me/Qwen3-8B-DFlash-b16

Runs the export commands as subprocesses (``python -m export.hf ...``) on the main process, so
``train/`` never imports ``export/`` (the import direction is models <- data <- train; export
imports models only) and an export failure names the exact command to re-run by hand. Folders:
``{out_dir}/export/hf`` and ``{out_dir}/export/mlx`` (``export.dir`` to change). A push needs
the HF export (``export.push_repo``) or the MLX one (``export.push_mlx_repo``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

import huggingface_hub  # get_token looked up at each call (tests stand in for it)

from models.hub import repo_id_problem


class ExportStageError(ValueError):
    """An export command of the final stage failed; the trained drafter is saved regardless."""


def check_export_stage(export_cfg) -> None:
    """What would fail the export stage only after the whole training, checked before anything loads: MLX for
    ``export.mlx``, a Hub token and a well-formed repo id for a push (the commands' own checks, run early)."""
    if export_cfg.mlx:
        try:
            import mlx.core  # noqa: F401  (optional dependency: is MLX installed here?)
        except ImportError:
            raise ExportStageError("export.mlx=true needs MLX, which is not installed here: pip install "
                                   "'draftsmith[mlx]' (mlx on macOS, mlx[cpu] on Linux), or drop export.mlx and run "
                                   "python -m export.mlx on the final drafter where MLX is") from None
    repos = {k: v for k, v in (("export.push_repo", export_cfg.push_repo),
                               ("export.push_mlx_repo", export_cfg.push_mlx_repo)) if v}
    if not repos:
        return
    for key, repo in repos.items():
        if problem := repo_id_problem(repo):
            raise ExportStageError(f"{key}={repo!r} is not a Hub repo id: {problem}")
    if huggingface_hub.get_token() is None:
        raise ExportStageError(f"{' and '.join(repos)} push to the Hub after training, and there is no Hugging Face "
                               "token: run `hf auth login` or set HF_TOKEN first, or drop the push and run python -m "
                               "export.push later")


def export_commands(export_cfg, final_drafter: Path, out_dir: Path) -> list[list[str]]:
    """The ``python -m export.*`` command lines for a run's ``export.*`` settings, in order (absolute paths: they
    run from the package's folder)."""
    root = (Path(export_cfg.dir) if export_cfg.dir else Path(out_dir) / "export").absolute()
    final_drafter = Path(final_drafter).absolute()
    py = [sys.executable, "-m"]
    cmds: list[list[str]] = []
    if export_cfg.hf:
        cmds.append(py + ["export.hf", "--checkpoint", str(final_drafter), "--out", str(root / "hf"),
                          "--dtype", export_cfg.hf_dtype, "--overwrite"])
    if export_cfg.mlx:
        cmd = py + ["export.mlx", "--checkpoint", str(final_drafter), "--out", str(root / "mlx"), "--overwrite"]
        if export_cfg.mlx_quantize:
            cmd += ["--quantize", str(export_cfg.mlx_quantize), "--group-size", str(export_cfg.mlx_group_size)]
        cmds.append(cmd)
    for repo, folder in ((export_cfg.push_repo, "hf"), (export_cfg.push_mlx_repo, "mlx")):
        if repo:
            cmd = py + ["export.push", "--folder", str(root / folder), "--repo", repo]
            cmds.append(cmd + (["--private"] if export_cfg.push_private else []))
    return cmds


def run_export_stage(export_cfg, final_drafter: Path, out_dir: Path, log: Callable[[str], None] = print) -> list[str]:
    """Run each export command; a failure raises with the command to re-run. Returns the command lines."""
    lines = []
    for cmd in export_commands(export_cfg, final_drafter, out_dir):
        line = shlex.join(["python"] + cmd[1:])
        log(f"export: {line}")
        # the package root on the path, so `-m export.*` resolves from any working directory
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        # from the package's folder: `python -m` puts the working folder first on sys.path, and a models.py or an
        # export/ there (ML project folders often hold them) would run instead of ours
        done = subprocess.run(cmd, env=env, cwd=root)
        if done.returncode != 0:
            raise ExportStageError(f"export stage failed (exit {done.returncode}); the drafter is saved in "
                               f"{final_drafter}. Fix the problem printed above and re-run: {line}")
        lines.append(line)
    return lines
