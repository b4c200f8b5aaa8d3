"""Quantizers: one object per (recipe, role) with `quantize(x, columnwise) -> Quantized`.

The same interface a custom recipe's factory returns (architecture.md). `quantize_pair` makes
the rowwise and columnwise copies together, sharing work where TE's copies share it (per-tensor
scaling and 2-D tiles: the columnwise copy is the transpose of the rowwise one).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable

import torch

from harness import recipes
from harness.config.schema import RecipeConfig
from harness.numerics.blockwise import quantize_blockwise
from harness.numerics.formats import FP8Format
from harness.numerics.int4 import quantize_int4
from harness.numerics.mxfp8 import quantize_mxfp8
from harness.numerics.nvfp4 import Options, quantize_nvfp4
from harness.numerics.qtensor import Quantized
from harness.numerics.scaling import amax, fp8_format_for
from harness.numerics.tensorwise import current_scale, quantize_per_tensor

Pair = tuple[Quantized | None, Quantized | None]


def twin(q: Quantized, columnwise: bool) -> Quantized:
    """The same codes seen as the other copy (shares the dequantized cache)."""
    other = copy.copy(q)
    other.columnwise, other._source = columnwise, q
    return other


class Quantizer:
    """Base: subclasses implement `quantize`; `shared_copies` says the copies are transposes.
    `fused`: cast and GEMM operand in one pass (harness.numerics.fast), same codes and scales."""

    shared_copies = False
    fused = False

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> Quantized:
        raise NotImplementedError

    def quantize_pair(self, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True) -> Pair:
        if self.shared_copies and rowwise and columnwise:
            row = self.quantize(x, False)
            return row, twin(row, True)
        return (self.quantize(x, False) if rowwise else None, self.quantize(x, True) if columnwise else None)


class CurrentScalingQuantizer(Quantizer):
    shared_copies = True

    def __init__(self, fmt: FP8Format, power_2: bool = False, epsilon: float = 0.0):
        self.fmt, self.power_2, self.epsilon = fmt, power_2, epsilon

    def quantize(self, x, columnwise=False):
        a, has_nan = amax(x)
        scale = current_scale(a, self.fmt, power_2=self.power_2, epsilon=self.epsilon)
        return quantize_per_tensor(
            x, self.fmt, scale, columnwise=columnwise, amax_=a, has_nan=has_nan, fused=self.fused
        )

    def __repr__(self):
        return f"CurrentScaling({self.fmt}, pow2={self.power_2}, eps={self.epsilon})"


class DelayedScalingQuantizer(Quantizer):
    """Casts with a scale from `get_scale()` and reports each cast's amax to `record(amax)`."""

    shared_copies = True

    def __init__(self, fmt: FP8Format, get_scale: Callable[[], torch.Tensor], record=None):
        self.fmt, self.get_scale, self.record = fmt, get_scale, record

    def quantize(self, x, columnwise=False):
        a, has_nan = amax(x)
        if self.record is not None:
            self.record(a)
        return quantize_per_tensor(
            x, self.fmt, self.get_scale(), columnwise=columnwise, amax_=a, has_nan=has_nan, fused=self.fused
        )

    def __repr__(self):
        return f"DelayedScaling({self.fmt})"


class BlockwiseQuantizer(Quantizer):
    def __init__(self, fmt: FP8Format, tile_2d: bool, power_2: bool = True, epsilon: float = 0.0):
        self.fmt, self.tile_2d, self.power_2, self.epsilon = fmt, tile_2d, power_2, epsilon
        self.shared_copies = tile_2d

    def quantize(self, x, columnwise=False):
        return quantize_blockwise(
            x,
            self.fmt,
            tile_2d=self.tile_2d,
            columnwise=columnwise,
            power_2=self.power_2,
            epsilon=self.epsilon,
            fused=self.fused,
        )

    def __repr__(self):
        return f"Blockwise({self.fmt}, {'128x128' if self.tile_2d else '1x128'}, pow2={self.power_2})"


class MXFP8Quantizer(Quantizer):
    """`tile_2d`: 32x32 tiles (recipe.enable_2d_quantization, weights): both copies have the same
    codes, each quantized in its own scale layout (the columnwise copy is not a transpose here)."""

    def __init__(self, fmt: FP8Format, tile_2d: bool = False):
        self.fmt, self.tile_2d = fmt, tile_2d

    def quantize(self, x, columnwise=False):
        return quantize_mxfp8(x, self.fmt, columnwise=columnwise, fused=self.fused, tile_2d=self.tile_2d)

    def __repr__(self):
        return f"MXFP8({self.fmt}, {'32x32' if self.tile_2d else '1x32'}, E8M0)"


