"""The recipe registry: every fact another module asks about a recipe, in one frozen spec per name.

    spec = recipes.get("mxfp8")          # RecipeSpec; ValueError naming the choices for a bad name
    spec.peak_dtype, spec.gemm_multiple  # "fp8", 32
    recipes.default_fields("nvfp4")      # the RecipeConfig conf/recipe/nvfp4.yaml composes to
    recipes.names()                      # every recipe name, in the documented order

Nothing outside this module branches on a recipe's name: it asks the spec (quantizes GEMMs? which
TE recipe class? which `NVTE_*` variables? which Megatron flag value?) or composes the spec's hook
(INT4 QAT's fake-quantized weights). A new recipe is one `RecipeSpec` here, one quantizer scheme in
`harness.numerics.quantizers` and one `conf/recipe/<name>.yaml`; tests/test_recipes.py checks that
the YAML agrees with `default_fields`. Imports only the config schema (a leaf: no cycle through it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from harness.config.schema import RecipeConfig


@dataclass(frozen=True)
class NvteVar:
    """An `NVTE_*` variable TE reads at import: "1" when `getattr(recipe, field) == on_when`."""

    var: str
    field: str
    on_when: bool = True

    def value(self, recipe: RecipeConfig) -> str:
        return "1" if bool(getattr(recipe, self.field)) == self.on_when else "0"


@dataclass(frozen=True)
class MegatronFlags:
    """How Megatron-LM spells the recipe (megatron/training/arguments.py, core 0.14+)."""

    fp8_recipe: str | None = None
    """--fp8-recipe value (with --fp8-format recipe.fp8); None = not an FP8 recipe flag."""
    fp4_recipe: str | None = None
    """--fp4-recipe value (with --fp4-format recipe.fp4); None = Megatron's default or not FP4."""
    history_flags: bool = False
    """Print --fp8-amax-history-len / --fp8-amax-compute-algo (delayed scaling's own knobs)."""
    quantizer_factory: bool = False
    """Print --fp8-quantizer-factory / --fp4-quantizer-factory recipe.quantizer_factory."""
    note: str | None = None
    """A `#` line for what Megatron cannot express ({field} placeholders filled from the recipe)."""


@dataclass(frozen=True)
class RecipeSpec:
    name: str
    summary: str
    quantizes_gemms: bool
    """False for bf16 and int4_qat: BF16 GEMMs (int4_qat only fake-quantizes the weights)."""
    peak_dtype: str
    """The datasheet peak its GEMMs run at (HardwareConfig.peak_tflops key): bf16, fp8 or fp4."""
    scheme: str | None = None
    """The quantizer scheme of harness.numerics.quantizers (None: no quantizer)."""
    fp8_family: bool = False
    """An FP8 recipe: needs recipe.fp8 (e4m3 or hybrid); an FP8 format for Megatron's --fp8-format."""
    fp4_family: bool = False
    """An FP4 recipe: needs recipe.fp4=e2m1."""
    delayed_scaling: bool = False
    """Per-tensor scales from an amax history (state to checkpoint; fp8_margin applies)."""
    margin_applies: bool = False
    """stability.fp8_margin changes its numbers (TE applies the margin only in delayed scaling)."""
    te_check: str | None = None
    """transformer_engine.pytorch `is_*_available` that answers whether TE runs it here."""
    te_recipe_class: str | None = None
    """transformer_engine.common.recipe class (None: BF16 compute, no TE autocast quantization)."""
    nvte_vars: tuple[NvteVar, ...] = ()
    """The `NVTE_*` defaults TE reads at import that lowp sets from this recipe's fields."""
    gemm_multiple: int = 16
    """Every quantized GEMM dimension must be a multiple of this on backend=te."""
    min_te: str | None = None
    """Oldest Transformer Engine that has the recipe."""
    min_cc: float | None = None
    """Lowest compute capability TE runs it natively on (None: any CUDA GPU)."""
    max_cc: float | None = None
    """First compute capability it is no longer native on (None: no upper bound)."""
    fused_casts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """TE casts these linears' operands to FP8 in the kernel that makes them, from fp32 (no bf16
    rounding first): role (input, grad) -> the linears' last names (see the note above _SPECS)."""
    hook: str | None = None
    """Recipe-specific behaviour the backends compose (harness.backends.hooks.make_hook)."""
    needs_factory: bool = False
    """The user gives recipe.quantizer_factory (the custom recipe)."""
    first_last_bf16_ok: bool = True
    """Megatron accepts --first-last-layers-bf16 with it (not under delayed scaling)."""
    cpu_offload_ok: bool = True
    """Megatron supports --optimizer-cpu-offload with it."""
    te_high_precision_backward_ok: bool = True
    """TE allows backward_override=high_precision (stability.fp8_wgrad=false) with it."""
    recommends_grad_buf_reuse: bool = False
    """With fp8_param the guide strongly recommends optimizer.reuse_grad_buf_for_mxfp8_param_ag."""
    full_master: bool = False
    """The TE optimizer must keep whole fp32 master weights (no bf16 + remainder split)."""
    te_only: bool = False
    """Only TE runs it as specified (FP8 attention: the emulated backend quantizes GEMMs only)."""
    megatron: MegatronFlags = field(default_factory=MegatronFlags)
    defaults: dict[str, Any] = field(default_factory=dict)
    """Fields that differ from RecipeConfig's defaults (conf/recipe/<name>.yaml says the same)."""

    def default_fields(self) -> RecipeConfig:
        """The recipe's full config with its preset values (torchao's `from_recipe_name`)."""
        return dataclasses.replace(RecipeConfig(), name=self.name, **self.defaults)

    def nvte_env(self, recipe: RecipeConfig) -> dict[str, str]:
        """The `NVTE_*` values this recipe's fields ask for."""
        return {v.var: v.value(recipe) for v in self.nvte_vars}


