"""The rules of the TE backend's speed options, from TE 2.20.2's own checks (config validation).

- FP8 attention (`recipe.fp8_dpa`, `recipe.fp8_mha`, `recipe.fp8_dpa_recipe`): TE's
  Float8BlockScaling asserts "FP8 attention is not supported for Float8BlockScaling", and its
  backend selection (attention/dot_product_attention/utils.py, get_attention_backend) disables
  fused FP8 attention for block scaling and NVFP4, for current scaling below compute capability
  10.0 and for MXFP8 below 10.0, and FlashAttention 3 for FP8 training: on Hopper only delayed
  scaling has an FP8 attention kernel, so tensorwise runs its attention in delayed scaling
  (NVTE_DPA_FP8_RECIPE=DelayedScaling). The emulated backend quantizes GEMM operands only.
- FP8 LM head (`recipe.fp8_lm_head`, the *_fp8head recipes): the head as a te.Linear under the
  recipe; TE's FP8 GEMM needs dims divisible by 16 (utils.assert_dim_for_fp8_exec); untied, whole.
  With `recipe.fp8_lm_head_fprop=false` (the *_fp8headbwd recipes) only its dgrad and wgrad run in
  FP8, on current-scaling operands (te_lm_head.py), under the same rules.
- FP8 fast accumulation in the backward GEMMs (`recipe.fp8_fast_accumulation=all`, the *_fastacc
  recipes): Float8CurrentScaling's fp8_gemm_dgrad/fp8_gemm_wgrad MMParams (the other TE recipe
  classes take no per-GEMM setting: DelayedScaling has none, Float8BlockScaling asserts the split
  accumulator); the emulated backend accumulates exactly in fp32, so it cannot run it.
- `model.cross_entropy_loss_fusion`: TE's Triton kernel, CUDA only; one LM-head path at a time.
- `backend.packed_qkv_grad`: changes only how TE's packed QKV reaches attention, which TE 2.20 does
  with learned positions, no QK norm and num_query_groups == num_attention_heads.
"""

from __future__ import annotations

from harness import recipes
from harness.backends.te_attention import DPA_RECIPES
from harness.config.schema import BackendConfig, HardwareConfig, ModelConfig, RecipeConfig

FP8_ATTENTION_CLASSES = ("DelayedScaling", "Float8CurrentScaling")
"""TE recipe classes whose FP8 attention lowp runs (MXFP8's needs cuDNN >= 9.21 and sm100 and is
untested here; TE refuses block scaling and has none for NVFP4)."""


def option_errors(
    r: RecipeConfig,
    m: ModelConfig,
    hw: HardwareConfig,
    te: bool,
    b: BackendConfig | None = None,
    accumulation: int = 1,
    per_block_recipes: bool = False,
) -> list[str]:
    """One line per option the recipe, model and hardware forbid; `te`: the run uses backend=te;
    `accumulation`: micro-batches a step; `per_block_recipes`: stability gives blocks own recipes."""
    spec, errs = recipes.get(r.name), []
    errs += _graph_errors(b or BackendConfig(), m, te, accumulation, per_block_recipes)
    if r.fp8_dpa_recipe is not None and r.fp8_dpa_recipe not in DPA_RECIPES:
        errs.append(f"recipe.fp8_dpa_recipe={r.fp8_dpa_recipe}: use null (the linears' recipe) or delayed")
    if r.fp8_mha and not r.fp8_dpa:
        errs.append(
            "recipe.fp8_mha=true needs recipe.fp8_dpa=true (TE's FP8 MHA is FP8 attention plus FP8 I/O)"
        )
    if r.fp8_dpa and not te:
        errs.append(
            f"recipe={r.name} with recipe.fp8_dpa={r.fp8_dpa} and a backend other than te: the emulated "
            "backend quantizes GEMM operands only, not attention; use backend=te or recipe.fp8_dpa=false"
        )
    elif spec.te_only and not te and not (r.fp8_lm_head or r.fp8_fast_accumulation != "fprop"):
        # the TE-only options that are on say why in their own rules below
        errs.append(f"recipe={r.name} with a backend other than te: a TE-only recipe; use backend=te")
    if r.fp8_dpa and spec.te_recipe_class not in FP8_ATTENTION_CLASSES:
        errs.append(
            f"recipe.fp8_dpa=true with recipe={r.name}: TE 2.20 has FP8 attention for delayed and "
            "current scaling only (it asserts against Float8BlockScaling); use recipe=delayed_fp8attn "
            "or recipe=tensorwise_fp8attn"
        )
    cc = hw.compute_capability
    if (
        te
        and r.fp8_dpa
        and spec.te_recipe_class == "Float8CurrentScaling"
        and r.fp8_dpa_recipe is None
        and cc is not None
        and cc < 10.0
    ):
        errs.append(
            f"recipe.fp8_dpa=true with recipe={r.name} on hardware={hw.name} (compute capability {cc}): "
            "TE 2.20 disables fused current-scaling FP8 attention below compute capability 10.0 and has "
            "no other backend for it; set recipe.fp8_dpa_recipe=delayed (recipe=tensorwise_fp8attn)"
        )
    errs += _lm_head_errors(r, m, te)
    errs += _fast_accumulation_errors(r, te)
    if m.cross_entropy_loss_fusion and not te:
        errs.append(
            "model.cross_entropy_loss_fusion=true with a backend other than te: it is TE's Triton "
            "kernel; use backend=te, or model.lm_head_loss_chunks for a fused loss on any backend"
        )
    if m.cross_entropy_loss_fusion and m.lm_head_loss_chunks > 0:
        errs.append(
            f"model.cross_entropy_loss_fusion=true with model.lm_head_loss_chunks={m.lm_head_loss_chunks}: "
            "the chunked LM head already fuses its loss; choose one (set the other to false / 0)"
        )
    return errs


