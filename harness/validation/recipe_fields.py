"""TE 2.20's recipe fields, refused as TE 2.20.2 refuses them (transformer_engine/common/recipe/__init__.py
`__post_init__` of each recipe class, pytorch/quantization.py NVFP4BlockScalingRecipeState):

- each field only on a family whose TE recipe class has it (recipes.FIELD_SCOPE): backward_override on
  every class but DelayedScaling, which asserts it is None (__init__.py:268); the NVFP4 ones on
  NVFP4BlockScaling; enable_2d_quantization on MXFP8BlockScaling;
- values: backward_override None/high_precision/dequantized, the 4over6 scopes none/weights/
  activations/all, the error mode MAE/MSE (legality.NAMES holds the lists);
- 4over6 on activations refuses RHT (quantization.py:1715, "NVFP4 4over6 quantization does not
  support RHT"); its stochastic-rounding refusal cannot fire, since NVFP4BlockScaling rounds only
  gradients stochastically and 4over6 never applies to gradients;
- stability.fp8_wgrad=false (wgrad on the unquantized input) with backward_override=dequantized (on
  the dequantized forward copy) ask for two different wgrad operands.
"""

from __future__ import annotations

from harness import recipes
from harness.config.schema import RecipeConfig, StabilityConfig

_DEFAULTS = RecipeConfig()


def _families_with(field: str) -> list[str]:
    scope = recipes.FIELD_SCOPE[field]
    return [n for n in recipes.names() if scope(recipes.get(n))]


def field_errors(r: RecipeConfig) -> list[str]:
    """One line per TE 2.20 field set on a family without it, and per combination TE refuses."""
    spec, errs = recipes.get(r.name), []
    for name, value in recipes.te20_set(r).items():
        if recipes.FIELD_SCOPE[name](spec):
            continue
        if name == "backward_override" and spec.delayed_scaling:
            errs.append(
                f"recipe.backward_override={value} with recipe=delayed: TE's DelayedScaling only supports "
                "backward_override=None (transformer_engine/common/recipe/__init__.py:268); use "
                "recipe=tensorwise (per-tensor FP8, current scaling) or drop recipe.backward_override"
            )
            continue
        default = getattr(_DEFAULTS, name)
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
        errs.append(
            f"recipe.{name}={value} with recipe={r.name}: TE 2.20 has {name} only on "
            f"{', '.join(_families_with(name))} ({spec.te_recipe_class or 'no TE recipe class'} has no such "
            f"field); use one of those recipes or recipe.{name}={shown}"
        )
    if (
        r.nvfp4_4over6 in ("activations", "all")
        and not r.disable_rht
        and recipes.FIELD_SCOPE["nvfp4_4over6"](spec)
    ):
        errs.append(
            f"recipe.nvfp4_4over6={r.nvfp4_4over6} with recipe.disable_rht=false: TE 2.20.2 refuses 4over6 "
            "on activations with the random Hadamard transform (pytorch/quantization.py:1715); set "
            "recipe.disable_rht=true or recipe.nvfp4_4over6=weights"
        )
    return errs


def wgrad_conflicts(r: RecipeConfig, s: StabilityConfig, where: str = "") -> list[str]:
    """stability.fp8_wgrad=false with backward_override=dequantized: two wgrad operands asked for."""
    if s.fp8_wgrad or r.backward_override != "dequantized":
        return []
    return [
        f"{where}stability.fp8_wgrad=false with recipe.backward_override=dequantized: fp8_wgrad=false puts "
        "wgrad on the unquantized input, dequantized on the dequantized forward copy; drop "
        "stability.fp8_wgrad=false (backward_override=high_precision covers it)"
    ]


def value_names() -> dict[str, tuple]:
    """legality.NAMES entries of the fields with a fixed set of values."""
    return {
        "recipe.backward_override": recipes.BACKWARD_OVERRIDES,
        "recipe.nvfp4_4over6": recipes.NVFP4_4OVER6_SCOPES,
        "recipe.nvfp4_4over6_e4m3_use_256": recipes.NVFP4_4OVER6_SCOPES,
        "recipe.nvfp4_4over6_err_mode": recipes.NVFP4_4OVER6_ERR_MODES,
    }
