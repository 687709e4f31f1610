"""The import directions of docs/design.md ("Import directions"), checked on the source, lazy imports included:
no folder imports sideways, no import circle inside a folder; lab/ may import every product folder and is imported
by none."""

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
# Circles inside a folder that are known and being untangled: none today. A circle found and not listed here
# fails the check, and so does one listed here that no longer exists.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()


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


# ----------------------------------------------------------------------------- circles inside a folder
def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder_imports(root: Path, folder: str) -> dict[str, set[str]]:
    """Module -> the modules of the same folder it imports, anywhere in the file (inside functions too).

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module of the folder, else ``pkg``;
    relative imports are resolved against the importing module's package.
    """
    paths = sorted((root / folder).rglob("*.py"))
    modules = {module_name(root, p): p for p in paths}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for module in wanted:
                while module and module not in modules:  # `import a.b.c` of a name inside a.b: the module a.b
                    module = module.rpartition(".")[0]
                if module and module != name:
                    graph[name].add(module)
    return graph


def circle_groups(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round about (sorted; none of one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def way_round(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """The shortest circle ``[a, b, ..., a]`` from the group's first module back to it."""
    start, members = group[0], set(group)
    paths, seen = [[start]], {start}
    while True:
        path = paths.pop(0)
        nxt = sorted(graph[path[-1]] & members)
        if start in nxt:
            return path + [start]
        for m in nxt:
            if m not in seen:
                seen.add(m)
                paths.append(path + [m])


def test_no_import_circle_inside_a_folder():
    graphs = {folder: folder_imports(ROOT, folder) for folder in MAY_IMPORT}
    found = {tuple(group): graph for graph in graphs.values() for group in circle_groups(graph)}
    unknown = [" -> ".join(way_round(graph, list(group))) + (f" (all of {', '.join(group)} import each other)"
                                                             if len(group) > 2 else "")
               for group, graph in found.items() if group not in KNOWN_CIRCLES]
    assert not unknown, ("import circles inside a folder, lazy imports counted (split the modules along their jobs, "
                         "or move what both need to a lower module): " + "; ".join(unknown))
    gone = KNOWN_CIRCLES - set(found)
    assert not gone, f"KNOWN_CIRCLES lists circles that no longer exist: {sorted(gone)}"


def test_the_circle_check_finds_a_planted_circle(tmp_path):
    """Two modules of a folder that import each other, one of them only inside a function, and a longer circle
    through a relative import and ``from pkg import module``; the modules outside them are not named."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import os\n\nfrom pkg.b import thing\n",
        "b.py": "thing = 1\n\n\ndef later():\n    import pkg.a\n    return pkg.a\n",
        "c.py": "from pkg import d\n",
        "d.py": "from .sub import e\n",
        "sub/__init__.py": "",
        "sub/e.py": "def f():\n    from pkg.c import x  # noqa\n",
        "lone.py": "from pkg import a, b\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = folder_imports(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.sub.e"} and graph["pkg.lone"] == {"pkg.a", "pkg.b"}
    assert circle_groups(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.sub.e"]]
    assert way_round(graph, ["pkg.c", "pkg.d", "pkg.sub.e"]) == ["pkg.c", "pkg.d", "pkg.sub.e", "pkg.c"]
    (pkg / "b.py").write_text("thing = 1\n")  # the lazy import gone: only the longer circle is left
    assert circle_groups(folder_imports(tmp_path, "pkg")) == [["pkg.c", "pkg.d", "pkg.sub.e"]]
