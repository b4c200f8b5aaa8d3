"""The TE recipe object for a recipe config, every field set explicitly (no TE default relied on).

The registry names the class (`RecipeSpec.te_recipe_class`); one builder per TE class here.
"""

from __future__ import annotations

import importlib

from harness import recipes
from harness.backends.capability import te_backward_override
from harness.config.schema import RecipeConfig, StabilityConfig
from harness.numerics.hybrid import te_factory
from harness.numerics.quantizers import load_factory


def _fmt(R, r: RecipeConfig):
    return {"e4m3": R.Format.E4M3, "hybrid": R.Format.HYBRID}.get(r.fp8 or "", R.Format.E4M3)


def _qparams(R, r: RecipeConfig, rec):
    qp = lambda: R.QParams(power_2_scale=r.power_2_scales, amax_epsilon=r.amax_epsilon)  # noqa: E731
    rec.fp8_quant_fwd_inp, rec.fp8_quant_fwd_weight, rec.fp8_quant_bwd_grad = qp(), qp(), qp()
    return rec


def _delayed(R, r, s):
    return R.DelayedScaling(
        margin=s.fp8_margin,
        fp8_format=_fmt(R, r),
        amax_history_len=r.fp8_amax_history_len,
        amax_compute_algo=r.fp8_amax_compute_algo,
        reduce_amax=True,
        fp8_dpa=r.fp8_dpa,
        fp8_mha=r.fp8_mha,
        backward_override=None,
    )


def _gemm_params(R, r: RecipeConfig) -> dict:
    """Float8CurrentScaling's per-GEMM accumulation (recipe.fp8_fast_accumulation): fprop always on
    fast accumulation (TE's default), dgrad and wgrad on it only with `all`; TE's Linear,
    LayerNormLinear and LayerNormMLP read these fields (recipe.fp8_gemm_*.use_split_accumulator)."""
    split_backward = r.fp8_fast_accumulation != "all"
    return {
        "fp8_gemm_fprop": R.MMParams(use_split_accumulator=False),
        "fp8_gemm_dgrad": R.MMParams(use_split_accumulator=split_backward),
        "fp8_gemm_wgrad": R.MMParams(use_split_accumulator=split_backward),
    }


def _current(R, r, s):
    rec = R.Float8CurrentScaling(
        fp8_format=_fmt(R, r),
        fp8_dpa=r.fp8_dpa,
        fp8_mha=r.fp8_mha,
        backward_override=te_backward_override(r, s),
        **_gemm_params(R, r),
    )
    return _qparams(R, r, rec)


def _block(R, r, s):
    rec = R.Float8BlockScaling(
        fp8_format=_fmt(R, r),
        x_block_scaling_dim=r.x_block_dim,
        w_block_scaling_dim=r.w_block_dim,
        grad_block_scaling_dim=r.grad_block_dim,
        backward_override=te_backward_override(r, s),
    )
    return _qparams(R, r, rec)


def _mxfp8(R, r, s):
    return R.MXFP8BlockScaling(
        fp8_format=_fmt(R, r),
        backward_override=te_backward_override(r, s),
        enable_2d_quantization=r.enable_2d_quantization,
    )


def _nvfp4(R, r, s):
    return R.NVFP4BlockScaling(
        disable_rht=r.disable_rht,
        disable_stochastic_rounding=r.disable_stochastic_rounding,
        disable_2d_quantization=r.disable_2d_quantization,
        backward_override=te_backward_override(r, s),
    )


def _custom(R, r, s):
    return R.CustomRecipe(
        qfactory=te_factory(r.quantizer_factory) or load_factory(r.quantizer_factory),
        fp8_format=_fmt(R, r),
        backward_override=te_backward_override(r, s),
    )


BUILDERS = {  # TE recipe class -> builder
    "DelayedScaling": _delayed,
    "Float8CurrentScaling": _current,
    "Float8BlockScaling": _block,
    "MXFP8BlockScaling": _mxfp8,
    "NVFP4BlockScaling": _nvfp4,
    "CustomRecipe": _custom,
}