# Where TE 2.20.2's TransformerLayer casts an operand to FP8 inside the kernel that computes it, from
# fp32, with no bf16 rounding in between (csrc/extensions/normalization.cpp and activation.cpp pick
# FULLY_FUSED for Float8Quantizer -- delayed scaling -- and for MXFP8; layernorm_mlp.py's _act_func
# fuses dbias+dgelu+cast for delayed and MXFP8). Elsewhere (tensorwise, blockwise, NVFP4; SwiGLU's
# backward) the producer writes bf16 and a separate cast quantizes that. Keys: the linear's last name.
#   input: qkv and fc1 read the norm output (LayerNormLinear / LayerNormMLP; MXFP8's fused norm needs
#          NVTE_NORM_FWD_USE_CUDNN=1, not set by lowp), fc2 reads the activation output;
#   grad:  fc1's grad output is the activation's backward (GELU only).

_FP8 = dict(fp8_family=True, quantizes_gemms=True, peak_dtype="fp8")

_SPECS = (
    RecipeSpec(
        name="bf16",
        summary="BF16 baseline: bf16 compute, fp32 master weights, no quantization",
        quantizes_gemms=False,
        peak_dtype="bf16",
    ),
    RecipeSpec(
        name="delayed",
        summary="FP8 delayed scaling (TE DelayedScaling): scale from a rolling amax history",
        scheme="amax_history",
        delayed_scaling=True,
        margin_applies=True,
        te_check="is_fp8_available",
        te_recipe_class="DelayedScaling",
        min_cc=8.9,
        fused_casts={"input": ("qkv", "fc1", "fc2"), "grad": ("fc1",)},
        first_last_bf16_ok=False,
        te_high_precision_backward_ok=False,
        megatron=MegatronFlags(fp8_recipe="delayed", history_flags=True),
        defaults={"fp8": "hybrid", "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"},
        **_FP8,
    ),
    RecipeSpec(
        name="tensorwise",
        summary="FP8 per-tensor current scaling (TE Float8CurrentScaling)",
        scheme="current",
        te_check="is_fp8_available",
        te_recipe_class="Float8CurrentScaling",
        nvte_vars=(NvteVar("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "power_2_scales"),),
        min_cc=8.9,
        cpu_offload_ok=False,
        megatron=MegatronFlags(fp8_recipe="tensorwise"),
        defaults={"fp8": "hybrid", "power_2_scales": False, "amax_epsilon": 0.0},
        **_FP8,
    ),
    RecipeSpec(
        name="blockwise",
        summary="FP8 block scaling (TE Float8BlockScaling): 1x128 activations/grads, 128x128 weights",
        scheme="block",
        te_check="is_fp8_block_scaling_available",
        te_recipe_class="Float8BlockScaling",
        nvte_vars=(NvteVar("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "power_2_scales", on_when=False),),
        min_cc=9.0,
        cpu_offload_ok=False,
        megatron=MegatronFlags(fp8_recipe="blockwise"),
        defaults={
            "fp8": "e4m3",
            "power_2_scales": True,
            "amax_epsilon": 0.0,
            "x_block_dim": 1,
            "w_block_dim": 2,
            "grad_block_dim": 1,
        },
        **_FP8,
    ),
    RecipeSpec(
        name="mxfp8",
        summary="MXFP8 (TE MXFP8BlockScaling): E4M3 elements, one E8M0 scale per 32",
        scheme="mx",
        te_check="is_mxfp8_available",
        te_recipe_class="MXFP8BlockScaling",
        gemm_multiple=32,
        recommends_grad_buf_reuse=True,
        min_cc=10.0,
        max_cc=12.0,
        fused_casts={"input": ("fc2",), "grad": ("fc1",)},
        cpu_offload_ok=False,
        megatron=MegatronFlags(fp8_recipe="mxfp8"),
        defaults={"fp8": "e4m3"},
        **_FP8,
    ),
    RecipeSpec(
        name="nvfp4",
        summary="NVFP4 (TE NVFP4BlockScaling): E2M1 elements, E4M3 scale per 16 + fp32 global scale",
        quantizes_gemms=True,
        peak_dtype="fp4",
        scheme="nv",
        fp4_family=True,
        te_check="is_nvfp4_available",
        te_recipe_class="NVFP4BlockScaling",
        nvte_vars=(
            NvteVar("NVTE_NVFP4_DISABLE_RHT", "disable_rht"),
            NvteVar("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "disable_stochastic_rounding"),
            NvteVar("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "disable_2d_quantization"),
        ),
        gemm_multiple=16,
        min_te="2.7.0",
        min_cc=10.0,
        max_cc=12.0,
        cpu_offload_ok=False,
        defaults={
            "fp4": "e2m1",
            "disable_rht": False,
            "disable_stochastic_rounding": False,
            "disable_2d_quantization": False,
        },
    ),
    RecipeSpec(
        name="int4_qat",
        summary="INT4 fake-QAT (miles): INT4 weights in groups, straight-through gradients, BF16 GEMMs",
        quantizes_gemms=False,
        peak_dtype="bf16",
        scheme="int4",
        hook="int4_fake_quant",
        full_master=True,
        megatron=MegatronFlags(
            note="# INT4 fake-QAT has no upstream Megatron flag; miles enables it with "
            "OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 OPEN_TRAINING_INT4_GROUP_SIZE={int4_group_size} "
            "(routed MoE experts only there; lowp applies it to every block linear)"
        ),
        defaults={"int4_group_size": 128},
    ),
    RecipeSpec(
        name="custom",
        summary="A user-supplied quantizer factory: factory(role, recipe_cfg) -> quantizer",
        quantizes_gemms=True,
        peak_dtype="fp8",
        scheme="factory",
        margin_applies=True,
        te_recipe_class="CustomRecipe",
        needs_factory=True,
        megatron=MegatronFlags(fp8_recipe="custom", fp4_recipe="custom", quantizer_factory=True),
        defaults={"fp8": "e4m3", "quantizer_factory": None},
    ),
)


def _fp8_attention(base: RecipeSpec, summary: str, note: str | None = None, **defaults) -> RecipeSpec:
    """`base` with TE's FP8 attention (recipe.fp8_dpa): a recipe of its own, as it changes numerics."""
    megatron = dataclasses.replace(base.megatron, note=note) if note else base.megatron
    return dataclasses.replace(
        base,
        name=f"{base.name}_fp8attn",
        summary=summary,
        te_only=True,
        megatron=megatron,
        defaults={**base.defaults, "fp8_dpa": True, **defaults},
    )


_BY_NAME = {s.name: s for s in _SPECS}
_SPECS += (
    _fp8_attention(
        _BY_NAME["tensorwise"],
        "tensorwise linears with TE FP8 attention (fp8_dpa; attention in delayed scaling, "
        "which Hopper needs); on the 8B slice its loss left the BF16 band (benchmarks/RESULTS.md)",
        note="# FP8 attention in delayed scaling through the NVTE_DPA_FP8_RECIPE* variables below "
        "(TE has no fused current-scaling FP8 attention below compute capability 10.0)",
        fp8_dpa_recipe="delayed",
    ),
    _fp8_attention(_BY_NAME["delayed"], "FP8 delayed scaling with TE FP8 attention (fp8_dpa)"),
)


def _te_variant(base: RecipeSpec, suffix: str, what: str, **fields) -> RecipeSpec:
    """`base` with a TE-only option that changes numerics (`fields`): a recipe of its own, named
    `base.name + suffix`, its summary extended by `what`."""
    return dataclasses.replace(
        base,
        name=f"{base.name}{suffix}",
        summary=f"{base.summary}; {what}",
        te_only=True,
        defaults={**base.defaults, **fields},
    )


def _current_scaling(base: RecipeSpec) -> RecipeSpec:
    """The options TE takes from Float8CurrentScaling only (its per-GEMM MMParams, lowp's FP8-backward
    head on current-scaling quantizers) are built on current-scaling recipes only."""
    assert base.te_recipe_class == "Float8CurrentScaling", base.name
    return base


# the LM head in FP8 (recipe.fp8_lm_head): a te.Linear under the recipe
_SPECS += tuple(
    _te_variant(
        s, "_fp8head", "the LM head's GEMMs in FP8 too (te.Linear under the recipe)", fp8_lm_head=True
    )
    for s in _SPECS
    if s.name in ("tensorwise", "tensorwise_fp8attn")
)
# the LM head's dgrad and wgrad in FP8, its logits GEMM in BF16 (recipe.fp8_lm_head_fprop=false)
_SPECS += (
    _te_variant(
        _current_scaling(_BY_NAME["tensorwise"]),
        "_fp8headbwd",
        "the LM head's dgrad and wgrad GEMMs in FP8 too (its logits in BF16)",
        fp8_lm_head=True,
        fp8_lm_head_fprop=False,
    ),
)
# FP8 fast accumulation in dgrad and wgrad too (recipe.fp8_fast_accumulation=all)
_SPECS += tuple(
    _te_variant(
        _current_scaling(s),
        "_fastacc",
        "FP8 fast accumulation in dgrad and wgrad too (no split accumulator)",
        fp8_fast_accumulation="all",
    )
    for s in _SPECS
    if s.name in ("tensorwise", "tensorwise_fp8attn", "tensorwise_fp8head", "tensorwise_fp8headbwd")
)
REGISTRY: dict[str, RecipeSpec] = {s.name: s for s in _SPECS}
BASELINE = "bf16"
"""The unquantized recipe: what a module runs where the precision plan quantizes nothing."""


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str) -> RecipeSpec:
    """The spec of `name`; ValueError naming the choices for an unknown one."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"recipe={name}: unknown; choose one of {list(REGISTRY)}") from None


def default_fields(name: str) -> RecipeConfig:
    return get(name).default_fields()


def fp8_recipes() -> tuple[str, ...]:
    return tuple(s.name for s in _SPECS if s.fp8_family)


def quantizing(recipe: RecipeConfig | None) -> RecipeConfig | None:
    """`recipe` if its GEMMs are quantized, else None (BF16 GEMMs: bf16 itself, int4_qat)."""
    return recipe if recipe is not None and get(recipe.name).quantizes_gemms else None


def fp4_min_te() -> str | None:
    """The oldest TE with any FP4 recipe (recipe.fp4 set under any recipe needs it)."""
    versions = [s.min_te for s in _SPECS if s.fp4_family and s.min_te]
    return min(versions, key=lambda v: tuple(int(p) for p in v.split("."))) if versions else None


def native_on(compute_capability: float) -> list[str]:
    """The recipes TE runs natively on a GPU of this compute capability (for an unknown GPU)."""
    return [
        s.name
        for s in _SPECS
        if not s.needs_factory
        and (s.min_cc is None or compute_capability >= s.min_cc)
        and (s.max_cc is None or compute_capability < s.max_cc)
    ]
