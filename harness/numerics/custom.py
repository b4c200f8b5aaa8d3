"""The `custom` recipe: a user's quantizer factory, imported from "module:function".

`factory(role, recipe_cfg)` returns an object with `quantize(x, columnwise) -> obj` where
`obj.dequantize()` gives float32 values in x's shape and orientation (lowp's own quantizers
have this interface, so any of them can serve as an example).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from harness.config.schema import RecipeConfig
from harness.numerics.quantizers import CurrentScalingQuantizer
from harness.numerics.scaling import fp8_format_for


def load_factory(path: str | None) -> Callable:
    """Import `module:function`; ValueError with the fix when it is missing or malformed."""
    if not path or ":" not in path:
        raise ValueError(
            f"recipe.quantizer_factory={path!r}: give an import path 'module:function', "
            "e.g. harness.numerics.custom:tensorwise_factory"
        )
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"recipe.quantizer_factory={path!r}: cannot import ({e})") from e
    if not callable(fn):
        raise ValueError(f"recipe.quantizer_factory={path!r} is not callable")
    return fn


def tensorwise_factory(role: str, recipe: RecipeConfig):
    """Example factory: per-tensor current scaling in the recipe's fp8 format (e4m3 by default)."""
    return CurrentScalingQuantizer(fp8_format_for(recipe.fp8 or "e4m3", role))
