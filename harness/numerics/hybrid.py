"""TE 2.20.2's hybrid recipes (custom_recipes/quantizer_factory_zoo.py) as lowp `custom` factories.

A hybrid recipe quantizes a tensor's two copies differently: the rowwise copy (what fprop reads of
input and weight, what dgrad reads of the gradient) with one quantizer, the columnwise copy (dgrad's
weight, wgrad's input and gradient) with another (docs/numerics.md §1 says which GEMM reads which
copy). TE composes them with `HybridQuantizer` (pytorch/tensor/hybrid_tensor.py) and keeps a copy in
high precision with `IdentityQuantizer` (pytorch/tensor/identity_tensor.py); lowp's `HybridQuantizer`
and `IdentityQuantizer` below do the same on lowp's own quantizers.

Each factory of TE's zoo is shipped under its TE name with lowp's factory signature
`factory(role, recipe_cfg)` (harness.numerics.custom), so `recipe=custom
recipe.quantizer_factory=mxfp8_fwd_nvfp4_bwd_factory` selects it (`load_factory` resolves the short
names through `FACTORIES`). lowp's roles map to TE's `QuantizerRole.tensor_type`: input -> "input",
weight -> "weight", grad -> "grad_output"; `module_type` is TE's "linear" (a dense Linear, the default)
or "grouped_linear" (an MoE layer's experts). The zoo fixes every format itself: the recipe's fields
(fp8, disable_rht, ...) do not change these factories, as TE's CustomRecipe passes none to its
qfactory. docs/numerics.md, "Hybrid recipes (TE's quantizer factory zoo)", has each factory's roles.

With backend=te the same names run TE's own zoo functions (`te_factory`), which need the formats'
hardware (`native_on`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from harness import recipes
from harness.config.schema import RecipeConfig
from harness.numerics.formats import E4M3
from harness.numerics.qtensor import Quantized
from harness.numerics.quantizers import MXFP8Quantizer, NVFP4Quantizer, Quantizer, quantize_pair

TE_ZOO = "transformer_engine.pytorch.custom_recipes.quantizer_factory_zoo"
TENSOR_TYPES = {"input": "input", "weight": "weight", "grad": "grad_output"}
"""lowp's role -> TE's QuantizerRole.tensor_type for a linear's three slots."""
MODULE_TYPES = ("linear", "grouped_linear")
COLUMNWISE_SOURCES = ("original", "rowwise_dequantized")


class IdentityQuantized(Quantized):
    """A high-precision copy (TE's IdentityTensorStorage): the values as given, no codes, no scale.

    GEMMs read the values themselves: bf16 values stay bf16 on the fast path (a bf16 GEMM with fp32
    accumulation, TE's high-precision GEMM), the reference path multiplies them in fp32."""

    def __init__(self, values: torch.Tensor, columnwise: bool):
        self.values, self.columnwise, self.shape = values.detach(), columnwise, values.shape

    def _dequantize(self) -> torch.Tensor:
        return self.values.float()

    def _gemm_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.values, None

    @property
    def data(self) -> torch.Tensor:
        return self.values

    def saturated_count(self) -> torch.Tensor:
        return torch.zeros((), device=self.values.device)

    def telemetry_scale(self) -> torch.Tensor:
        return torch.ones((), device=self.values.device)


class IdentityQuantizer(Quantizer):
    """TE's IdentityQuantizer: keeps x in its own dtype (bf16 for lowp's operands); both copies are
    the same values."""

    shared_copies = True

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> IdentityQuantized:
        return IdentityQuantized(x, columnwise)

    def __repr__(self) -> str:
        return "Identity(high precision)"


class HybridQuantizer(Quantizer):
    """TE's HybridQuantizer: the rowwise copy from `rowwise`, the columnwise copy from `columnwise`.

    `columnwise_source`: "original" quantizes the columnwise copy from x itself; "rowwise_dequantized"
    from the rowwise copy dequantized to x's dtype (TE: `rowwise_result.dequantize(dtype=tensor.dtype)`,
    hybrid_tensor.py:197-204), quantizing the rowwise copy for it even when only the columnwise copy
    is asked for (hybrid_tensor.py:210-215)."""

    def __init__(self, rowwise: Quantizer, columnwise: Quantizer, columnwise_source: str = "original"):
        if columnwise_source not in COLUMNWISE_SOURCES:
            raise ValueError(f"columnwise_source={columnwise_source!r}: use one of {COLUMNWISE_SOURCES}")
        if rowwise is columnwise:
            raise ValueError("HybridQuantizer needs two quantizer objects (TE refuses one for both copies)")
        self.rowwise, self.columnwise, self.columnwise_source = rowwise, columnwise, columnwise_source

    @property
    def fused(self) -> bool:
        """QuantizedLinear switches the fused casts of both children (the same codes either way)."""
        return bool(getattr(self.rowwise, "fused", False))

    @fused.setter
    def fused(self, value: bool) -> None:
        for child in (self.rowwise, self.columnwise):
            if isinstance(child, Quantizer):
                child.fused = value

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> Quantized:
        row, col = self.quantize_pair(x, not columnwise, columnwise)
        return col if columnwise else row

    def quantize_pair(self, x: torch.Tensor, rowwise: bool = True, columnwise: bool = True):
        from_row = columnwise and self.columnwise_source == "rowwise_dequantized"
        row = quantize_pair(self.rowwise, x, True, False)[0] if rowwise or from_row else None
        col = None
        if columnwise:
            src = row.dequantize().to(x.dtype) if from_row else x
            col = quantize_pair(self.columnwise, src, False, True)[1]
        return (row if rowwise else None), col

    def __repr__(self) -> str:
        src = self.columnwise_source
        return f"Hybrid(rowwise={self.rowwise!r}, columnwise={self.columnwise!r}, from={src})"


