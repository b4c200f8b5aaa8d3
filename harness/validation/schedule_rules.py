"""A precision schedule's rules (docs/schedules.md): phases that start where a run has steps, in
order, each naming a recipe and fields that exist, and each phase's recipe checked by the same rules
as the run's own recipe, on the one backend the whole run uses."""

from __future__ import annotations

import dataclasses

from harness import recipes
from harness.config.schema import Config, ScheduleConfig
from harness.model import schedule as S
from harness.validation.legality import legality_errors, name_errors, uses_te


def _where(i: int) -> str:
    return f"schedule.phases.{i} (phase {i + 1})"


def _phase_shape_errors(cfg: Config) -> list[str]:
    """Each phase: one start, inside the run, after the one before; a known recipe and known fields."""
    errs, before = [], 0
    for i, phase in enumerate(cfg.schedule.phases):
        where, name = _where(i), phase.recipe or cfg.recipe.name
        if (phase.at_step is None) == (phase.at_fraction is None):
            errs.append(f"{where}: set exactly one of at_step and at_fraction (where the phase starts)")
            continue
        if phase.at_fraction is not None and not 0 < phase.at_fraction < 1:
            errs.append(f"{where} at_fraction={phase.at_fraction}: must be in (0, 1) (a fraction of steps)")
            continue
        k = S.start_of(phase, cfg.steps)
        if not 0 < k < cfg.steps:
            errs.append(
                f"{where} starts at step {k}: must be in 1..{cfg.steps - 1} (steps={cfg.steps}); "
                "move it inside the run or drop the phase"
            )
        elif k <= before:
            errs.append(
                f"{where} starts at step {k}, not after the phase before it (step {before}): "
                "list the phases in step order, one per start"
            )
        before = max(before, k)
        if name in recipes.LEGACY:
            errs.append(recipes.legacy_message(name, where=f"{where} recipe"))
        elif name not in recipes.names():
            errs.append(f"{where} recipe={name}: unknown; use one of {list(recipes.names())}")
        elif bad := sorted(set(phase.fields) - S.PHASE_FIELDS):
            errs.append(
                f"{where} fields.{bad[0]}: no such recipe field; use fields of conf/recipe/{name}.yaml"
            )
    return errs


def phase_config(cfg: Config, index: int) -> Config:
    """The run's config as phase `index` (0 = the recipe group) runs it: its recipe, no schedule."""
    recipe = S.phase_recipes(cfg.recipe, cfg.schedule)[index]
    return dataclasses.replace(cfg, recipe=recipe, schedule=ScheduleConfig())


def schedule_errors(cfg: Config) -> list[str]:
    """One line per problem of the schedule; each phase's recipe under the run's own recipe rules."""
    if not cfg.schedule.phases:
        return []
    errs = _phase_shape_errors(cfg)
    if errs:
        return errs
    if cfg.parallel.strategy == "fsdp2":
        return [
            "schedule with parallel.strategy=fsdp2: not supported yet (a switch rebuilds the model from "
            "whole tensors); use parallel=ddp or parallel=none, or schedule=none"
        ]
    te = uses_te(cfg)
    recipes_ = S.phase_recipes(cfg.recipe, cfg.schedule)
    for i in range(1, len(recipes_)):
        where, phase = _where(i - 1), phase_config(cfg, i)
        found = name_errors(phase) or legality_errors(phase)
        errs += [f"{where}: {e}" for e in found]
        if not found and uses_te(phase) != te:
            here, first = ("emulated", "te") if te else ("te", "emulated")
            errs.append(
                f"{where}: recipe={phase.recipe.name} would run on backend={here} and phase 0 (the "
                f"recipe group) on {first}; a schedule runs one backend: set backend=emulated (or "
                "backend=te where every phase runs natively)"
            )
        before, after = recipes_[i - 1], recipes_[i]
        if S.carries_scale_state(before, after) and before.fp8_amax_history_len != after.fp8_amax_history_len:
            errs.append(
                f"{where}: delayed scaling carries its amax history across the switch, so recipe."
                f"fp8_amax_history_len must stay {before.fp8_amax_history_len}, "
                f"not {after.fp8_amax_history_len}"
            )
    return errs
