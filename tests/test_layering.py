"""The import directions of docs/design.md ("Import directions"), checked on the source, lazy imports included."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
OURS = {"models", "data", "train", "export", "inference", "recipes"}
MAY_IMPORT = {  # folder: the folders of ours it may import (besides itself)
    "models": set(),
    "data": {"models"},
    "train": {"models", "data"},
    "export": {"models"},
    "inference": {"models", "data"},
    "recipes": set(),
}
# The documented exceptions: measuring true acceptance means running *the* loop, not a copy of it.
EXCEPTIONS = {
    ("train/eval.py", "inference.torch_loop"),
    ("train/ablate.py", "inference.torch_loop"),
    ("train/quant_experiment.py", "inference.mlx_loop"),
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
