"""A plain (non-editable) `pip install .` works outside the checkout: what it needs, checked cheaply.

The install itself is shown in the README (Install); here we pin its ingredients: recipes resolve
through the ``recipes`` package (importlib.resources, not a path relative to the source tree), the
package data globs in pyproject.toml cover every shipped recipe, the console scripts point at real
``main`` functions, and ``python -m train.distill`` runs from another directory.
"""

from __future__ import annotations

import importlib
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
    """Each script is its module's ``cli`` (``main`` through ``run_cli``), so a ``main`` that returns a
    report never becomes an exit status."""
    scripts = pyproject()["project"]["scripts"]
    assert len(scripts) == 8 and all(s.startswith("draftsmith-") for s in scripts)
    for script, target in scripts.items():
        module_name, fn = target.split(":")
        assert fn == "cli", script
        module = importlib.import_module(module_name)
        assert callable(module.cli) and callable(module.main), script


def test_python_m_train_distill_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "train.distill", "recipe=tinyy"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "unknown recipe 'tinyy'" in out.stderr and "did you mean 'tiny'?" in out.stderr