FP8_HEAD_RECIPES = tuple(
    n
    for n in recipes.names()
    if recipes.get(n).defaults.get("fp8_lm_head") and recipes.get(n).defaults.get("fp8_lm_head_fprop", True)
)
FP8_HEAD_BACKWARD_RECIPES = tuple(
    n for n in recipes.names() if recipes.get(n).defaults.get("fp8_lm_head_fprop", True) is False
)


def _own_recipe(r: RecipeConfig, opt: str, what: str, suffix: str, having: tuple[str, ...]) -> list[str]:
    """A numerics-changing option set on a recipe that does not define it: name its own recipe."""
    variant = f"{r.name}{suffix}"
    if variant in having:
        return [
            f"{opt} with recipe={r.name}: {what} changes numerics, so it is a recipe of its own; "
            f"use recipe={variant}"
        ]
    return [f"{opt} with recipe={r.name}: only {list(having)} have it"]


def _lm_head_errors(r: RecipeConfig, m: ModelConfig, te: bool) -> list[str]:
    """recipe.fp8_lm_head: a te.Linear under the recipe (TE's FP8 GEMM: assert_dim_for_fp8_exec), or
    with recipe.fp8_lm_head_fprop=false a BF16 head with FP8 backward GEMMs (its gradient format)."""
    spec = recipes.get(r.name)
    if not r.fp8_lm_head_fprop and not (r.fp8_lm_head and spec.defaults.get("fp8_lm_head")):
        if spec.defaults.get("fp8_lm_head_fprop", True) is False:
            return [
                f"recipe.fp8_lm_head=false with recipe={r.name}: the recipe is its FP8 LM head; use "
                f"recipe={r.name.replace('_fp8headbwd', '')} for a BF16 head"
            ]
        what, variant = "an LM head with FP8 backward GEMMs", "_fp8headbwd"
        return _own_recipe(r, "recipe.fp8_lm_head_fprop=false", what, variant, FP8_HEAD_BACKWARD_RECIPES)
    if r.fp8_lm_head_grad_format is not None and (not r.fp8_lm_head or r.fp8_lm_head_fprop):
        return [
            f"recipe.fp8_lm_head_grad_format={r.fp8_lm_head_grad_format} with recipe={r.name}: only the "
            f"FP8-backward head takes it; use one of {list(FP8_HEAD_BACKWARD_RECIPES)}"
        ]
    if r.fp8_lm_head_grad_format == "e5m2" and r.fp8 != "hybrid":
        return [
            f"recipe.fp8_lm_head_grad_format=e5m2 with recipe.fp8={r.fp8}: E5M2 gradients need fp8=hybrid"
        ]
    if not r.fp8_lm_head:
        return []
    if not spec.defaults.get("fp8_lm_head"):
        return _own_recipe(r, "recipe.fp8_lm_head=true", "an FP8 LM head", "_fp8head", FP8_HEAD_RECIPES)
    if spec.defaults.get("fp8_lm_head_fprop", True) != r.fp8_lm_head_fprop:
        swap = ("_fp8headbwd", "_fp8head") if r.fp8_lm_head_fprop else ("_fp8head", "_fp8headbwd")
        return [
            f"recipe.fp8_lm_head_fprop={str(r.fp8_lm_head_fprop).lower()} with recipe={r.name}: where the "
            "logits GEMM runs changes numerics, so it is a recipe of its own; use "
            f"recipe={r.name.replace(*swap)}"
        ]
    why = []
    if not te:
        head = "a te.Linear" if r.fp8_lm_head_fprop else "TE's FP8 GEMMs in its backward"
        why.append(f"the LM head becomes {head}: use backend=te")
    if not m.untie_embeddings_and_output_weights:
        why.append(
            "a tied LM head is the embedding matrix, which TE does not quantize: set "
            "model.untie_embeddings_and_output_weights=true"
        )
    if m.lm_head_loss_chunks > 0:
        why.append(
            f"model.lm_head_loss_chunks={m.lm_head_loss_chunks} computes the head outside TE: set it to 0"
        )
    if m.hidden_size % 16 or m.vocab_size % 16:
        why.append(
            f"TE's FP8 GEMM needs hidden_size and vocab_size divisible by 16 (got {m.hidden_size}, "
            f"{m.vocab_size}): pad model.vocab_size"
        )
    return [f"recipe={r.name} (recipe.fp8_lm_head=true): {w}" for w in why]


