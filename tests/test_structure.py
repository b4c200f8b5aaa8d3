"""The house's structure, measured from the source (tests/structure.py): every harness module on a
floor and no import from a lower floor to a higher one, no import cycle inside harness/ (imports
inside functions count), numerics free of Hydra, recipe knowledge in the registry only (what it
still finds in modules owned elsewhere is listed in ALLOWED_ELSEWHERE), no recipe name built by
suffix, backends asked for capabilities instead of compared by name, and the root config typed
and held by the composition root only."""

from __future__ import annotations

import ast

from tests.structure import (
    HARNESS,
    REPO,
    backend_name_comparisons,
    cycles,
    import_graph,
    recipe_branches,
    recipe_suffix_logic,
    root_config_takers,
    sizes,
    unplaced,
    untyped_root_config,
    upward_imports,
)

# every module asks the registry; an exception would be listed here with its reason
ALLOWED_ELSEWHERE: tuple[str, ...] = ()


def test_no_import_cycle_inside_harness():
    assert cycles() == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_are_edges():
    graph = import_graph()
    # the Megatron export asks the process group for the world size inside a function
    assert "harness.parallel.process" in graph["harness.interop.megatron"]


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


def test_every_module_is_on_a_floor_and_imports_only_downwards():
    assert unplaced() == []
    assert upward_imports() == []


def test_the_floor_check_finds_an_upward_import():
    graph = {"harness.config.schema": {"harness.validation.rules"}, "harness.validation.rules": set()}
    assert upward_imports(graph) == ["harness.config.schema (0) -> harness.validation.rules (9)"]


def test_no_recipe_name_is_built_or_taken_apart_by_suffix():
    assert recipe_suffix_logic() == []


def test_backends_are_asked_for_capabilities_not_compared_by_name():
    assert backend_name_comparisons() == []


def test_the_root_config_is_never_hidden_behind_an_untyped_parameter():
    assert untyped_root_config() == []


def test_recipes_are_the_eight_families_and_no_file_is_a_god_file():
    measured = sizes()
    assert measured["recipes in the registry"] == measured["recipe presets in conf/recipe"] == 8
    assert measured["loose top-level harness modules"] <= 6  # recipes.py and the python -m entry modules
