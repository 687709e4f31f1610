"""The import directions of docs/design.md ("Import directions"), checked on the source, lazy imports included.

The product folders import downwards only; lab/ may import every product folder and is imported by none.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PRODUCT = {"models", "data", "train", "export", "inference", "recipes"}  # installed (pyproject's package list)
OURS = PRODUCT | {"lab"}
MAY_IMPORT = {  # folder: the folders of ours it may import (besides itself)
    "models": set(),
    "data": {"models"},
    "train": {"models", "data"},
    "export": {"models"},
    "inference": {"models", "data"},
    "recipes": set(),
    "lab": PRODUCT,  # the lab (not installed) may import everything; nothing of the product imports it
}
# The documented exception: measuring true acceptance means running *the* loop, not a copy of it.
EXCEPTIONS = {
    ("train/eval.py", "inference.torch_loop"),
}


def imported_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def test_no_folder_imports_sideways():
    wrong = []
    for folder, allowed in MAY_IMPORT.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for module in imported_modules(path):
                top = module.split(".")[0]
                if top in OURS and top != folder and top not in allowed and (rel, module) not in EXCEPTIONS:
                    wrong.append(f"{rel} imports {module}")
    assert not wrong, "imports against docs/design.md's import directions: " + "; ".join(wrong)


def test_the_lab_is_imported_by_no_product_folder_and_not_shipped():
    """lab/ holds experiments run from a checkout: no product folder may import it (the check above), and the
    wheel's package list (pyproject's ``[tool.setuptools.packages.find] include``) names the product alone."""
    assert not any("lab" in MAY_IMPORT[folder] for folder in PRODUCT)
    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include\s*=\s*\[([^\]]*)\]", pyproject).group(1)
    assert {name.strip().strip('"').rstrip("*") for name in include.split(",") if name.strip()} == PRODUCT
