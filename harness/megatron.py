"""Print the Megatron-LM flags equivalent to a composed lowp config.

    python -m harness.megatron experiment=hopper_fp8 [more overrides]

Field names are Megatron's, so the mapping is rename-free. Recipe flags are printed as the guide
writes them; model shape always; other values only where lowp's differ from Megatron's argparse
defaults (delayed scaling's history flags always, since the guide's 1024/max are not Megatron's
1/most_recent). What Megatron cannot express (module overrides, INT4 QAT, NVTE_* variables) is
printed as `#` comment lines, never silently dropped.
"""

from __future__ import annotations

import sys

from harness.config.schema import Config
from harness.megatron_arch import architecture_flags

# Megatron-LM argparse defaults for the values lowp prints only when they differ.
MEGATRON_DEFAULTS = {
    "--lr": None,
    "--min-lr": 0.0,
    "--weight-decay": 0.01,
    "--adam-beta1": 0.9,
    "--adam-beta2": 0.999,
    "--adam-eps": 1e-8,
    "--clip-grad": 1.0,
    "--lr-warmup-iters": 0,
    "--lr-decay-style": "linear",
    "--seed": 1234,
    "--fp8-margin": 0,
    "--num-layers-at-start-in-bf16": 1,
    "--num-layers-at-end-in-bf16": 1,
    "--main-grads-dtype": "fp32",
    "--main-params-dtype": "fp32",
    "--exp-avg-dtype": "fp32",
    "--exp-avg-sq-dtype": "fp32",
}

SHAPE_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--ffn-hidden-size",
    "--seq-length",
    "--max-position-embeddings",
    "--vocab-size",
    "--normalization",
    "--swiglu",
    "--position-embedding-type",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def model_flags(cfg: Config) -> list[tuple[str, object]]:
    m = cfg.model
    flags: list[tuple[str, object]] = [
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--ffn-hidden-size", m.ffn_hidden_size),
        ("--seq-length", m.seq_length),
        ("--max-position-embeddings", m.seq_length),
        ("--vocab-size", m.vocab_size),
        ("--untie-embeddings-and-output-weights", None),
    ]
    if m.normalization != "LayerNorm":
        flags.append(("--normalization", m.normalization))
    if m.activation == "swiglu":
        flags.append(("--swiglu", None))
    if m.position_embedding == "rope":
        flags.append(("--position-embedding-type", "rope"))
    if not m.add_bias_linear:
        flags.append(("--disable-bias-linear", None))
    return architecture_flags(m, flags)


