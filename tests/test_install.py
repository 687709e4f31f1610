"""A plain (non-editable) `pip install .` works outside the checkout: what it needs, checked cheaply.

The install itself is shown in the README (Install); here we pin its ingredients: recipes resolve
through the ``recipes`` package (importlib.resources, not a path relative to the source tree), the
package data globs in pyproject.toml cover every shipped recipe, the console scripts point at real
``main`` functions, ``python -m train.distill`` runs from another directory, and the ``draftsmith``
command runs from a folder holding a ``train.py`` and a ``models.py`` and stops on a package shadowed
through ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_recipes_resolve_through_the_package():
    from train.overrides import recipe_names, recipe_path, recipes_dir

    shipped = Path(str(files("recipes")))
    assert recipes_dir() == shipped
    names = recipe_names()
    assert {"tiny", "qwen3-8b", "qwen35-35b-a3b"} <= set(names)
    assert names == sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    for name in names:
        path = recipe_path(name)
        assert path.parent == shipped and isinstance(yaml.safe_load(path.read_text()), dict), name


def test_package_data_ships_every_recipe():
    cfg = pyproject()["tool"]["setuptools"]
    assert "recipes*" in cfg["packages"]["find"]["include"]
    assert (ROOT / "recipes" / "__init__.py").is_file()  # a package, so package data applies
    globs = cfg["package-data"]["recipes"]
    shipped = {p.relative_to(ROOT / "recipes") for g in globs for p in (ROOT / "recipes").glob(g)}
    on_disk = {p.relative_to(ROOT / "recipes") for p in (ROOT / "recipes").rglob("*.yaml")}
    assert on_disk and shipped == on_disk, f"not shipped: {sorted(map(str, on_disk - shipped))}"


def test_package_data_ships_every_data_file():
    """Every non-Python file inside an installed package matches a package-data glob (prompt sets too)."""
    from fnmatch import fnmatch

    cfg = pyproject()["tool"]["setuptools"]
    data = cfg["package-data"]
    missing = []
    for top in (p.rstrip("*") for p in cfg["packages"]["find"]["include"]):
        for f in (ROOT / top).rglob("*"):
            if not f.is_file() or f.suffix in (".py", ".pyc") or "__pycache__" in f.parts:
                continue
            package = f.parent.relative_to(ROOT).as_posix().replace("/", ".")
            by_name = any(fnmatch(f.name, g) for g in data.get("*", []) + data.get(package, []))
            by_path = any(fnmatch(f.relative_to(ROOT / top).as_posix(), g) for g in data.get(top, []))
            if not (by_name or by_path):
                missing.append(str(f.relative_to(ROOT)))
    assert not missing, f"not shipped by a plain pip install: {missing}"


def test_dependencies_and_extras():
    project = pyproject()["project"]
    names = {d.split(";")[0].split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
             for d in project["dependencies"]}
    assert {"torch", "transformers", "accelerate", "datasets", "pyarrow", "safetensors"} <= names
    dev = project["optional-dependencies"]["dev"]
    # [mlx] and [plot] (validate's tests read the PNGs) come in by name, not repeated
    assert "draftsmith[mlx,plot]" in dev and not any(d.startswith(("mlx", "matplotlib")) for d in dev)
    assert project["optional-dependencies"]["plot"] == ["matplotlib"]


def test_console_scripts_point_at_real_mains():
    """``draftsmith`` is the command dispatcher; each ``draftsmith-*`` script is its module's ``cli`` (``main``
    through ``run_cli``), so a ``main`` that returns a report never becomes an exit status, and is a
    ``draftsmith`` command too."""
    from models.support import BENCHES, COMMANDS

    scripts = pyproject()["project"]["scripts"]
    assert scripts.pop("draftsmith") == "models.support:main"
    assert len(scripts) == 8 and all(s.startswith("draftsmith-") for s in scripts)
    for script, target in scripts.items():
        module_name, fn = target.split(":")
        assert fn == "cli", script
        module = importlib.import_module(module_name)
        assert callable(module.cli) and callable(module.main), script
    commands = {module for module, _ in [*COMMANDS.values(), *BENCHES.values()] if module}
    assert {target.split(":")[0] for target in scripts.values()} <= commands
    for module in commands:
        assert callable(importlib.import_module(module).main), module


# ----------------------------------------------------------------------------- the draftsmith command
def draftsmith(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """The ``draftsmith`` command as a user runs it, and its environment: this interpreter's console script when
    it was installed from this checkout (a venv with ``pip install -e .`` or ``pip install .``), else the script
    pip writes for ``models.support:main``, with the checkout on PYTHONPATH in place of site-packages. Either
    way the script's own folder, not the current one, starts ``sys.path``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        direct = importlib.metadata.distribution("draftsmith").read_text("direct_url.json") or "{}"
    except importlib.metadata.PackageNotFoundError:
        direct = "{}"
    installed = Path(sys.executable).parent / "draftsmith"
    if installed.is_file() and json.loads(direct).get("url") == ROOT.as_uri():
        return [str(installed)], env
    script = tmp_path / "bin" / "draftsmith"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom models.support import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    script.chmod(0o755)
    return [str(script)], {**env, "PYTHONPATH": str(ROOT)}


