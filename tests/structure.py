"""Structural measures of `harness/`, read from the source with `ast` (nothing is imported or run).

    python -m tests.structure          # the counts, with the places behind each

- import cycles: strongly connected groups of harness modules, counting imports inside functions
  (an edge goes to the module named, not to the packages above it, as Python resolves it);
- branches on recipe identity outside the registry: comparisons with a recipe name (a literal, a
  collection of them, or a constant holding them), and tables keyed by recipe names;
- modules below the entry points whose functions take the root `Config`;
- files a new recipe touches: the harness files naming a recipe in code, plus its YAML.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "harness"
RECIPE_NAMES = {"bf16", "delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "int4_qat", "custom"}
# the constants that hold recipe names today, and the registry that is allowed to hold them
NAME_CONSTANTS = {"RECIPES", "FP8_RECIPES", "RECIPE_PEAK", "TE_FUSED_CASTS", "INT4_QAT", "BF16"}
REGISTRY = {"harness/recipes.py"}
# entry points (and the config package, whose job is the root config) may take the root Config
ENTRY_POINTS = {"harness/train.py", "harness/interop/megatron.py", "harness/sweeps/launch.py"}
CONFIG_PKG = "harness/config/"


def modules() -> dict[str, Path]:
    """Dotted module name -> path, for every module under harness/."""
    out = {}
    for p in sorted(HARNESS.rglob("*.py")):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _targets(node: ast.AST, here: str, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = here.split(".")
            is_pkg = mods[here].name == "__init__.py"
            pkg = pkg[: len(pkg) - node.level + (1 if is_pkg else 0)]
            base = ".".join([*pkg, base] if base else pkg)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    else:
        return []
    return [n for n in names if n in mods]


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            graph[name].update(t for t in _targets(node, name, mods) if t != name)
    return graph


def cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = graph if graph is not None else import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_recipe_name(node: ast.AST) -> bool:
    """A quantized recipe's name, a collection holding one, or a constant of recipe names."""
    if isinstance(node, ast.Constant):
        return node.value in RECIPE_NAMES - {"bf16"}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_recipe_name(e) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id in NAME_CONSTANTS
    if isinstance(node, ast.Attribute):
        return node.attr in NAME_CONSTANTS
    return False


def _compares_recipe(node: ast.Compare) -> bool:
    """`bf16` is also a dtype: its comparisons count only where the other side names a recipe."""
    sides = [node.left, *node.comparators]
    if any(map(_is_recipe_name, sides)):
        return True
    bf16 = [s for s in sides if isinstance(s, ast.Constant) and s.value == "bf16"]
    return bool(bf16) and any("recipe" in ast.unparse(s).lower() for s in sides if s not in bf16)


def _keyed_by_recipes(node: ast.Dict) -> bool:
    """A table keyed by recipe names: two or more keys that are recipe names (one alone, such as a
    checkpoint's "delayed" state, names a thing, not a table of recipes)."""
    keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
    return sum(k in RECIPE_NAMES for k in keys) >= 2


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def recipe_branches() -> list[str]:
    """`file:line` of every comparison with a recipe name and every table keyed by recipe names."""
    hits = []
    for path in modules().values():
        rel = _rel(path)
        if rel in REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _compares_recipe(node):
                hits.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Dict) and _keyed_by_recipes(node):
                hits.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Match):
                hits.append(f"{rel}:{node.lineno}")
    return hits


def _annotation_names(fn: ast.AST) -> set[str]:
    args = fn.args
    names = set()
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        ann = a.annotation
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            names.add(ann.value)
        elif isinstance(ann, ast.Name):
            names.add(ann.id)
        elif isinstance(ann, ast.Attribute):
            names.add(ann.attr)
    return names


def root_config_takers() -> list[str]:
    """Modules below the entry points with a function or method taking the root `Config`."""
    out = []
    for path in modules().values():
        rel = _rel(path)
        if rel in ENTRY_POINTS or rel.startswith(CONFIG_PKG):
            continue
        tree = ast.parse(path.read_text())
        fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if any("Config" in _annotation_names(f) for f in fns):
            out.append(rel)
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                ids.add(id(body[0].value))
    return ids


def files_naming_recipes() -> list[str]:
    """Harness files that name a quantized recipe in code (bf16 is also a dtype, so left out)."""
    names = RECIPE_NAMES - {"bf16"}
    out = []
    for path in modules().values():
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in docs and node.value in names:
                out.append(_rel(path))
                break
    return out


def report() -> dict[str, list]:
    return {
        "import cycles in harness/": cycles(),
        "branches on recipe identity outside the registry": recipe_branches(),
        "modules below the entry points taking the root Config": root_config_takers(),
        "harness files naming a recipe in code (a new recipe: these + its YAML)": files_naming_recipes(),
    }


if __name__ == "__main__":
    for what, items in report().items():
        print(f"{len(items):3d}  {what}")
        for item in items:
            print(f"       {item}")
    sys.exit(0)
