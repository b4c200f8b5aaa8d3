"""The `custom` recipe: a user's quantizer factory, imported from "module:function".

`factory(role, recipe_cfg)` returns an object with `quantize(x, columnwise) -> obj` where
`obj.dequantize()` gives float32 values in x's shape and orientation (lowp's own quantizers
have this interface, so any of them can serve as an example). The factory is imported by
`harness.numerics.quantizers.load_factory`, which validates the path.

TE 2.20.2's hybrid recipes (its custom_recipes/quantizer_factory_zoo.py) ship as factories of this
kind in `harness.numerics.hybrid`, selected by their TE names alone
(`recipe.quantizer_factory=mxfp8_fwd_nvfp4_bwd_factory`). A factory's quantizer may also implement
`quantize_pair(x, rowwise, columnwise)` to make the two copies together (as hybrid's do).
"""

from __future__ import annotations

from harness.config.schema import RecipeConfig
from harness.numerics.quantizers import CurrentScalingQuantizer
from harness.numerics.scaling import fp8_format_for


def tensorwise_factory(role: str, recipe: RecipeConfig):
    """Example factory: per-tensor current scaling in the recipe's fp8 format (e4m3 by default)."""
    return CurrentScalingQuantizer(fp8_format_for(recipe.fp8 or "e4m3", role))
