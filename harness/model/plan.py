"""Which recipe each module runs: the recipe, minus first/last BF16 blocks, plus per-module overrides.

Pure and shared by both backends, so the emulated and TE models quantize the same modules.
The LM head, embeddings, norms and attention are never quantized (docs/numerics.md section 1).

A precision plan file (`python -m harness.plan`, loaded by `stability=plan stability.plan_file=PATH`)
is a list of per-module overrides with the goal and inputs that made it; `plan_overrides` reads it
into `ModuleOverride`s that go before the config's own `stability.overrides` (which still win).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

from harness import recipes
from harness.config.errors import ConfigError
from harness.config.schema import ModelConfig, ModuleOverride, RecipeConfig, StabilityConfig

_LAYER = re.compile(r"^blocks\.(\d+)\.")


def layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _assigned(recipe: RecipeConfig) -> RecipeConfig | None:
    """None for the recipe without a quantizer scheme (the BF16 baseline), else the recipe."""
    return None if recipes.get(recipe.name).scheme is None else recipe


def bf16_layers(stability: StabilityConfig, num_layers: int) -> set[int]:
    """Block indices kept out of the quantized autocast (Megatron --first-last-layers-bf16)."""
    if not stability.first_last_layers_bf16:
        return set()
    start, end = stability.num_layers_at_start_in_bf16, stability.num_layers_at_end_in_bf16
    return {i for i in range(num_layers) if i < start or i >= num_layers - end}


def in_int4_scope(recipe: RecipeConfig, name: str) -> bool:
    """Whether `recipe.int4_scope` covers module `name` (only INT4 QAT reads the scope):
    routed_experts = the expert groups (blocks.N.mlp.experts.fc1/fc2), miles' INT4 QAT scope."""
    if recipe.int4_scope != "routed_experts" or recipes.get(recipe.name).hook != "int4_fake_quant":
        return True
    return ".mlp.experts." in name


OVERRIDE_FIELDS = frozenset(f.name for f in dataclasses.fields(RecipeConfig)) - {"name"}
"""The recipe fields a stability override may set (`ModuleOverride.fields`)."""


def override_recipe(run_recipe: RecipeConfig, ov: ModuleOverride) -> RecipeConfig:
    """The full recipe an override asks for: the run's own recipe where it names the run's, else the
    registry's preset (conf/recipe agrees), with the override's `fields` on top."""
    base = run_recipe if ov.recipe == run_recipe.name else recipes.default_fields(ov.recipe)
    return dataclasses.replace(base, **ov.fields)


@dataclass(frozen=True)
class PrecisionPlan:
    recipe: RecipeConfig
    stability: StabilityConfig
    model: ModelConfig

    def recipe_for(self, name: str) -> RecipeConfig | None:
        """The recipe of module `name`, or None where it runs unquantized (BF16)."""
        if name == "lm_head" or layer_index(name) is None:
            return None
        chosen = _assigned(self.recipe)
        if chosen is not None and not in_int4_scope(chosen, name):
            chosen = None
        if layer_index(name) in bf16_layers(self.stability, self.model.num_layers):
            chosen = None
        for ov in self.stability.overrides:
            if fnmatch.fnmatchcase(name, ov.pattern):
                chosen = _assigned(self._override_recipe(ov))
        return chosen

    def _override_recipe(self, ov: ModuleOverride) -> RecipeConfig:
        """The override's full recipe, as resolved when the config was loaded (or, for a bare plan,
        as `override_recipe` resolves it)."""
        return ov.resolved if ov.resolved is not None else override_recipe(self.recipe, ov)

    def quantized_modules(self, names: list[str]) -> dict[str, str]:
        """name -> recipe name (the BF16 baseline's where unquantized), for run.json."""
        return {n: (r.name if (r := self.recipe_for(n)) is not None else recipes.BASELINE) for n in names}


PLAN_PRESET = "plan"
"""The stability preset that reads `stability.plan_file` (conf/stability/plan.yaml). Under any other
preset the file is left unread, so a sweep can hand every arm the same `stability.plan_file` and
only its plan arm runs it (sweeps/plan_check.yaml)."""
PLAN_FORMAT = "lowp-precision-plan/1"


def read_plan(path: str) -> dict:
    """A plan file's contents; ConfigError naming the option and the fix where it is unreadable."""
    import yaml

    where = f"stability.plan_file={path}"
    try:
        plan = yaml.safe_load(Path(path).expanduser().read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{where}: cannot read it ({type(e).__name__}: {e}); give a file written by "
                          "`python -m harness.plan`") from None  # fmt: skip
    if (
        not isinstance(plan, dict)
        or plan.get("format") != PLAN_FORMAT
        or not isinstance(plan.get("overrides"), list)
    ):
        raise ConfigError(
            f"{where}: not a precision plan ({PLAN_FORMAT}); write one with `python -m harness.plan`"
        )
    return plan


def plan_overrides(stability: StabilityConfig) -> list[ModuleOverride]:
    """The plan file's per-module overrides (none without a file or outside the `plan` preset)."""
    if stability.name != PLAN_PRESET:
        return []
    if not stability.plan_file:
        raise ConfigError(
            "stability=plan needs stability.plan_file=PATH (a plan written by `python -m harness.plan`)"
        )
    out = []
    for i, ov in enumerate(read_plan(stability.plan_file)["overrides"]):
        if (
            not isinstance(ov, dict)
            or not {"pattern", "recipe"} <= set(ov)
            or set(ov) - {"pattern", "recipe", "fields"}
        ):
            raise ConfigError(
                f"stability.plan_file={stability.plan_file}: overrides[{i}] = {ov!r} is not "
                "{pattern, recipe, fields}; write the plan with `python -m harness.plan`"
            )
        out.append(
            ModuleOverride(
                pattern=str(ov["pattern"]), recipe=str(ov["recipe"]), fields=dict(ov.get("fields") or {})
            )
        )
    return out


def load_plan(stability: StabilityConfig) -> None:
    """Put the plan file's overrides before `stability.overrides`, once (a config loaded again, as on
    resume, already holds them)."""
    loaded = plan_overrides(stability)
    have = [(o.pattern, o.recipe, dict(o.fields)) for o in stability.overrides[: len(loaded)]]
    if loaded and have != [(o.pattern, o.recipe, o.fields) for o in loaded]:
        stability.overrides = [*loaded, *stability.overrides]