class NVFP4Quantizer(Quantizer):
    """TE's NVFP4Quantizer. `row_scaled`: one global amax per row (per column of x for the
    columnwise copy); `four_over_six`: per block the better of the scales to 6 and to 4 by
    `err_mode` ("MAE" or "MSE") under the global E4M3 bound `e4m3_max` (448 or 256; 448 unless
    four_over_six, as TE). TE refuses 4over6 with RHT or stochastic rounding, and row scaling with
    16x16 tiles (quantization.py:1712-1718, reference_nvfp4.py:875-880); so does this."""

    def __init__(
        self,
        tile_2d=False,
        rht=False,
        stochastic=False,
        generator=None,
        *,
        row_scaled: bool = False,
        four_over_six: bool = False,
        e4m3_max: float = 448.0,
        err_mode: str = "MAE",
    ):
        if four_over_six and (rht or stochastic):
            raise ValueError("NVFP4 4over6 does not support RHT or stochastic rounding (as TE)")
        if row_scaled and tile_2d:
            raise ValueError("row-scaled NVFP4 supports 1x16 blocks only, not 16x16 tiles (as TE)")
        self.tile_2d, self.rht, self.stochastic, self.generator = tile_2d, rht, stochastic, generator
        e4m3_max = float(e4m3_max) if four_over_six else 448.0
        self.options = Options(row_scaled, four_over_six, e4m3_max, err_mode.upper())
        # 4over6 sums a 16x16 tile's errors line by line: the columnwise copy's lines are x's columns
        self.shared_copies = tile_2d and not four_over_six

    def quantize(self, x, columnwise=False):
        return quantize_nvfp4(
            x,
            columnwise=columnwise,
            tile_2d=self.tile_2d,
            rht=self.rht,
            stochastic=self.stochastic,
            generator=self.generator,
            fused=self.fused,
            options=self.options,
        )

    def __repr__(self):
        o = self.options
        extra = ", row_scaled=True" if o.row_scaled else ""
        extra += f", 4over6={o.err_mode}/e4m3_max={o.e4m3_max:g}" if o.four_over_six else ""
        return f"NVFP4({'16x16' if self.tile_2d else '1x16'}, rht={self.rht}, sr={self.stochastic}{extra})"


class Int4Quantizer(Quantizer):
    shared_copies = True

    def __init__(self, group_size: int):
        self.group_size = group_size

    def quantize(self, x, columnwise=False):
        q = quantize_int4(x, self.group_size)
        return twin(q, True) if columnwise else q

    def __repr__(self):
        return f"Int4(group={self.group_size})"


def _current(recipe: RecipeConfig, role: str, **_) -> Quantizer:
    fmt = fp8_format_for(recipe.fp8, role)
    return CurrentScalingQuantizer(fmt, recipe.power_2_scales, recipe.amax_epsilon)


def _delayed(recipe: RecipeConfig, role: str, *, scale=None, record=None, **_) -> Quantizer:
    if scale is None:
        raise ValueError(f"recipe={recipe.name}: pass scale= (step 1 of training uses scale=1.0)")
    fixed = None if callable(scale) else torch.as_tensor(scale, dtype=torch.float32)
    get = scale if fixed is None else (lambda: fixed)
    return DelayedScalingQuantizer(fp8_format_for(recipe.fp8, role), get, record)


def _block(recipe: RecipeConfig, role: str, **_) -> Quantizer:
    dim = {"input": recipe.x_block_dim, "weight": recipe.w_block_dim, "grad": recipe.grad_block_dim}[role]
    if dim not in (1, 2):
        raise ValueError(f"blockwise {role} block dim {dim}: use 1 (1x128) or 2 (128x128)")
    fmt = fp8_format_for(recipe.fp8, role)
    return BlockwiseQuantizer(fmt, dim == 2, recipe.power_2_scales, recipe.amax_epsilon)


def _mx(recipe: RecipeConfig, role: str, **_) -> Quantizer:
    # TE 2.20.2 quantization.py:1536-1547: 2D only for forward-mode weights of (grouped) linears
    return MXFP8Quantizer(
        fp8_format_for(recipe.fp8, role), role == "weight" and recipe.enable_2d_quantization
    )