FAST_ACCUMULATION_RECIPES = tuple(
    n for n in recipes.names() if recipes.get(n).defaults.get("fp8_fast_accumulation", "fprop") != "fprop"
)


def _fast_accumulation_errors(r: RecipeConfig, te: bool) -> list[str]:
    """recipe.fp8_fast_accumulation: Float8CurrentScaling's MMParams, a recipe of its own, TE only."""
    if r.fp8_fast_accumulation == "fprop":
        return []
    spec, opt = recipes.get(r.name), f"recipe.fp8_fast_accumulation={r.fp8_fast_accumulation}"
    if spec.te_recipe_class != "Float8CurrentScaling":
        return [
            f"{opt} with recipe={r.name}: only TE's Float8CurrentScaling sets the accumulation per GEMM "
            f"and {r.name} builds {spec.te_recipe_class or 'no TE recipe (BF16 GEMMs)'}; use one of "
            f"{list(FAST_ACCUMULATION_RECIPES)} or recipe.fp8_fast_accumulation=fprop"
        ]
    if spec.defaults.get("fp8_fast_accumulation") != r.fp8_fast_accumulation:
        what = "fast accumulation in the backward GEMMs"
        return _own_recipe(r, opt, what, "_fastacc", FAST_ACCUMULATION_RECIPES)
    if not te:
        return [
            f"recipe={r.name} ({opt}) with a backend other than te: the emulated backend accumulates "
            "every GEMM exactly in fp32 and cannot reproduce cuBLAS's FP8 fast accumulation; use backend=te"
        ]
    return []


def _graph_errors(
    b: BackendConfig, m: ModelConfig, te: bool, accumulation: int, per_block: bool
) -> list[str]:
    if not b.cuda_graphs:
        return []
    why = []
    if not te:
        why.append("it captures TE's modules: use backend=te")
    if accumulation != 1:
        why.append(
            f"the graphs hold one micro-batch a step ({accumulation} here): set global_batch_size = "
            "micro_batch_size"
        )
    if per_block:
        why.append(
            "the blocks are captured under one recipe: drop stability.first_last_layers_bf16 and "
            "stability.overrides"
        )
    if m.position_embedding == "rope":
        why.append("RoPE's tensor argument is not captured: use learned positions")
    return [f"backend.cuda_graphs=true: {w}" for w in why]


def option_warnings(r: RecipeConfig, m: ModelConfig, b: BackendConfig, te: bool) -> list[str]:
    """Options that are set but do nothing for this run, and options that failed a measured loss check."""
    out = []
    if r.fp8_dpa_recipe is not None and not r.fp8_dpa:
        out.append(f"recipe.fp8_dpa_recipe={r.fp8_dpa_recipe} has no effect without recipe.fp8_dpa=true")
    if r.fp8_dpa and te:
        out.append(
            _failed_loss_check(
                "recipe.fp8_dpa=true", "TE's FP8 attention", "tensorwise_fp8attn +0.21 nats after a spike"
            )
        )
    if r.fp8_lm_head and r.fp8_lm_head_fprop and te:
        out.append(
            _failed_loss_check(
                "recipe.fp8_lm_head=true",
                "the FP8 LM head",
                "eval +0.002 to +0.011 at steps 250-300, at every seed",
            )
        )
    elif r.fp8_lm_head and te:
        out.append(
            _failed_loss_check(
                "recipe.fp8_lm_head_fprop=false",
                "the LM head's FP8 backward (with BF16 logits)",
                "eval +0.002 to +0.010 at steps 250-300 at every seed, E5M2 or E4M3 head gradients",
            )
        )
    if b.packed_qkv_grad and not te:
        out.append("backend.packed_qkv_grad=true has no effect on a backend other than te")
    elif b.packed_qkv_grad and not packed_qkv_path(m):
        out.append(
            "backend.packed_qkv_grad=true has no effect with RoPE, QK norm or grouped-query attention: "
            "TE splits q, k, v itself there (without copies in backward)"
        )
    return out


def _failed_loss_check(opt: str, what: str, figures: str) -> str:
    """The warning of an option that failed lowp's measured loss check (benchmarks/RESULTS.md)."""
    return (
        f"{opt}: {what} left the BF16 loss band in lowp's 300-step check on the 8B slice ({figures}; "
        "benchmarks/RESULTS.md); compare it with a BF16 baseline of your own before relying on it"
    )


def packed_qkv_path(m: ModelConfig) -> bool:
    """TE 2.20's MultiheadAttention hands attention the packed QKV (packed_dpa_eligible, np == ng)."""
    groups = m.num_query_groups or m.num_attention_heads
    return m.position_embedding != "rope" and not m.qk_layernorm and groups == m.num_attention_heads
