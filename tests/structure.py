"""Structural measures of `harness/`, read from the source with `ast` (nothing is imported or run).

    python -m tests.structure          # the counts, with the places behind each

- the floors: `FLOORS` orders harness/'s subpackages (and the few top-level modules) from the ground
  up; a module may import its own floor and the floors below, never one above (imports inside
  functions count);
- import cycles: strongly connected groups of harness modules, counting imports inside functions
  (an edge goes to the module named, not to the packages above it, as Python resolves it);
- branches on recipe identity outside the registry: comparisons with a recipe name (a literal, a
  collection of them, or a constant holding them), and tables keyed by recipe names;
- recipe names built or taken apart by suffix (`removesuffix('_fastacc')`, `f"{r.name}_fp8head"`);
- comparisons of a backend's name with a string outside the backend factory (capabilities are
  properties of the backend);
- modules below the composition root whose functions take the root `Config`, and parameters that
  hide the root config without a type (`cfg` unannotated);
- files a new recipe touches: the harness files naming a recipe in code, plus its YAML;
- sizes: recipes, config fields, harness lines, loose top-level modules, the largest file.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "harness"
RECIPE_NAMES = {"bf16", "delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "int4_qat", "custom"}
# the constants that hold recipe names today, and the registry that is allowed to hold them
NAME_CONSTANTS = {"RECIPES", "FP8_RECIPES", "RECIPE_PEAK", "TE_FUSED_CASTS", "INT4_QAT", "BF16"}
REGISTRY = {"harness/recipes.py"}
# harness/'s rooms from the ground floor up: a module imports its own floor and those below only
FLOORS: dict[str, int] = {
    "harness.config": 0,  # the schema, its Hydra store, errors, paths: everyone's ground
    "harness.recipes": 1,  # the registry: what each recipe family is
    "harness.numerics": 2,  # pure quantizers, bit for bit with TE
    "harness.model": 3,  # the GPT, its loss, the precision plan
    "harness.data": 3,  # token sources
    "harness.optim": 4,  # optimizers and their state numerics
    "harness.backends": 5,  # TE and emulated execution, hardware, capabilities
    "harness.parallel": 6,  # process group, DDP/FSDP2 strategies, rank agreement
    "harness.lifecycle": 7,  # run directory, checkpoints, resume, metrics, loggers
    "harness.interop": 8,  # Megatron-LM and Hugging Face in and out
    "harness.validation": 9,  # the rules and load(), above what they check
    "harness.multirun": 10,  # named sweeps through Hydra's multirun
    "harness.training": 10,  # the composition root: the loop and one run
    "harness.train": 11,  # entry modules (python -m ...)
    "harness.sweep": 11,
    "harness.megatron": 11,
    "harness.export": 11,
    "harness.plan": 11,
}
# the composition root and the config's own rooms may take the root Config
ENTRY_POINTS = {
    "harness/train.py",
    "harness/megatron.py",
    "harness/sweep.py",
    "harness/export.py",
    "harness/plan.py",
}
ROOT_CONFIG_ROOMS = ("harness/config/", "harness/validation/", "harness/training/", "harness/multirun/")
ROOT_CONFIG_ROOMS += ("harness/interop/megatron.py",)  # the Megatron command maps the whole config
ROOT_CONFIG_ROOMS += ("harness/interop/megatron_schedule.py",)  # a Megatron command per schedule phase
BACKEND_FACTORY = {"harness/backends/__init__.py", "harness/backends/capability.py"}


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
        if rel in ENTRY_POINTS or rel.startswith(ROOT_CONFIG_ROOMS):
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


def floor_of(module: str) -> int | None:
    """The floor of a harness module: its longest FLOORS prefix (None: not placed)."""
    best = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len, default=None)
    return FLOORS[best] if best is not None else None


def unplaced() -> list[str]:
    """harness modules no FLOORS entry covers (the package's own empty __init__ aside)."""
    return [m for m in modules() if m != "harness" and floor_of(m) is None]


def upward_imports(graph: dict[str, set[str]] | None = None) -> list[str]:
    """`a -> b` for every import from a lower floor to a higher one."""
    graph = graph if graph is not None else import_graph()
    out = []
    for a, targets in sorted(graph.items()):
        fa = floor_of(a)
        for b in sorted(targets):
            fb = floor_of(b)
            if fa is not None and fb is not None and fb > fa:
                out.append(f"{a} ({fa}) -> {b} ({fb})")
    return out


_NAME_OF_RECIPE = re.compile(r"(recipe|spec|base|\br)\.name\b|recipe_name|\brecipe\b")
_STR_SURGERY = {"removesuffix", "removeprefix", "replace", "endswith", "startswith"}


def recipe_suffix_logic() -> list[str]:
    """`file:line` where a recipe name is taken apart or built by suffix: a string method
    (removesuffix, replace, endswith, ...) on an expression naming a recipe, or an f-string that glues
    text straight onto one (`f"{base.name}_fastacc"`)."""
    hits = []
    for path in modules().values():
        rel = _rel(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in _STR_SURGERY and _NAME_OF_RECIPE.search(ast.unparse(node.func.value)):
                    hits.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.JoinedStr):
                parts = node.values
                for left, right in zip(parts, parts[1:]):
                    glued = isinstance(right, ast.Constant) and str(right.value)[:1] in ("_",)
                    named = isinstance(left, ast.FormattedValue) and re.search(
                        r"(recipe|spec|base|\br)\.name$", ast.unparse(left.value)
                    )
                    if glued and named:
                        hits.append(f"{rel}:{node.lineno}")
    return hits


_BACKEND_NAMES = {"te", "emulated", "auto"}


def backend_name_comparisons() -> list[str]:
    """`file:line` of comparisons of a backend's name with a string outside the backend factory."""
    hits = []
    for path in modules().values():
        rel = _rel(path)
        if rel in BACKEND_FACTORY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            literal = any(isinstance(x, ast.Constant) and x.value in _BACKEND_NAMES for x in sides)
            named = any("backend" in ast.unparse(x) for x in sides if not isinstance(x, ast.Constant))
            if literal and named:
                hits.append(f"{rel}:{node.lineno}")
    return hits


def untyped_root_config() -> list[str]:
    """`file:line function` of parameters named cfg/config without a type: the root config hidden."""
    hits = []
    for path in modules().values():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = fn.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                    if arg.arg in ("cfg", "config") and arg.annotation is None:
                        hits.append(f"{_rel(path)}:{fn.lineno} {fn.name}({arg.arg})")
    return hits


def sizes() -> dict[str, int | str]:
    """The house in numbers: recipes, config fields, harness lines, loose modules, the largest file."""
    lines = {_rel(p): len(p.read_text().splitlines()) for p in modules().values()}
    schema = ast.parse((HARNESS / "config" / "schema.py").read_text())
    fields = sum(
        1
        for cls in schema.body
        if isinstance(cls, ast.ClassDef)
        for item in cls.body
        if isinstance(item, ast.AnnAssign)
    )
    registry = ast.parse((HARNESS / "recipes.py").read_text())
    specs = sum(
        1
        for node in ast.walk(registry)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "RecipeSpec"
    )
    presets = len(list((REPO / "conf" / "recipe").glob("*.yaml")))
    largest = max(lines, key=lines.get)
    loose = [p.name for p in HARNESS.glob("*.py") if p.name != "__init__.py"]
    return {
        "recipes in the registry": specs,
        "recipe presets in conf/recipe": presets,
        "config fields in the schema": fields,
        "harness lines": sum(lines.values()),
        "loose top-level harness modules": len(loose),
        "largest harness file": f"{largest} ({lines[largest]} lines)",
    }


def report() -> dict[str, list]:
    return {
        "import cycles in harness/": cycles(),
        "imports from a lower floor to a higher one": upward_imports(),
        "harness modules on no floor": unplaced(),
        "branches on recipe identity outside the registry": recipe_branches(),
        "recipe names built or taken apart by suffix": recipe_suffix_logic(),
        "backend names compared with a string outside the backend factory": backend_name_comparisons(),
        "modules below the composition root taking the root Config": root_config_takers(),
        "untyped cfg/config parameters": untyped_root_config(),
        "harness files naming a recipe in code (a new recipe: these + its YAML)": files_naming_recipes(),
    }


if __name__ == "__main__":
    for what, value in sizes().items():
        print(f"{value!s:>5}  {what}" if isinstance(value, int) else f"       {what}: {value}")
    for what, items in report().items():
        print(f"{len(items):5d}  {what}")
        for item in items:
            print(f"         {item}")
    sys.exit(0)
