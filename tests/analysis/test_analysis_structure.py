"""The shape of `analysis/`, read from the source with `ast`: no import cycle, and `python -m` entry
modules that the package does not import while it loads (else runpy warns that they were imported twice)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.structure import cycles

ANALYSIS = Path(__file__).resolve().parents[2] / "analysis"
ENTRY_MODULES = ("analysis.report", "analysis.seed_band", "analysis.collect")
"""Modules run as `python -m ...` (DEVELOPERS.md, the docstrings)."""


def modules() -> dict[str, Path]:
    """Dotted name -> path of every module of the package (`analysis` is its __init__)."""
    out = {}
    for p in sorted(ANALYSIS.rglob("*.py")):
        parts = list(p.relative_to(ANALYSIS.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imported(node: ast.AST, here: str, is_pkg: bool, mods: dict[str, Path]) -> list[str]:
    """The package's modules an import statement names: `import a.b`, `from a import b` (b a module,
    else a itself) and relative forms, resolved as Python resolves them."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        pkg = here.split(".")
        pkg = pkg[: len(pkg) - node.level + (1 if is_pkg else 0)]
        base = ".".join([*pkg, base] if base else pkg)
    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return [n for n in names if n in mods]


def import_graph(*, module_level_only: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports; imports inside functions count unless
    `module_level_only` (what runs when the module is imported)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree, is_pkg = ast.parse(path.read_text()), path.name == "__init__.py"
        for node in _at_import(tree) if module_level_only else ast.walk(tree):
            graph[name].update(t for t in _imported(node, name, is_pkg, mods) if t != name)
    return graph


def _at_import(node: ast.AST):
    """The nodes that run when a module is imported: everything outside function bodies."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from _at_import(child)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "analysis.keys" in graph["analysis.run"]  # from analysis import keys as K
    assert "analysis.run" in graph["analysis.curves"]  # from analysis.run import Run
    assert "analysis.telemetry" in graph["analysis.frames"]  # an import inside a function
    assert "analysis.frames" in graph["analysis"]  # the package's own __init__


def test_analysis_has_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_loading_the_package_imports_no_entry_module() -> None:
    graph = import_graph(module_level_only=True)
    assert not _reachable(graph, "analysis") & set(ENTRY_MODULES)
