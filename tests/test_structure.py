"""The house's structure, measured from the source (tests/structure.py): no import cycle inside
harness/ (imports inside functions count), numerics free of Hydra, and recipe knowledge in the
registry only (what it still finds in modules owned elsewhere is listed in ALLOWED_ELSEWHERE)."""

from __future__ import annotations

import ast

from tests.structure import HARNESS, REPO, cycles, import_graph, recipe_branches, root_config_takers

# every module asks the registry; an exception would be listed here with its reason
ALLOWED_ELSEWHERE: tuple[str, ...] = ()


def test_no_import_cycle_inside_harness():
    assert cycles() == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_are_edges():
    graph = import_graph()
    # harness.config.load imports the validator inside a function; the graph must see it
    assert "harness.validation.rules" in graph["harness.config"]


def test_numerics_imports_no_hydra_or_config_store():
    banned = ("hydra", "omegaconf", "harness.config.store", "harness.validation.rules")
    for path in sorted((HARNESS / "numerics").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad = [n for n in names if n.startswith(banned)]
            assert not bad, f"{path.relative_to(REPO)}:{node.lineno} imports {bad}"


def test_no_branch_on_recipe_identity_outside_the_registry():
    hits = [h for h in recipe_branches() if not h.startswith(ALLOWED_ELSEWHERE)]
    assert hits == []


def test_no_module_below_the_entry_points_takes_the_root_config():
    assert root_config_takers() == []