def test_draftsmith_train_runs_from_a_folder_that_holds_train_py_and_models_py(tmp_path):
    """``python -m train.distill`` from such a folder ran its ``train.py``; the command is not shadowed by it, nor
    is the export stage's ``python -m export.hf``. Two steps of the tiny recipe on a seeded tiny target and 24
    unregenerated chats, exported: seconds."""
    from models.tiny import save_tiny_target

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("raise SystemExit('the local train.py ran')\n")
    (project / "models.py").write_text("raise SystemExit('the local models.py ran')\n")
    target = save_tiny_target(tmp_path / "target", "qwen3", seed=0, num_layers=6)
    command, env = draftsmith(tmp_path)
    out = subprocess.run([*command, "train", "recipe=tiny", "out_dir=run", f"target.path={target}",
                          "data.regenerate=none", "data.tiny_conversations=24", "data.eval_rows=4", "train.max_steps=2",
                          "train.batch_size=2", "train.anchors=4", "eval.at_start=false", "eval.true_tau_prompts=0",
                          "eval.batches=1", "logging.every=1", "logging.progress=false", "export.hf=true",
                          "export.hf_dtype=fp32"],
                         cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (project / "run" / "final" / "drafter" / "config.json").is_file()
    assert (project / "run" / "export" / "hf" / "config.json").is_file()
    lines = out.stdout.splitlines()
    assert lines[0] == f"train: recipe tiny into run (every setting: {Path('run') / 'config.yaml'})"
    assert [x.split("  epoch")[0] for x in lines if x.startswith("step ")] == ["step  1/2", "step  2/2"]
    final = Path("run") / "final" / "drafter"
    assert f"  drafter        {final}" in lines and "next:" in lines
    assert f"  draftsmith push --folder {Path('run') / 'export' / 'hf'} --repo YOUR_NAME/REPO --dry-run" in lines


def test_a_package_shadowed_through_pythonpath_stops_the_command_with_one_line(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "train.py").write_text("raise SystemExit('the shadow ran')\n")
    command, env = draftsmith(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadow), env.get("PYTHONPATH")]))
    out = subprocess.run([*command, "train", "recipe=tiny", "--dry-run"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    shadow = shadow.resolve()
    assert out.returncode == 1 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"error: {shadow / 'train.py'} shadows draftsmith's train package (")
    assert out.stderr.endswith(f"): rename train.py or drop {shadow} from PYTHONPATH\n")
    # python -m puts the current folder first: a data/ package there shadows ours
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "__init__.py").write_text("")
    out = subprocess.run([sys.executable, "-m", "models.support", "prepare", "--help"], cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    said = f"error: {tmp_path.resolve() / 'data'} shadows draftsmith's data package ({ROOT / 'data'}): rename data"
    assert out.returncode == 1 and out.stderr == said + " or run from another folder\n"


def test_draftsmith_help_lists_the_commands_and_each_has_its_own_help(tmp_path, monkeypatch, capsys):
    """``draftsmith --help``: one line per command, without importing any of them (nor torch: start-up time);
    ``draftsmith <command> --help``: that command's own help, exit 0."""
    from models.support import BENCHES, COMMANDS, main

    command, env = draftsmith(tmp_path)
    out = subprocess.run([*command, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: draftsmith <command> [arguments]")
    for name in COMMANDS:
        assert any(line.startswith(f"  {name} ") for line in out.stdout.splitlines()), name
    assert "accelerate launch --no_python --num_processes 8 draftsmith train recipe=NAME" in out.stdout
    probe = ("import sys; from models.support import main; main(['--help']); "
             "print(sorted(m for m in ('torch', 'train', 'data', 'export', 'inference') if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", probe], env={**env, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=60)
    assert imported.stdout.splitlines()[-1] == "[]"
    monkeypatch.setattr(sys, "argv", ["draftsmith"])
    for argv in [[name] for name in COMMANDS if name != "bench"] + [["bench"]] + [["bench", b] for b in BENCHES]:
        capsys.readouterr()
        try:
            main([*argv, "--help"])
        except SystemExit as e:  # argparse's --help exits 0
            assert e.code in (None, 0), argv
        assert capsys.readouterr().out.strip(), argv
    main(["--version"])
    assert capsys.readouterr().out.startswith("draftsmith ")
    with pytest.raises(SystemExit) as e:
        main(["trian"])
    assert e.value.code == 2 and "unknown command 'trian' (did you mean 'train'?)" in capsys.readouterr().err


def test_python_m_train_distill_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "train.distill", "recipe=tinyy"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "unknown recipe 'tinyy'" in out.stderr and "did you mean 'tiny'?" in out.stderr
