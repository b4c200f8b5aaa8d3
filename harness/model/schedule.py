"""Precision schedules: which recipe each step of a run follows (docs/schedules.md).

Phase 0 is the run's `recipe` group, from step 0; each `schedule.phases` entry starts at its own
step (`at_step`, or `at_fraction` of the run's steps, rounded to the nearest step) and runs until
the next one starts. A phase's recipe is its preset (or the run's recipe when it names none or the
run's) with its `fields` on top, as a stability override's is (`plan.override_recipe`).

Pure functions of the config slices (no training loop here): the trainer asks `phase_at` at each
step, validation checks `starts`, the Megatron export prints one command per phase.
"""

from __future__ import annotations

import dataclasses

from harness import recipes
from harness.config.schema import RecipeConfig, ScheduleConfig, SchedulePhase

PHASE_FIELDS = frozenset(f.name for f in dataclasses.fields(RecipeConfig)) - {"name"}
"""The recipe fields a phase may set in `fields`."""


def start_of(phase: SchedulePhase, steps: int) -> int | None:
    """The phase's first step (steps done when it starts); None when it names neither or both."""
    if (phase.at_step is None) == (phase.at_fraction is None):
        return None
    return phase.at_step if phase.at_step is not None else round(phase.at_fraction * steps)


def starts(schedule: ScheduleConfig, steps: int) -> list[int]:
    """Each phase's first step, phase 0 (the recipe group) first: [0, k1, k2, ...]."""
    return [0, *(start_of(p, steps) for p in schedule.phases)]


def phase_recipe(run_recipe: RecipeConfig, phase: SchedulePhase) -> RecipeConfig:
    """The full recipe a phase runs: as resolved when the config was loaded, else its preset (the
    run's recipe where it names none or the run's) with its fields on top."""
    if phase.resolved is not None:
        return phase.resolved
    name = phase.recipe or run_recipe.name
    base = run_recipe if name == run_recipe.name else recipes.default_fields(name)
    return dataclasses.replace(base, **phase.fields)


def resolve(run_recipe: RecipeConfig, schedule: ScheduleConfig) -> None:
    """Fill each phase's `resolved` (run.json then records what each phase ran); phases naming an
    unknown recipe or field are left for validation to name."""
    for phase in schedule.phases:
        name = phase.recipe or run_recipe.name
        if phase.resolved is None and name in recipes.names() and not set(phase.fields) - PHASE_FIELDS:
            phase.resolved = phase_recipe(run_recipe, phase)


def phase_recipes(run_recipe: RecipeConfig, schedule: ScheduleConfig) -> list[RecipeConfig]:
    """The recipe of every phase, phase 0 (the run's recipe) first."""
    return [run_recipe, *(phase_recipe(run_recipe, p) for p in schedule.phases)]


def phase_at(schedule: ScheduleConfig, steps: int, step: int) -> int:
    """The index of the phase that step `step` (0-based) runs in."""
    return sum(1 for k in starts(schedule, steps)[1:] if k is not None and k <= step)


def carries_scale_state(before: RecipeConfig, after: RecipeConfig) -> bool:
    """Whether a switch from `before` to `after` keeps the scale state: only between two delayed-
    scaling recipes (TE keeps a DelayedScalingRecipeState across a change of its fields,
    module/base.py:1115); any other new recipe starts as TE starts one it has not run."""
    return recipes.get(before.name).delayed_scaling and recipes.get(after.name).delayed_scaling


def describe(run_recipe: RecipeConfig, schedule: ScheduleConfig, steps: int) -> list[dict]:
    """run.json's schedule: each phase's first step, label and full recipe fields."""
    return [
        {"phase": i, "start_step": k, "recipe_label": recipes.label(r), "recipe": dataclasses.asdict(r)}
        for i, (k, r) in enumerate(zip(starts(schedule, steps), phase_recipes(run_recipe, schedule)))
    ]
