"""The `NVTE_*` contract: TE reads these at import; lowp sets them from the recipe's fields.

Which variables a recipe owns, and the value each field asks for, is registry data
(`RecipeSpec.nvte_vars`); here is the process-wide part: setting them before TE is imported
without ever overriding a user's value, and the conflict check validation runs first.
"""

from __future__ import annotations

import os

from harness import recipes
from harness.config.schema import RecipeConfig

# NVTE_* values lowp itself set in this process (a later run in the same process may change them)
LOWP_SET_NVTE: dict[str, str] = {}


def wanted(recipe: RecipeConfig) -> dict[str, str]:
    """The `NVTE_*` values the recipe's fields ask for (the registry's `nvte_vars`)."""
    return recipes.get(recipe.name).nvte_env(recipe)


# NVTE_* switches TE honours only with machinery lowp never sets up, each with why
NEEDS_USERBUFFERS = {
    "NVTE_GEMM_GELU_FUSION": (
        "TE 2.20 fuses GELU into the FP8 fc1 GEMM only with its userbuffers comm-GEMM overlap (tensor "
        "parallelism), which lowp does not set up, and its LayerNormMLP fails to build without it"
    ),
}


def userbuffers_errors(activation: str) -> list[str]:
    """One line per NEEDS_USERBUFFERS switch the user turned on (TE reads it for GELU MLPs only)."""
    return [
        f"environment {var}={os.environ[var]}: {why}; unset it"
        for var, why in NEEDS_USERBUFFERS.items()
        if activation == "gelu" and os.environ.get(var, "0") not in ("", "0")
    ]


def conflicts(recipe: RecipeConfig) -> list[str]:
    """One line per variable the user set to a value the config contradicts (a text field left null
    asks for the variable unset: TE would read any value, and refuses most)."""
    errs = []
    for v in recipes.get(recipe.name).nvte_vars:
        have, want = os.environ.get(v.var), v.value(recipe)
        if have is None or LOWP_SET_NVTE.get(v.var) == have or v.same(have, want):
            continue
        if want is None:
            errs.append(
                f"environment {v.var}={have} contradicts the config (recipe.{v.field}=null leaves it "
                f"unset): unset it, or set recipe.{v.field} instead where recipe={recipe.name} has it"
            )
        else:
            errs.append(
                f"environment {v.var}={have} contradicts the config (which sets {v.var}={want}): unset it "
                "and choose the behaviour through the recipe fields"
            )
    return errs


def set_nvte_env(recipe: RecipeConfig) -> dict[str, str]:
    """Set the NVTE_* defaults TE reads at import from config (fields are also set explicitly); a
    variable lowp itself set for an earlier run in this process and this recipe leaves null is removed."""
    env = wanted(recipe)
    for var, value in env.items():
        if var not in os.environ or LOWP_SET_NVTE.get(var) == os.environ[var]:
            os.environ[var] = value  # never overrides a user's value (validation refused a conflict)
            LOWP_SET_NVTE[var] = value
    for var in recipes.get(recipe.name).nvte_unset(recipe):
        if var in os.environ and LOWP_SET_NVTE.get(var) == os.environ[var]:
            del os.environ[var], LOWP_SET_NVTE[var]
    return env