def recipe_flags(cfg: Config) -> tuple[list[tuple[str, object]], list[str]]:
    """(flags, comment lines) for precision, stability and the optimizer's memory knobs."""
    r, s, o = cfg.recipe, cfg.stability, cfg.optimizer
    flags: list[tuple[str, object]] = [("--bf16", None)]
    notes: list[str] = []
    if r.fp8:
        flags += [("--fp8-format", r.fp8), ("--fp8-recipe", r.name)]
        if r.name == "delayed":
            flags += [
                ("--fp8-amax-history-len", r.fp8_amax_history_len),
                ("--fp8-amax-compute-algo", r.fp8_amax_compute_algo),
            ]
        if r.name == "custom":
            flags.append(("--fp8-quantizer-factory", r.quantizer_factory))
    if r.fp4:
        flags.append(("--fp4-format", r.fp4))
        if r.name == "custom":
            flags += [("--fp4-recipe", "custom"), ("--fp4-quantizer-factory", r.quantizer_factory)]
    if r.name == "int4_qat":
        notes.append(
            "# INT4 fake-QAT has no upstream Megatron flag; miles enables it with "
            f"OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 OPEN_TRAINING_INT4_GROUP_SIZE={r.int4_group_size} "
            "(routed MoE experts only there; lowp applies it to every block linear)"
        )
    if r.name == "tensorwise" and r.power_2_scales:
        notes.append("# requires env NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1 (no Megatron flag)")
    if r.name == "blockwise" and not r.power_2_scales:
        notes.append("# requires env NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 (no Megatron flag)")
    for field, var in (
        ("disable_rht", "RHT"),
        ("disable_stochastic_rounding", "STOCHASTIC_ROUNDING"),
        ("disable_2d_quantization", "2D_QUANTIZATION"),
    ):
        if r.name == "nvfp4" and getattr(r, field):
            notes.append(f"# requires env NVTE_NVFP4_DISABLE_{var}=1 (no Megatron flag)")

    if s.fp8_margin != MEGATRON_DEFAULTS["--fp8-margin"]:
        flags.append(("--fp8-margin", s.fp8_margin))
    if not s.fp8_wgrad:
        flags.append(("--no-fp8-wgrad", None))
        notes.append(
            "# warning: TE 2.x silently ignores --no-fp8-wgrad (DelayedScaling drops "
            "override_linear_precision); the wgrad GEMM stays FP8 unless NVTE_BACKWARD_OVERRIDE="
            "high_precision (not allowed with delayed scaling)"
        )
    if s.first_last_layers_bf16:
        flags.append(("--first-last-layers-bf16", None))
        for flag, v in (
            ("--num-layers-at-start-in-bf16", s.num_layers_at_start_in_bf16),
            ("--num-layers-at-end-in-bf16", s.num_layers_at_end_in_bf16),
        ):
            if v != MEGATRON_DEFAULTS[flag]:
                flags.append((flag, v))
    if s.overrides:
        pats = ", ".join(f"{ov.pattern}->{ov.recipe}" for ov in s.overrides)
        notes.append(f"# per-module overrides ({pats}) need --te-precision-config-file in Megatron")

    if o.fp8_param:
        flags.append(("--fp4-param-gather" if r.fp4 else "--fp8-param-gather", None))
    if o.reuse_grad_buf_for_mxfp8_param_ag:
        flags.append(("--reuse-grad-buf-for-mxfp8-param-ag", None))
    if o.use_distributed_optimizer:
        flags.append(("--use-distributed-optimizer", None))
    if o.optimizer_cpu_offload:
        flags.append(("--optimizer-cpu-offload", None))
    if o.use_precision_aware_optimizer:
        flags.append(("--use-precision-aware-optimizer", None))
        for flag, v in (
            ("--main-grads-dtype", o.main_grads_dtype),
            ("--main-params-dtype", o.main_params_dtype),
            ("--exp-avg-dtype", o.exp_avg_dtype),
            ("--exp-avg-sq-dtype", o.exp_avg_sq_dtype),
        ):
            if v != MEGATRON_DEFAULTS[flag]:
                flags.append((flag, v))
    if o.activation_func_fp8_input_store:
        flags.append(("--activation-func-fp8-input-store", None))
    return flags, notes


def training_flags(cfg: Config) -> list[tuple[str, object]]:
    """Optimizer, schedule and batch values, where they differ from Megatron's defaults."""
    o = cfg.optimizer
    values = {
        "--lr": o.lr,
        "--min-lr": o.min_lr,
        "--weight-decay": o.weight_decay,
        "--adam-beta1": o.betas[0],
        "--adam-beta2": o.betas[1],
        "--adam-eps": o.eps,
        "--clip-grad": o.clip_grad,
        "--lr-warmup-iters": o.warmup_steps,
        "--lr-decay-style": "cosine",
        "--seed": cfg.seed,
    }
    flags = [(k, v) for k, v in values.items() if v != MEGATRON_DEFAULTS[k]]
    flags += [
        ("--micro-batch-size", cfg.micro_batch_size),
        ("--global-batch-size", cfg.global_batch_size),
        ("--train-iters", cfg.steps),
    ]
    return flags


def megatron_args(cfg: Config) -> tuple[list[str], list[str]]:
    """(argv tokens, comment lines) for Megatron-LM's pretrain_gpt.py."""
    rflags, notes = recipe_flags(cfg)
    if cfg.model.lm_head_loss_chunks:
        notes.append(
            f"# model.lm_head_loss_chunks={cfg.model.lm_head_loss_chunks} has no Megatron flag: Megatron "
            "makes the whole logits (--cross-entropy-loss-fusion fuses the loss kernel only)"
        )
    argv: list[str] = []
    for flag, value in model_flags(cfg) + rflags + training_flags(cfg):
        argv.append(flag)
        if value is not None:
            argv.append(_fmt(value))
    return argv, notes


def render(cfg: Config) -> str:
    argv, notes = megatron_args(cfg)
    lines, i = [], 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"{argv[i]} {argv[i + 1]}")
            i += 2
        else:
            lines.append(argv[i])
            i += 1
    body = " \\\n  ".join(lines)
    return "\n".join([*notes, f"pretrain_gpt.py \\\n  {body}"])


def main(argv: list[str] | None = None) -> int:
    from omegaconf import OmegaConf

    from harness.config.store import compose
    from harness.config.validate import ConfigError, validate
    from harness.hardware import resolve_hardware

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    cfg: Config = OmegaConf.to_object(compose(argv))
    cfg.hardware = resolve_hardware(cfg.hardware)
    try:
        validate(cfg, for_export=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