# ---------------------------------------------------------------------------------------------
# The zoo's components (TE's custom_recipes/quantizer_factories.py and the zoo's own helper)


def mxfp8() -> MXFP8Quantizer:
    """TE's mxfp8_factory (quantizer_factories.py:125): E4M3 for every role, grads included."""
    return MXFP8Quantizer(E4M3)


def nvfp4(tensor_type: str) -> NVFP4Quantizer:
    """TE's nvfp4_factory (quantizer_factories.py:140), the NVFP4BlockScaling defaults: weights 16x16
    tiles; inputs 1x16 with RHT on the columnwise copy; grads that too and stochastic rounding."""
    if tensor_type == "weight":
        return NVFP4Quantizer(tile_2d=True)
    return NVFP4Quantizer(rht=True, stochastic=tensor_type == "grad_output")


def plain_nvfp4(row_scaled: bool = False) -> NVFP4Quantizer:
    """The zoo's _plain_nvfp4_quantizer (zoo:106): 1x16 blocks, no RHT, stochastic rounding or 2-D
    tiles; `row_scaled`: one global amax per row (TE's row_scaled_nvfp4, docs/numerics.md §6)."""
    return NVFP4Quantizer(row_scaled=True) if row_scaled else NVFP4Quantizer()


def _tensor_type(role: str, module_type: str) -> str:
    if role not in TENSOR_TYPES:
        raise ValueError(f"role {role!r}: a linear's roles are {sorted(TENSOR_TYPES)}")
    if module_type not in MODULE_TYPES:
        raise ValueError(f"module_type {module_type!r}: lowp's emulator has {MODULE_TYPES}")
    return TENSOR_TYPES[role]


# ---------------------------------------------------------------------------------------------
# The zoo's factories, in its order (file:line of TE 2.20.2's quantizer_factory_zoo.py)


def high_precision_fwd_mxfp8_bwd_factory(role: str, recipe: RecipeConfig | None = None, module_type="linear"):
    """zoo:83. grad -> MXFP8; input, weight -> Hybrid(Identity, MXFP8, original)."""
    if _tensor_type(role, module_type) == "grad_output":
        return mxfp8()
    return HybridQuantizer(IdentityQuantizer(), mxfp8())


def mxfp8_fwd_nvfp4_bwd_factory(role: str, recipe: RecipeConfig | None = None, module_type="linear"):
    """zoo:120. input -> Hybrid(MXFP8, nvfp4_factory's input, original); weight -> Hybrid(MXFP8,
    plain NVFP4, rowwise_dequantized); grad -> nvfp4_factory's grad (RHT columnwise, SR)."""
    tt = _tensor_type(role, module_type)
    if tt == "input":
        return HybridQuantizer(mxfp8(), nvfp4(tt))
    if tt == "weight":
        return HybridQuantizer(mxfp8(), plain_nvfp4(), "rowwise_dequantized")
    return nvfp4(tt)


def nvfp4_1d_weight_factory(role: str, recipe: RecipeConfig | None = None, module_type="linear"):
    """zoo:161. weight -> Hybrid(plain NVFP4, plain NVFP4, rowwise_dequantized); input and grad ->
    nvfp4_factory (the NVFP4 recipe's defaults)."""
    tt = _tensor_type(role, module_type)
    if tt == "weight":
        return HybridQuantizer(plain_nvfp4(), plain_nvfp4(), "rowwise_dequantized")
    return nvfp4(tt)


def mxfp8_fwd_high_precision_bwd_factory(role: str, recipe: RecipeConfig | None = None, module_type="linear"):
    """zoo:199. input, weight -> Hybrid(MXFP8, Identity, rowwise_dequantized); grad -> Identity."""
    if _tensor_type(role, module_type) == "grad_output":
        return IdentityQuantizer()
    return HybridQuantizer(mxfp8(), IdentityQuantizer(), "rowwise_dequantized")


