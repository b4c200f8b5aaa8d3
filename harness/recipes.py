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

from harness.config.schema import RecipeConfig, StabilityConfig


@dataclass(frozen=True)
class NvteVar:
    """An `NVTE_*` variable TE reads at import as a recipe field's default.

    A switch ("1" when `getattr(recipe, field) == on_when`, else "0"), or with `text` the field's
    value itself (None: the variable must stay unset, since TE would read any string it holds, ""
    included: `os.getenv("NVTE_BACKWARD_OVERRIDE", None)` in common/recipe/__init__.py). `upper`: TE
    upper-cases what it reads (NVTE_NVFP4_4OVER6_ERR_MODE), so "mse" in the environment means MSE.
    `te_default`: the value TE assumes when the variable is unset."""

    var: str
    field: str
    on_when: bool = True
    text: bool = False
    upper: bool = False
    te_default: str | None = "0"

    def value(self, recipe: RecipeConfig) -> str | None:
        if self.text:
            v = getattr(recipe, self.field)
            return None if v is None else str(v)
        return "1" if bool(getattr(recipe, self.field)) == self.on_when else "0"

    def same(self, have: str, want: str | None) -> bool:
        """Whether an environment value `have` asks TE for what `want` asks."""
        return want is not None and (have.upper() == want.upper() if self.upper else have == want)


BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
"""recipe.backward_override's values (TE common/recipe/__init__.py `_BACKWARD_OVERRIDES`)."""
NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")
"""recipe.nvfp4_4over6 and nvfp4_4over6_e4m3_use_256 (TE `_NVFP4_4OVER6_SCOPES`)."""
NVFP4_4OVER6_ERR_MODES = ("MAE", "MSE")
"""recipe.nvfp4_4over6_err_mode (TE `_NVFP4_4OVER6_ERR_MODES`; TE's field takes them upper-case)."""
_BACKWARD_VAR = NvteVar("NVTE_BACKWARD_OVERRIDE", "backward_override", text=True, te_default=None)


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
    megatron: MegatronFlags = field(default_factory=MegatronFlags)
    defaults: dict[str, Any] = field(default_factory=dict)
    """Fields that differ from RecipeConfig's defaults (conf/recipe/<name>.yaml says the same)."""

    def default_fields(self) -> RecipeConfig:
        """The recipe's full config with its preset values (torchao's `from_recipe_name`)."""
        return dataclasses.replace(RecipeConfig(), name=self.name, **self.defaults)

    def nvte_env(self, recipe: RecipeConfig) -> dict[str, str]:
        """The `NVTE_*` values this recipe's fields ask for (those that must stay unset: nvte_unset)."""
        return {v.var: value for v in self.nvte_vars if (value := v.value(recipe)) is not None}

    def nvte_unset(self, recipe: RecipeConfig) -> tuple[str, ...]:
        """The `NVTE_*` variables this recipe's fields ask TE not to see (a null text field)."""
        return tuple(v.var for v in self.nvte_vars if v.value(recipe) is None)

    def nvte_changed(self, recipe: RecipeConfig) -> dict[str, str]:
        """The `NVTE_*` values that differ from what TE assumes unset (what a launcher must export)."""
        return {v.var: value for v in self.nvte_vars if (value := v.value(recipe)) != v.te_default and value}


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
        nvte_vars=(_BACKWARD_VAR,),  # TE's DelayedScaling reads it too, and asserts it is unset
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
        nvte_vars=(NvteVar("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "power_2_scales"), _BACKWARD_VAR),
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
        nvte_vars=(
            NvteVar("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "power_2_scales", on_when=False),
            _BACKWARD_VAR,
        ),
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
        nvte_vars=(_BACKWARD_VAR,),
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
            NvteVar("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "row_scaled_activation"),
            NvteVar("NVTE_NVFP4_4OVER6", "nvfp4_4over6", text=True, te_default="none"),
            NvteVar(
                "NVTE_NVFP4_4OVER6_E4M3_USE_256", "nvfp4_4over6_e4m3_use_256", text=True, te_default="all"
            ),
            NvteVar(
                "NVTE_NVFP4_4OVER6_ERR_MODE", "nvfp4_4over6_err_mode", text=True, upper=True, te_default="MAE"
            ),
            _BACKWARD_VAR,
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
            "(routed MoE experts only there; lowp's recipe.int4_scope={int4_scope})"
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
        nvte_vars=(_BACKWARD_VAR,),
        needs_factory=True,
        megatron=MegatronFlags(fp8_recipe="custom", fp4_recipe="custom", quantizer_factory=True),
        defaults={"fp8": "e4m3", "quantizer_factory": None},
    ),
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


# --- recipe fields that name an arm: what the report, W&B and sweeps call a run whose fields differ -----
# from its family's preset (analysis splits arms by these labels; style.md: families are names,
# switches are fields). A field not listed here is shown as `name=value`.
FIELD_LABELS: dict[str, dict[Any, str]] = {
    "fp8_dpa": {True: "FP8 attention"},
    "fp8_mha": {True: "FP8 attention I/O"},
    "fp8_fast_accumulation": {"all": "fast accumulation"},
    "disable_rht": {True: "no RHT", False: "RHT"},
    "disable_stochastic_rounding": {True: "no stochastic rounding", False: "stochastic rounding"},
    "disable_2d_quantization": {True: "1D weight blocks", False: "2D weight blocks"},
    "power_2_scales": {True: "power-of-2 scales", False: "fp32 scales"},
    "backward_override": {"high_precision": "high-precision backward", "dequantized": "dequantized backward"},
    "row_scaled_activation": {True: "row-scaled activations"},
    "nvfp4_4over6": {"weights": "4over6 weights", "activations": "4over6 activations", "all": "4over6"},
    "enable_2d_quantization": {True: "2D weight tiles"},
}
_UNLABELLED = ("name",)  # a custom recipe is told apart by its quantizer_factory


_CURRENT, _BLOCK, _NVFP4 = "Float8CurrentScaling", "Float8BlockScaling", "NVFP4BlockScaling"
FIELD_SCOPE: dict[str, Any] = {
    "fp8": lambda s: s.fp8_family or s.needs_factory,
    "fp4": lambda s: s.fp4_family or s.needs_factory,
    "fp8_amax_history_len": lambda s: s.delayed_scaling,
    "fp8_amax_compute_algo": lambda s: s.delayed_scaling,
    "power_2_scales": lambda s: s.te_recipe_class in (_CURRENT, _BLOCK),
    "amax_epsilon": lambda s: s.te_recipe_class in (_CURRENT, _BLOCK),
    "x_block_dim": lambda s: s.te_recipe_class == _BLOCK,
    "w_block_dim": lambda s: s.te_recipe_class == _BLOCK,
    "grad_block_dim": lambda s: s.te_recipe_class == _BLOCK,
    "disable_rht": lambda s: s.fp4_family,
    "disable_stochastic_rounding": lambda s: s.fp4_family,
    "disable_2d_quantization": lambda s: s.fp4_family,
    "int4_group_size": lambda s: s.hook == "int4_fake_quant",
    "int4_scope": lambda s: s.hook == "int4_fake_quant",
    "fp8_dpa": lambda s: s.fp8_family,
    "fp8_mha": lambda s: s.fp8_family,
    "fp8_fast_accumulation": lambda s: s.te_recipe_class == _CURRENT,
    # TE 2.20's fields (common/recipe/__init__.py): which recipe classes take them
    "backward_override": lambda s: s.te_recipe_class not in (None, "DelayedScaling"),
    "row_scaled_activation": lambda s: s.te_recipe_class == _NVFP4,
    "nvfp4_4over6": lambda s: s.te_recipe_class == _NVFP4,
    "nvfp4_4over6_e4m3_use_256": lambda s: s.te_recipe_class == _NVFP4,
    "nvfp4_4over6_err_mode": lambda s: s.te_recipe_class == _NVFP4,
    "enable_2d_quantization": lambda s: s.te_recipe_class == "MXFP8BlockScaling",
}
"""Which families read a field (a field not listed: every family). A field another family reads does
not name a run: a sweep that sets `recipe.int4_group_size` for every arm leaves nvfp4's label alone.
Validation refuses TE 2.20's fields (TE20_FIELDS) set away from their default on a family without them."""
TE20_FIELDS = (
    "backward_override",
    "row_scaled_activation",
    "nvfp4_4over6",
    "nvfp4_4over6_e4m3_use_256",
    "nvfp4_4over6_err_mode",
    "enable_2d_quantization",
)


def te20_set(recipe: RecipeConfig) -> dict[str, Any]:
    """The TE 2.20 fields (TE20_FIELDS) set away from their RecipeConfig default, in that order."""
    default = RecipeConfig()
    return {n: v for n in TE20_FIELDS if (v := getattr(recipe, n)) != getattr(default, n)}


def changed_fields(recipe: RecipeConfig) -> dict[str, Any]:
    """The fields of `recipe` that its family reads and that differ from its preset, in the schema's
    order."""
    spec, preset = get(recipe.name), default_fields(recipe.name)
    return {
        f.name: getattr(recipe, f.name)
        for f in dataclasses.fields(RecipeConfig)
        if f.name not in _UNLABELLED
        and FIELD_SCOPE.get(f.name, lambda _: True)(spec)
        and getattr(recipe, f.name) != getattr(preset, f.name)
    }


def field_label(name: str, value: Any) -> str:
    """One field's readable label: FIELD_LABELS's words, else `name=value`."""
    words = FIELD_LABELS.get(name, {})
    if value in words and not isinstance(value, float):
        return words[value]
    shown = str(value).lower() if isinstance(value, bool) else value
    return f"{name}={shown}"


def label(recipe: RecipeConfig) -> str:
    """The family, then ` + ` and each changed field's label: `tensorwise + fast accumulation`."""
    return " + ".join([recipe.name, *(field_label(k, v) for k, v in changed_fields(recipe).items())])


# --- names that were recipes before recipes became numerics families ----------------------------------


@dataclass(frozen=True)
class Legacy:
    """A recipe name lowp no longer has: the family and fields it meant, and what to use instead."""

    name: str
    family: str
    fields: dict[str, Any]
    """Its fields that are still recipe fields (the family's preset otherwise)."""
    removed: dict[str, Any] = field(default_factory=dict)
    """Its settings of options that left lowp (config keys no longer in the schema)."""
    label: str = ""
    """How analysis and the report name its runs: the family plus a label per field."""
    why: str = ""
    """Why the removed part went (a RESULTS.md section); empty when nothing was removed."""

    @property
    def replacement(self) -> str:
        """The overrides that run what is left of it today."""
        return " ".join([f"recipe={self.family}", *(f"recipe.{k}={_cli(v)}" for k, v in self.fields.items())])


def _cli(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_ATTN = "FP8 attention (delayed-scaling attention)"
_HEAD_WHY = "its FP8 LM head failed the loss check (benchmarks/RESULTS.md, 'Loss checks of the TE options')"
_DPA_WHY = (
    "its attention in delayed scaling went through TE's private globals and failed the loss check "
    "(benchmarks/RESULTS.md, 'Loss checks of the TE options'); TE's current-scaling FP8 attention needs "
    "compute capability >= 10.0"
)
_FAST = {"fp8_fast_accumulation": "all"}
_DPA = {"fp8_dpa": True}
_HEAD = {"fp8_lm_head": True}
_HEADBWD = {"fp8_lm_head": True, "fp8_lm_head_fprop": False}
_VIA_DELAYED = {"fp8_dpa_recipe": "delayed"}
LEGACY: dict[str, Legacy] = {
    x.name: x
    for x in (
        Legacy("delayed_fp8attn", "delayed", _DPA, label="delayed + FP8 attention"),
        Legacy("tensorwise_fastacc", "tensorwise", _FAST, label="tensorwise + fast accumulation"),
        Legacy("tensorwise_fp8attn", "tensorwise", _DPA, _VIA_DELAYED, f"tensorwise + {_ATTN}", _DPA_WHY),
        Legacy(
            "tensorwise_fp8attn_fastacc",
            "tensorwise",
            {**_DPA, **_FAST},
            _VIA_DELAYED,
            f"tensorwise + {_ATTN} + fast accumulation",
            _DPA_WHY,
        ),
        Legacy("tensorwise_fp8head", "tensorwise", {}, _HEAD, "tensorwise + FP8 LM head", _HEAD_WHY),
        Legacy(
            "tensorwise_fp8attn_fp8head",
            "tensorwise",
            _DPA,
            {**_HEAD, **_VIA_DELAYED},
            f"tensorwise + {_ATTN} + FP8 LM head",
            f"{_HEAD_WHY}; {_DPA_WHY}",
        ),
        Legacy(
            "tensorwise_fp8head_fastacc",
            "tensorwise",
            _FAST,
            _HEAD,
            "tensorwise + FP8 LM head + fast accumulation",
            _HEAD_WHY,
        ),
        Legacy(
            "tensorwise_fp8headbwd",
            "tensorwise",
            {},
            _HEADBWD,
            "tensorwise + FP8 LM head backward",
            _HEAD_WHY,
        ),
        Legacy(
            "tensorwise_fp8headbwd_fastacc",
            "tensorwise",
            _FAST,
            _HEADBWD,
            "tensorwise + FP8 LM head backward + fast accumulation",
            _HEAD_WHY,
        ),
    )
}


def legacy_message(name: str, where: str = "recipe") -> str:
    """The one line that refuses a removed recipe name and names what to use instead."""
    old = LEGACY[name]
    lead = f"{where}={name} is no longer a recipe: recipes are numerics families and TE switches are fields"
    if not old.removed:
        return f"{lead}; use {old.replacement}"
    gone = ", ".join(f"recipe.{k}" for k in old.removed)
    return f"{lead}; {gone} left lowp ({old.why}); the nearest run is {old.replacement}"


def legacy_in(overrides: list[str]) -> str | None:
    """The refusal line for the first override that names a removed recipe (`recipe=`, `recipe.name=`,
    a comma-separated sweep of them, a stability override's `recipe:`), else None."""
    for ov in overrides:
        key, sep, value = ov.lstrip("+~").partition("=")
        if not sep:
            continue
        if key in ("recipe", "recipe.name"):
            names = [v.strip() for v in value.split(",")]
        elif key == "stability.overrides":
            names = [v.strip(" '\"}]") for v in value.replace("recipe:", "\0").split("\0")[1:]]
            names = [n.split(",")[0].strip(" '\"}]") for n in names]
        else:
            continue
        for name in names:
            if name in LEGACY:
                return legacy_message(name)
    return None


# --- how far each TE 2.20 option is verified (run.json `verification`, docs/numerics.md) ----------------

KERNEL_UNVERIFIED = "reference-exact, kernel-unverified (needs Blackwell)"
H200_VERIFIED = "kernel-verified on H200 (TE 2.20.2)"
"""tests/numerics/test_backward_override.py against `python -m benchmarks.te_backward_override`'s
capture (tests/assets/te_backward_override/)."""
VERIFICATION: dict[tuple[str, str | None], str] = {
    ("backward_override", "Float8CurrentScaling"): H200_VERIFIED,
    ("backward_override", "Float8BlockScaling"): H200_VERIFIED,
}
"""(field, TE recipe class) -> status where a kernel check exists; every other
TE 2.20 option in use is KERNEL_UNVERIFIED (Hopper runs no MXFP8/NVFP4 kernel)."""
HYBRID_FACTORIES = "harness.numerics.hybrid"
"""The module of lowp's hybrid forward/backward factories (recipe=custom, named by a short name with no
`module:` part, or by their path): reference-exact only."""


def verification(recipe: RecipeConfig, stability: StabilityConfig | None = None) -> dict[str, str]:
    """`recipe.<field>=<value>` -> verification status of each TE 2.20 option the run (and each
    stability override's recipe, keyed `pattern: ...`) uses; {} when it uses none."""
    out = _verification(recipe)
    for ov in stability.overrides if stability is not None else ():
        if ov.resolved is not None:
            out.update({f"{ov.pattern}: {k}": v for k, v in _verification(ov.resolved).items()})
    return out


def _verification(recipe: RecipeConfig) -> dict[str, str]:
    spec, out = get(recipe.name), {}
    for name, value in te20_set(recipe).items():
        if not FIELD_SCOPE[name](spec):
            continue
        if name.startswith("nvfp4_4over6_") and recipe.nvfp4_4over6 == "none":
            continue  # read only with 4over6 on
        out[f"recipe.{name}={value}"] = VERIFICATION.get((name, spec.te_recipe_class), KERNEL_UNVERIFIED)
    factory = recipe.quantizer_factory or ""
    if spec.needs_factory and factory and (":" not in factory or factory.startswith(HYBRID_FACTORIES)):
        out[f"recipe.quantizer_factory={factory}"] = KERNEL_UNVERIFIED
    return out
