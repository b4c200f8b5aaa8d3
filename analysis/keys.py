"""The artifact contract's names (architecture.md, "Artifacts" and "Metric keys"), used by name.

The harness defines the same strings; analysis never imports it, so they are repeated here once and
every other analysis module imports them from this file.
"""

from __future__ import annotations

# Files of a run directory.
RUN_JSON = "run.json"
METRICS_JSONL = "metrics.jsonl"
NUMERICS_JSONL = "numerics.jsonl"
SUMMARY_JSON = "summary.json"
MULTIRUN_YAML = "multirun.yaml"

# Metric keys of metrics.jsonl (section/name); the x-axis everywhere is TOKENS.
STEP = "step"
TOKENS = "tokens"
LOSS_TRAIN = "loss/train"
LOSS_EVAL = "loss/eval"
LR = "optim/lr"
GRAD_NORM = "optim/grad_norm"
STEP_MS = "time/step_ms"
TOKENS_PER_S = "throughput/tokens_per_s"
TOKENS_PER_S_PER_GPU = "throughput/tokens_per_s_per_gpu"
TFLOPS = "throughput/tflops"
MFU = "throughput/mfu"
PEAK_MEM_GIB = "memory/peak_allocated_gib"
MOE_LOAD_BALANCING_LOSS = "moe/load_balancing_loss"
MOE_SEQ_LOAD_BALANCING_LOSS = "moe/seq_load_balancing_loss"
MOE_Z_LOSS = "moe/z_loss"
MOE_TOKENS_PER_EXPERT_MAX_MEAN = "moe/tokens_per_expert_max_mean"
MOE_EXPERTS_WITHOUT_TOKENS = "moe/experts_without_tokens"
MOE_ROUTER_ENTROPY = "moe/router_entropy"
MOE_DROPPED_TOKENS = "moe/dropped_tokens"
SCHEDULE_PHASE = "schedule/phase"
"""A precision schedule's phase index in each logged row (0 = the recipe group; run.json's
`schedule` names each phase's recipe and first step)."""
METRIC_KEYS = (
    LOSS_TRAIN,
    LOSS_EVAL,
    LR,
    GRAD_NORM,
    STEP_MS,
    TOKENS_PER_S,
    TOKENS_PER_S_PER_GPU,
    TFLOPS,
    MFU,
    PEAK_MEM_GIB,
    MOE_LOAD_BALANCING_LOSS,
    MOE_SEQ_LOAD_BALANCING_LOSS,
    MOE_Z_LOSS,
    MOE_TOKENS_PER_EXPERT_MAX_MEAN,
    MOE_EXPERTS_WITHOUT_TOKENS,
    MOE_ROUTER_ENTROPY,
    MOE_DROPPED_TOKENS,
    SCHEDULE_PHASE,
)
NUMERICS_PREFIX = "numerics/"
LOSS_EVAL_AT_T_PREFIX = "loss/eval_at_t/"  # masked diffusion: the eval loss at each mask ratio t
"""Telemetry summaries inside metrics.jsonl: `numerics/<layer>/<tensor>/<stat>`."""

# Columns of numerics.jsonl.
TELEMETRY_LAYER = "layer"
TELEMETRY_TENSOR = "tensor"
TELEMETRY_TENSORS = ("input", "weight", "grad")
TELEMETRY_STATS = ("amax", "scale", "underflow", "saturation", "sqnr_db")
# Counterfactual rows of numerics.jsonl (telemetry.candidates): a candidate's operand rows carry the
# columns above plus the spread of its block scales, its GEMM rows (tensor fprop/dgrad/wgrad) the
# relative error of the GEMM output against the high-precision GEMM.
TELEMETRY_CANDIDATE = "candidate"
TELEMETRY_SCALE_SPREAD = "scale_spread_log2"
TELEMETRY_REL_ERR = "rel_err"
TELEMETRY_GEMMS = ("fprop", "dgrad", "wgrad")

# Fields of summary.json.
SUMMARY_FIELDS = (
    "status",
    "recipe",
    "recipe_label",
    "variant",
    "backend",
    "hardware",
    "model",
    "data",
    "seed",
    "steps",
    "tokens",
    "final_train_loss",
    "final_eval_loss",
    "loss_floor",
    "tokens_per_s",
    "step_time_ms",
    "mfu_bf16_peak",
    "mfu_recipe_peak",
    "peak_mem_gib",
    "memory",
    "wall_time_s",
    "diverged_step",
    "divergence_cause",
    "error",
    "world_size",
    "tokens_per_s_per_gpu",
    "failed_rank",
)
COMPLETED, DIVERGED, FAILED, PREEMPTED = "completed", "diverged", "failed", "preempted"
INCOMPLETE = "incomplete"
"""Not a summary status: analysis's name for a run directory without summary.json."""

BASELINE_RECIPE = "bf16"
"""The baseline's numerics family; the baseline is this family at its preset (recipe_label == recipe)."""
NATIVE_BACKEND = "te"
EMULATED_BACKEND = "emulated"
DEFAULT_VARIANT = "none+adamw_fp32"
"""Stability and optimizer presets of the plain BF16 baseline (conf/config.yaml defaults)."""

# Recipes: summary.recipe is a numerics family; summary.recipe_label is the family, then " + " and a
# readable label for each recipe field that differs from the family's preset (`name=value` where the
# field has no label), e.g. "tensorwise + fast accumulation"; at the preset it equals the family.
LEGACY_RECIPES: dict[str, tuple[str, str]] = {
    "delayed_fp8attn": ("delayed", "delayed + FP8 attention"),
    "tensorwise_fp8attn": ("tensorwise", "tensorwise + FP8 attention (delayed-scaling attention)"),
    "tensorwise_fastacc": ("tensorwise", "tensorwise + fast accumulation"),
    "tensorwise_fp8attn_fastacc": (
        "tensorwise",
        "tensorwise + FP8 attention (delayed-scaling attention) + fast accumulation",
    ),
    "tensorwise_fp8head": ("tensorwise", "tensorwise + FP8 LM head"),
    "tensorwise_fp8attn_fp8head": (
        "tensorwise",
        "tensorwise + FP8 attention (delayed-scaling attention) + FP8 LM head",
    ),
    "tensorwise_fp8head_fastacc": ("tensorwise", "tensorwise + FP8 LM head + fast accumulation"),
    "tensorwise_fp8headbwd": ("tensorwise", "tensorwise + FP8 LM head backward"),
    "tensorwise_fp8headbwd_fastacc": ("tensorwise", "tensorwise + FP8 LM head backward + fast accumulation"),
}
"""Recipe names that runs written before the families hold (summary.recipe, run.json config.recipe.name)
-> (family, recipe label): analysis reads such a run as its family with that label."""
