"""The `custom` recipe: a user's quantizer factory, imported from "module:function".

`factory(role, recipe_cfg)` returns an object with `quantize(x, columnwise) -> obj` where
`obj.dequantize()` gives float32 values in x's shape and orientation (lowp's own quantizers
have this interface, so any of them can serve as an example). The factory is imported by
`harness.numerics.quantizers.load_factory`, which validates the path.

TE 2.20.2's hybrid recipes (its custom_recipes/quantizer_factory_zoo.py) ship as factories of this
kind in `harness.numerics.hybrid`, selected by their TE names alone
(`recipe.quantizer_factory=mxfp8_fwd_nvfp4_bwd_factory`). A quantizer subclassing
`harness.numerics.quantizers.Quantizer` may override `quantize_pair(x, rowwise, columnwise)` to make
the two copies together (as hybrid's do). A factory that takes a keyword `module_type` is asked as
TE asks its qfactory: "linear" for a dense linear, "grouped_linear" for an MoE layer's experts
(TE's GroupedLinear); one without it answers every linear alike.
"""

from __future__ import annotations

import inspect

from harness.config.schema import RecipeConfig
from harness.numerics.quantizers import CurrentScalingQuantizer, load_factory
from harness.numerics.scaling import fp8_format_for

ROLES = ("input", "weight", "grad")


def tensorwise_factory(role: str, recipe: RecipeConfig):
    """Example factory: per-tensor current scaling in the recipe's fp8 format (e4m3 by default)."""
    return CurrentScalingQuantizer(fp8_format_for(recipe.fp8 or "e4m3", role))


def module_quantizers(recipe: RecipeConfig, module_type: str) -> dict | None:
    """The role -> quantizer dict of the custom recipe's factory for TE's `module_type`, or None when
    the factory takes no `module_type` (the quantizers make_quantizer builds are then the same)."""
    factory = load_factory(recipe.quantizer_factory)
    if "module_type" not in inspect.signature(factory).parameters:
        return None
    return {role: factory(role, recipe, module_type=module_type) for role in ROLES}
