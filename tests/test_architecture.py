"""The shape of the package: a one-way, acyclic import graph (function-level imports included), small modules,
written contracts instead of ``Any`` encoders, and short functions in the reports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hil"
# Layers from the bottom up (docs/design.md): a module may import its own layer or a lower one, never a higher one.
LAYERS = [("paths", "provenance", "compat", "errors"), ("data",), ("isotropy",), ("modeling",), ("retrieval",),
          ("evaluation",), ("analysis", "experiments"), ("cli", "api", "console", "__main__")]
MAX_MODULE_LINES = 500
MAX_REPORT_FUNCTION_LINES = 60
REPORT_MODULES = ("experiments/paper.py", "experiments/report.py", "experiments/records.py", "analysis/report.py",
                  "analysis/render.py", "analysis/sections.py")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_modules(name: str, path: Path) -> set[str]:
    """Every module of the package that ``name`` imports, at any depth of its code (functions included)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            base = node.module if not node.level else ".".join(package[: len(package) - node.level + 1]
                                                               + [node.module])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # a name imported from a module -> that module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    # Importing ``a.b.c`` first runs the packages ``a`` and ``a.b`` (their __init__): edges too, except to the
    # importer's own packages (already running when it is imported).
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    for target in list(found):
        parts = target.split(".")
        for i in range(1, len(parts)):
            package_name = ".".join(parts[:i])
            if package_name in MODULES and package_name not in own and package_name != name:
                found.add(package_name)
    return found


GRAPH = {name: imported_modules(name, path) for name, path in MODULES.items()}


def layer(name: str) -> int | None:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else None
    return next((i for i, group in enumerate(LAYERS) if top in group), None)


def test_imports_never_point_up_the_layers():
    upward = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                    if layer(a) is not None and layer(b) is not None and layer(b) > layer(a))
    assert not upward, upward
    assert all(layer(name) is not None for name in MODULES if name != "hil"), "a module outside every layer"


def test_import_graph_has_no_cycle():
    """Depth-first search for a back edge; the path of the first cycle found is the message."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(GRAPH[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(GRAPH):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, " -> ".join(cycle)


def test_the_checks_see_a_cycle_and_an_upward_import(monkeypatch):
    """The two checks above fail on a graph that has what they look for."""
    monkeypatch.setitem(GRAPH, "hil.data.beir", GRAPH["hil.data.beir"] | {"hil.modeling.encoder"})
    with pytest.raises(AssertionError, match="hil.data.beir -> hil.modeling.encoder"):
        test_imports_never_point_up_the_layers()
    monkeypatch.setitem(GRAPH, "hil.modeling.contracts", GRAPH["hil.modeling.contracts"] | {"hil.modeling.module"})
    with pytest.raises(AssertionError, match="hil.modeling"):
        test_import_graph_has_no_cycle()


def test_modules_are_small():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_parameter_takes_an_untyped_encoder():
    """Encoders are passed as the written contract (``Encoder`` or a concrete class), never as ``Any``."""
    untyped = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if "encoder" in arg.arg and (arg.annotation is None or ast.unparse(arg.annotation) == "Any"):
                        untyped.append(f"{name}.{node.name}({arg.arg})")
    assert not untyped, untyped


def test_report_functions_are_short():
    long = []
    for relative in REPORT_MODULES:
        tree = ast.parse((PACKAGE / relative).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_REPORT_FUNCTION_LINES:
                    long.append(f"{relative}:{node.name} ({length} lines)")
    assert not long, long