def nvfp4_row_scaled_fwd_mxfp8_bwd_factory(
    role: str, recipe: RecipeConfig | None = None, module_type="linear"
):
    """zoo:238. Experts (grouped_linear): input -> Hybrid(row-scaled plain NVFP4, MXFP8,
    rowwise_dequantized); weight -> Hybrid(plain NVFP4, MXFP8, rowwise_dequantized); grad -> MXFP8.
    A dense Linear: MXFP8 for every role."""
    tt = _tensor_type(role, module_type)
    if module_type == "grouped_linear" and tt == "input":
        return HybridQuantizer(plain_nvfp4(row_scaled=True), mxfp8(), "rowwise_dequantized")
    if module_type == "grouped_linear" and tt == "weight":
        return HybridQuantizer(plain_nvfp4(), mxfp8(), "rowwise_dequantized")
    return mxfp8()


def nvfp4_row_scaled_fwd_high_precision_bwd_factory(
    role: str, recipe: RecipeConfig | None = None, module_type="linear"
):
    """zoo:299. input -> Hybrid(row-scaled plain NVFP4, Identity, rowwise_dequantized); weight ->
    Hybrid(plain NVFP4, Identity, rowwise_dequantized); grad -> Identity."""
    tt = _tensor_type(role, module_type)
    if tt == "input":
        return HybridQuantizer(plain_nvfp4(row_scaled=True), IdentityQuantizer(), "rowwise_dequantized")
    if tt == "weight":
        return HybridQuantizer(plain_nvfp4(), IdentityQuantizer(), "rowwise_dequantized")
    return IdentityQuantizer()


def nvfp4_linear_fp8_dpa_factory(role: str, recipe: RecipeConfig | None = None, module_type="linear"):
    """zoo:356, its linear part: nvfp4_factory for every linear role. TE's factory answers attention's
    roles (module_type "dpa": FP8 current scaling, delayed scaling for S and dP) independently of the
    linears', and TE asks for them only under CustomRecipe(fp8_dpa=True); lowp's emulator has no FP8
    attention and refuses recipe.fp8_dpa=true, so here attention runs in BF16 as TE's does with
    fp8_dpa=False."""
    return nvfp4(_tensor_type(role, module_type))


FACTORIES: dict[str, Callable] = {
    f.__name__: f
    for f in (
        high_precision_fwd_mxfp8_bwd_factory,
        mxfp8_fwd_nvfp4_bwd_factory,
        nvfp4_1d_weight_factory,
        mxfp8_fwd_high_precision_bwd_factory,
        nvfp4_row_scaled_fwd_mxfp8_bwd_factory,
        nvfp4_row_scaled_fwd_high_precision_bwd_factory,
        nvfp4_linear_fp8_dpa_factory,
    )
}
"""TE's zoo name -> lowp's factory (what `recipe.quantizer_factory=NAME` selects)."""

NATIVE_RECIPES: dict[str, tuple[str, ...]] = {
    "high_precision_fwd_mxfp8_bwd_factory": ("mxfp8",),
    "mxfp8_fwd_nvfp4_bwd_factory": ("mxfp8", "nvfp4"),
    "nvfp4_1d_weight_factory": ("nvfp4",),
    "mxfp8_fwd_high_precision_bwd_factory": ("mxfp8",),
    "nvfp4_row_scaled_fwd_mxfp8_bwd_factory": ("mxfp8", "nvfp4"),
    "nvfp4_row_scaled_fwd_high_precision_bwd_factory": ("nvfp4",),
    "nvfp4_linear_fp8_dpa_factory": ("nvfp4",),
}
"""The recipe families whose kernels each factory's TE quantizers use (what the GPU must run natively)."""


def native_on(name: str, cc: float | None) -> tuple[bool, str]:
    """Whether TE runs the shipped factory `name` natively at compute capability `cc` (the registry's
    min_cc of each family it uses: MXFP8 and NVFP4 from 10.0, TE's check_mxfp8_support and
    check_nvfp4_support), and why not."""
    for family in NATIVE_RECIPES[name]:
        need = recipes.get(family).min_cc
        if cc is None or (need is not None and cc < need):
            return False, f"{name} uses {family} kernels: TE needs compute capability >= {need}, not {cc}"
    return True, ""


def short_name(path: str | None) -> str | None:
    """The zoo name a recipe.quantizer_factory value selects (`NAME` or
    `harness.numerics.hybrid:NAME`), or None for any other factory."""
    if not path:
        return None
    module, _, attr = path.rpartition(":")
    name = attr if module in ("", __name__) else None
    return name if name in FACTORIES else None


def te_factory(path: str | None) -> Callable | None:
    """TE's own zoo function for a shipped factory (what backend=te passes to CustomRecipe as its
    qfactory, called as qfactory(role: QuantizerRole) and returning TE quantizers), None for any other
    recipe.quantizer_factory. Imports TE."""
    name = short_name(path)
    return None if name is None else getattr(importlib.import_module(TE_ZOO), name)


def te_path(path: str | None) -> str | None:
    """The dotted path of TE's zoo function for a shipped factory (Megatron's --fp8-quantizer-factory
    imports it), None for any other recipe.quantizer_factory."""
    name = short_name(path)
    return None if name is None else f"{TE_ZOO}.{name}"