def _in_scope(scope: str, role: str) -> bool:
    """TE's nvfp4_4over6 / nvfp4_4over6_e4m3_use_256 scopes: none, weights, activations, all."""
    return scope == "all" or scope == ("weights" if role == "weight" else "activations")


def _nv(recipe: RecipeConfig, role: str, *, generator=None, **_) -> Quantizer:
    """TE 2.20.2 quantization.py:1690-1750 (`_make`): 4over6 by scope on weights and activations,
    never on gradients; the 256 bound by its own scope among those; row scaling on the forward
    activations (lowp's input role)."""
    fp8_format_for("e4m3", role)  # validates the role
    if role == "grad":
        sr = not recipe.disable_stochastic_rounding
        return NVFP4Quantizer(rht=not recipe.disable_rht, stochastic=sr, generator=generator)
    four = _in_scope(recipe.nvfp4_4over6, role)
    opts = dict(
        four_over_six=four,
        e4m3_max=256.0 if four and _in_scope(recipe.nvfp4_4over6_e4m3_use_256, role) else 448.0,
        err_mode=recipe.nvfp4_4over6_err_mode,
    )
    if role == "weight":
        return NVFP4Quantizer(tile_2d=not recipe.disable_2d_quantization, **opts)
    return NVFP4Quantizer(rht=not recipe.disable_rht, row_scaled=recipe.row_scaled_activation, **opts)


def _int4(recipe: RecipeConfig, role: str, **_) -> Quantizer:
    return Int4Quantizer(recipe.int4_group_size)


def _factory(recipe: RecipeConfig, role: str, **_):
    quantizer = load_factory(recipe.quantizer_factory)(role, recipe)
    if not callable(getattr(quantizer, "quantize", None)):
        raise ValueError(
            f"recipe.quantizer_factory={recipe.quantizer_factory}: returned {type(quantizer).__name__} "
            f"for role {role}, which has no quantize(x, columnwise); return a quantizer object "
            "(e.g. harness.numerics.custom:tensorwise_factory)"
        )
    return quantizer


SCHEMES = {  # RecipeSpec.scheme -> builder(recipe, role, scale=, record=, generator=)
    "current": _current,
    "amax_history": _delayed,
    "block": _block,
    "mx": _mx,
    "nv": _nv,
    "int4": _int4,
    "factory": _factory,
}


def make_quantizer(
    recipe: RecipeConfig,
    role: str,
    *,
    scale: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    record=None,
    generator: torch.Generator | None = None,
) -> Quantizer:
    """The quantizer TE would build for `role` under `recipe` (roles: input, weight, grad).

    Delayed scaling needs `scale` (a tensor, or a callable returning the current one). The recipe's
    quantizer scheme comes from the registry (`RecipeSpec.scheme`).
    """
    scheme = recipes.get(recipe.name).scheme
    if scheme is None:
        raise ValueError(f"recipe={recipe.name!r} has no quantizer ({recipe.name} is unquantized)")
    return SCHEMES[scheme](recipe, role, scale=scale, record=record, generator=generator)


SHIPPED_FACTORIES = "harness.numerics.hybrid"  # TE's zoo factories, selected by their names alone


def load_factory(path: str | None) -> Callable:
    """Import `module:function`, or a shipped factory by its name (TE's zoo names,
    harness.numerics.hybrid); ValueError with the fix when it is missing or malformed."""
    shipped = importlib.import_module(SHIPPED_FACTORIES).FACTORIES  # by path, as any factory's module
    if path in shipped:
        return shipped[path]
    if not path or ":" not in path:
        raise ValueError(
            f"recipe.quantizer_factory={path!r}: give an import path 'module:function' (e.g. "
            f"harness.numerics.custom:tensorwise_factory) or a shipped factory: {', '.join(shipped)}"
        )
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"recipe.quantizer_factory={path!r}: cannot import ({e})") from e
    if not callable(fn):
        raise ValueError(f"recipe.quantizer_factory={path!r} is not callable")
    return fn


def quantize_pair(qz, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True) -> Pair:
    """Both copies from any quantizer, including a custom one with only `quantize`."""
    if isinstance(qz, Quantizer):
        return qz.quantize_pair(x, rowwise, columnwise)
    return (qz.quantize(x, False) if rowwise else None, qz.quantize(x, True) if columnwise else None)