def build_te_recipe(r: RecipeConfig, s: StabilityConfig):
    """The TE recipe object for `r`; None for BF16 compute (no TE recipe class: bf16, int4_qat)."""
    cls = recipes.get(r.name).te_recipe_class
    if cls is None:
        return None
    from transformer_engine.common import recipe as R

    return BUILDERS[cls](R, r, s)


TE_FACTORIES = "transformer_engine.pytorch.custom_recipes.quantizer_factories"
FACTORY_OF = {
    "Float8CurrentScaling": "current_scaling_factory",
    "Float8BlockScaling": "float8_block_scaling_factory",
    "MXFP8BlockScaling": "mxfp8_factory",
    "NVFP4BlockScaling": "nvfp4_factory",
}
"""TE recipe class (the registry's te_recipe_class) -> TE's factory that mirrors its defaults
(TE 2.20.2 pytorch/custom_recipes/quantizer_factories.py)."""
HIGH_PRECISION = "high_precision_factory"
"""TE's factory of IdentityQuantizer: the slot's GEMM runs unquantized (BF16)."""

TE_GEMM_NAMES = {
    "attn.qkv": "self_attention.layernorm_linear_qkv",
    "attn.proj": "self_attention.proj",
    "mlp.fc1": "layernorm_mlp.fc1",
    "mlp.fc2": "layernorm_mlp.fc2",
}
"""A block linear -> the name te.TransformerLayer(name="blocks.N") gives its GEMM's quantizer roles
(TE 2.20.2 transformer.py:485,538; attention/multi_head_attention.py:400,487; LayerNormMLP's
`get_quantizer_roles`, module/layernorm_mlp.py:2210-2212, names fc1 and fc2 apart)."""


def factory_name(recipe: RecipeConfig | None, where: str) -> str:
    """The TE factory that quantizes like `recipe` at its preset's defaults; None: high precision."""
    if recipe is None:
        return HIGH_PRECISION
    factory = FACTORY_OF.get(recipes.get(recipe.name).te_recipe_class or "")
    if factory is None or recipe != recipes.default_fields(recipe.name):
        raise ValueError(
            f"{where}: {recipes.label(recipe)} has no TE factory at its defaults, and backend=te can split "
            "a block between recipes only through TE's factories; give the whole block one recipe "
            "(e.g. 'blocks.0.*') or use backend=emulated"
        )
    return factory


def split_block_recipe(index: int, planned: dict[str, RecipeConfig | None]):
    """A block whose linears run different recipes (a precision plan: Megatron's
    --te-precision-config-file does the same per module): TE applies one recipe per autocast, so the
    block runs under a CustomRecipe whose factory gives each GEMM's quantizer slots the TE factory of
    its module's recipe, found by TE's role name (TE_GEMM_NAMES). Slots of no block linear (the
    attention's, a boundary's) stay in high precision, as under the block's native recipes."""
    from transformer_engine.common import recipe as R

    unknown = sorted(set(planned) - set(TE_GEMM_NAMES))
    if unknown:
        raise ValueError(
            f"stability.overrides split block {index} between recipes where it holds {unknown}; "
            "backend=te splits dense blocks only: give the whole block one recipe (e.g. 'blocks.0.*') "
            "or use backend=emulated"
        )
    by_role = {
        f"blocks.{index}.{TE_GEMM_NAMES[lin]}": factory_name(r, f"blocks.{index}.{lin}")
        for lin, r in planned.items()
    }
    return R.CustomRecipe(qfactory=ModuleFactories(by_role))


class ModuleFactories:
    """A CustomRecipe qfactory: a quantizer slot's module name (QuantizerRole.name) -> the TE factory
    named for it (exact, else the longest name it ends with after a '.': a wrapper's prefix), else high
    precision. A class, not a closure: TE pickles the module's recipe into each checkpoint
    (module/base.py `get_extra_state`), qfactory included."""

    def __init__(self, factories: dict[str, str]):
        self.factories = dict(factories)

    def factory_for(self, name: str) -> str:
        if name in self.factories:
            return self.factories[name]
        ends = [k for k in self.factories if name.endswith("." + k)]
        return self.factories[max(ends, key=len)] if ends else HIGH_PRECISION

    def __call__(self, role):
        factories = importlib.import_module(TE_FACTORIES)
        return getattr(factories, self.factory_for(getattr(role, "name", "") or ""))(role)
