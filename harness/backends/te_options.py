"""The rules of the TE backend's options, from TE 2.20.2's own checks (config validation).

- FP8 attention (`recipe.fp8_dpa`, `recipe.fp8_mha`): TE's Float8BlockScaling asserts "FP8 attention
  is not supported for Float8BlockScaling", and its backend selection
  (attention/dot_product_attention/utils.py, get_attention_backend) disables fused FP8 attention for
  NVFP4, for current scaling below compute capability 10.0 and for MXFP8 below 10.0: on Hopper only
  delayed scaling has an FP8 attention kernel. The emulated backend quantizes GEMM operands only.
- FP8 fast accumulation in the backward GEMMs (`recipe.fp8_fast_accumulation=all`):
  Float8CurrentScaling's fp8_gemm_dgrad/fp8_gemm_wgrad MMParams (the other TE recipe classes take no
  per-GEMM setting: DelayedScaling has none, Float8BlockScaling asserts the split accumulator); the
  emulated backend accumulates exactly in fp32, so it cannot run it.
- `model.cross_entropy_loss_fusion`: TE's Triton kernel, CUDA only; one LM-head path at a time.
- `backend.packed_qkv_grad`: changes only how TE's packed QKV reaches attention, which TE 2.20 does
  with learned positions, no QK norm and num_query_groups == num_attention_heads.
"""

from __future__ import annotations

from harness import recipes
from harness.config.schema import BackendConfig, HardwareConfig, ModelConfig, RecipeConfig

FP8_ATTENTION_MIN_CC = {"DelayedScaling": 9.0, "Float8CurrentScaling": 10.0, "MXFP8BlockScaling": 10.0}
"""TE recipe class -> lowest compute capability TE 2.20.2 has a fused FP8 attention kernel for it on
(none for Float8BlockScaling, NVFP4 or a custom recipe)."""
LOSS_CHECKS = "benchmarks/RESULTS.md, 'Loss checks of the TE options (8B slice, 300 steps)'"


def option_errors(r: RecipeConfig, m: ModelConfig, hw: HardwareConfig, te: bool) -> list[str]:
    """One line per option the recipe, model and hardware forbid; `te`: the run uses backend=te."""
    return _attention_errors(r, hw, te) + _fast_accumulation_errors(r, te) + _loss_fusion_errors(m, te)


def _attention_errors(r: RecipeConfig, hw: HardwareConfig, te: bool) -> list[str]:
    if r.fp8_mha and not r.fp8_dpa:
        return ["recipe.fp8_mha=true needs recipe.fp8_dpa=true (TE's FP8 MHA is FP8 attention plus FP8 I/O)"]
    if not r.fp8_dpa:
        return []
    cls = recipes.get(r.name).te_recipe_class
    if cls not in FP8_ATTENTION_MIN_CC:
        return [
            f"recipe.fp8_dpa=true with recipe={r.name}: TE 2.20 has no FP8 attention for "
            f"{cls or 'BF16 GEMMs'}; use recipe=delayed (or tensorwise/mxfp8 on compute capability >= 10.0)"
        ]
    if not te:
        return [
            f"recipe.fp8_dpa=true with recipe={r.name} and a backend other than te: the emulated backend "
            "quantizes GEMM operands only, not attention; use backend=te or recipe.fp8_dpa=false"
        ]
    cc, need = hw.compute_capability, FP8_ATTENTION_MIN_CC[cls]
    if cc is not None and cc < need:
        return [
            f"recipe.fp8_dpa=true with recipe={r.name} on hardware={hw.name} (compute capability {cc}): "
            f"TE 2.20 runs {cls} FP8 attention from compute capability {need}; use recipe=delayed "
            "recipe.fp8_dpa=true on this GPU"
        ]
    return []


def _fast_accumulation_errors(r: RecipeConfig, te: bool) -> list[str]:
    """recipe.fp8_fast_accumulation: Float8CurrentScaling's MMParams, TE only."""
    if r.fp8_fast_accumulation == "fprop":
        return []
    spec, opt = recipes.get(r.name), f"recipe.fp8_fast_accumulation={r.fp8_fast_accumulation}"
    if spec.te_recipe_class != "Float8CurrentScaling":
        return [
            f"{opt} with recipe={r.name}: only TE's Float8CurrentScaling sets the accumulation per GEMM "
            f"and {r.name} builds {spec.te_recipe_class or 'no TE recipe (BF16 GEMMs)'}; use "
            "recipe=tensorwise or recipe.fp8_fast_accumulation=fprop"
        ]
    if not te:
        return [
            f"{opt} with a backend other than te: the emulated backend accumulates every GEMM exactly in "
            "fp32 and cannot reproduce cuBLAS's FP8 fast accumulation; use backend=te"
        ]
    return []


def _loss_fusion_errors(m: ModelConfig, te: bool) -> list[str]:
    errs = []
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


def option_warnings(r: RecipeConfig, m: ModelConfig, b: BackendConfig, te: bool) -> list[str]:
    """Options that are set but do nothing for this run, and options without a passed loss check."""
    out = []
    if r.fp8_dpa and te:
        out.append(
            "recipe.fp8_dpa=true: TE's FP8 attention has not passed lowp's loss check "
            f"({LOSS_CHECKS}); compare it with a BF16 baseline of your own before relying on it"
        )
    if b.packed_qkv_grad and not te:
        out.append("backend.packed_qkv_grad=true has no effect on a backend other than te")
    elif b.packed_qkv_grad and not packed_qkv_path(m):
        out.append(
            "backend.packed_qkv_grad=true has no effect with RoPE, QK norm or grouped-query attention: "
            "TE splits q, k, v itself there (without copies in backward)"
        )
    return out


def packed_qkv_path(m: ModelConfig) -> bool:
    """TE 2.20's MultiheadAttention hands attention the packed QKV (packed_dpa_eligible, np == ng)."""
    groups = m.num_query_groups or m.num_attention_heads
    return m.position_embedding != "rope" and not m.qk_layernorm and groups == m.num_attention_heads
