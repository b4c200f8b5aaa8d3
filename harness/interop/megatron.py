"""Print the Megatron-LM command equivalent to a composed lowp config.

    python -m harness.megatron experiment=hopper_fp8 [more overrides] [--format sh|args]

`--format sh` (the default) prints a runnable `torchrun ... pretrain_gpt.py` line (set MEGATRON_LM to
a Megatron-LM checkout); `--format args` the bare flags, one per line. Both start with `#` lines for
everything lowp knows that Megatron cannot express: nothing is dropped silently. Field names are
Megatron's, so the mapping is rename-free. Recipe flags are printed as the guide writes them, the
model shape and the run control (iterations, batch, eval, seed, data, dropout 0) always, other
values only where lowp's differ from Megatron's argparse defaults. Floats print as `repr`, so they
round-trip exactly. Under `parallel=fsdp2` the flags follow the rules of Megatron's `--use-torch-fsdp2`
(docs/validation_rules.md): what lowp's FSDP2 run keeps and Megatron's cannot is a `#` line. An MoE
model prints Megatron's MoE flags (`--num-experts`, `--moe-*`, `--moe-grouped-gemm`, the alltoall
dispatcher; harness.interop.megatron_arch.moe_flags). The config is validated first, with the
rules Megatron-LM and TE enforce (docs/validation_rules.md); a refused config, or one Megatron cannot
express, exits with code 2.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import string
import textwrap

from harness import recipes
from harness.backends.capability import te_backward_override
from harness.config.errors import ConfigError
from harness.config.schema import Config, RecipeConfig, eval_budget
from harness.interop.megatron_arch import UNTIE, architecture_flags, moe_flags
from harness.interop.megatron_difflm import difflm_command
from harness.model.objective import MASKED_DIFFUSION

Flag = tuple[str, object]  # (flag, value); value None for a store_true flag
Part = tuple[list[Flag], list[str]]  # (flags, `#` comment lines)

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
    "--fp8-margin": 0,
    "--num-layers-at-start-in-bf16": 1,
    "--num-layers-at-end-in-bf16": 1,
    "--main-grads-dtype": "fp32",
    "--main-params-dtype": "fp32",
    "--exp-avg-dtype": "fp32",
    "--exp-avg-sq-dtype": "fp32",
    "--init-method-std": 0.02,
    "--norm-epsilon": 1e-5,
}
MEGATRON_VOCAB_MULTIPLE = 128  # --make-vocab-size-divisible-by's default: Megatron pads the vocab

SHAPE_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--ffn-hidden-size",
    "--seq-length",
    "--max-position-embeddings",
    "--vocab-size",
    "--make-vocab-size-divisible-by",
    "--normalization",
    "--swiglu",
    "--position-embedding-type",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--init-method-std",
    "--norm-epsilon",
    "--attention-dropout",
    "--hidden-dropout",
)
RUN_FLAGS = (
    "--train-iters",
    "--micro-batch-size",
    "--global-batch-size",
    "--eval-interval",
    "--eval-iters",
    "--log-interval",
    "--seed",
    "--mock-data",
    "--data-path",
    "--train-data-path",
    "--valid-data-path",
    "--split",
    "--tokenizer-type",
    "--no-gradient-accumulation-fusion",
    "--deterministic-mode",
)

# RecipeConfig fields a Megatron flag carries whatever the recipe (the others become comments).
_ALWAYS_EXPRESSED = {"name", "fp8", "fp4"}
# FP8 attention: TransformerConfig fields Megatron has no flag for (arguments.py excludes them from
# its argparse), set by the model provider (provider_fields)
_ATTENTION_FIELDS = {"fp8_dpa": "fp8_dot_product_attention", "fp8_mha": "fp8_multi_head_attention"}
# recipe fields with no flag and no TransformerConfig field, each a note of recipe_flags
_LOWP_ONLY_FIELDS = {"fp8_fast_accumulation"}  # Megatron builds Float8CurrentScaling with TE's MMParams
_HISTORY_FIELDS = {"fp8_amax_history_len", "fp8_amax_compute_algo"}


def _fmt(v) -> str:
    """A flag value as Megatron's argparse reads it back; floats as repr (exact round trip)."""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _fsdp2(cfg: Config) -> bool:
    """Exported as --use-torch-fsdp2, whose rules (arguments.py:1031-1061, validate_args) bind the
    model, optimizer and run flags below."""
    return cfg.parallel.strategy == "fsdp2"


def _dotted(factory: str) -> str:
    """lowp's `module:function` as the `pkg.mod.func` path Megatron's factory resolver imports; a
    shipped hybrid factory (harness.numerics.hybrid) as TE's own zoo function, which Megatron hands TE."""
    from harness.numerics.hybrid import te_path

    return te_path(factory) or factory.replace(":", ".")


def model_flags(cfg: Config) -> Part:
    m = cfg.model
    flags: list[Flag] = [
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--ffn-hidden-size", m.ffn_hidden_size),
        ("--seq-length", m.seq_length),
        ("--max-position-embeddings", m.seq_length),
        ("--vocab-size", m.vocab_size),
        # lowp's model has no dropout; Megatron's default is 0.1 for both
        ("--attention-dropout", 0.0),
        ("--hidden-dropout", 0.0),
    ]
    notes = []
    if m.vocab_size % MEGATRON_VOCAB_MULTIPLE:  # else Megatron pads the embedding: another model
        flags.append(("--make-vocab-size-divisible-by", 1))
    if m.normalization != "LayerNorm":
        flags.append(("--normalization", m.normalization))
    if m.activation == "swiglu":
        flags.append(("--swiglu", None))
    if m.position_embedding == "rope":
        flags.append(("--position-embedding-type", "rope"))
    if not m.add_bias_linear:
        flags.append(("--disable-bias-linear", None))
    for flag, v in (("--init-method-std", m.init_method_std), ("--norm-epsilon", m.layernorm_epsilon)):
        if v != MEGATRON_DEFAULTS[flag]:
            flags.append((flag, v))
    if m.cross_entropy_loss_fusion:
        # a TransformerConfig field (arguments.py builds --cross-entropy-loss-fusion from it); the
        # implementation stays Megatron's default `native`: Megatron refuses `te` (validate_args)
        flags.append(("--cross-entropy-loss-fusion", None))
        notes.append(
            "# model.cross_entropy_loss_fusion=true -> --cross-entropy-loss-fusion: Megatron fuses the "
            "loss with its own kernel (--cross-entropy-fusion-impl native); lowp uses TE's Triton "
            "kernel, which Megatron refuses (--cross-entropy-fusion-impl te is asserted off)"
        )
    if m.lm_head_loss_chunks:
        notes.append(
            f"# model.lm_head_loss_chunks={m.lm_head_loss_chunks} has no Megatron flag: Megatron "
            "makes the whole logits (--cross-entropy-loss-fusion fuses the loss kernel only)"
        )
    flags = architecture_flags(m, flags) + moe_flags(m)
    if m.num_moe_experts and m.moe_router_padding_for_quantization:
        notes += _router_padding_notes(cfg)
    if m.num_moe_experts:
        notes += _expert_kernel_notes(cfg)
    if _fsdp2(cfg) and not m.untie_embeddings_and_output_weights:
        flags.append((UNTIE, None))  # arguments.py:1044-1045 asserts it under --use-torch-fsdp2
        notes.append(
            "# model.untie_embeddings_and_output_weights=false under parallel=fsdp2 has no Megatron "
            f"equivalent: --use-torch-fsdp2 requires {UNTIE}, so Megatron's run has an output layer "
            "of its own where lowp's reuses the embedding; parallel=ddp exports the tied head"
        )
    return flags, notes


def _expert_kernel_notes(cfg: Config) -> list[str]:
    """Where lowp's grouped kernels run BF16 expert groups of this config (on a GPU with triton), the
    line that says so: Megatron's --moe-grouped-gemm runs TE's GroupedLinear."""
    from harness.backends.te_moe import KERNELS, resolve

    asked = cfg.backend.moe_experts
    if resolve(asked, cfg.model.num_moe_experts, available=True) != "grouped":
        return []
    picks = "" if asked in KERNELS else " (auto: this model's experts, on CUDA with triton)"
    return [
        f"# backend.moe_experts={asked}{picks}: lowp runs BF16 expert groups on torch._grouped_mm (fprop, "
        "dgrad) and a Triton fp32 wgrad into the main grad; Megatron's --moe-grouped-gemm runs TE's "
        "GroupedLinear (one cuBLAS GEMM per expert): the same rounding points, another summation order"
    ]


# Megatron's get_fp8_align_size (fp8_utils.py:356-361) per --fp8-recipe value: 16 where not listed
_MEGATRON_FP8_ALIGNMENT = {"mxfp8": 32}


def megatron_expert_alignment(r: RecipeConfig) -> int:
    """The tokens Megatron aligns each expert to (moe_utils.py:1463-1480): 128 under any FP4 recipe
    (fp4_utils.py:176-205), 32 under MXFP8, 16 under the other FP8 recipes; 0 without FP8/FP4."""
    if r.fp4:
        return 128
    if r.fp8:
        return _MEGATRON_FP8_ALIGNMENT.get(recipes.get(r.name).megatron.fp8_recipe, 16)
    return 0


def _router_padding_notes(cfg: Config) -> list[str]:
    """moe_router_padding_for_quantization routes real tokens to the experts at probability 0, which
    their quantizers see: a `#` line where Megatron aligns to another size than lowp."""
    from harness.backends.emulated import expert_alignment

    lowp, megatron = expert_alignment(cfg.recipe), megatron_expert_alignment(cfg.recipe)
    if lowp == megatron:
        return []
    return [
        f"# model.moe_router_padding_for_quantization=true with recipe={cfg.recipe.name}: Megatron aligns "
        f"each expert's tokens to {megatron} (megatron/core/transformer/moe/moe_utils.py:1463-1480), "
        f"lowp to {lowp}, so the two route different padding tokens (at probability 0) to the experts"
    ]


def nvte_env(cfg: Config) -> dict[str, str]:
    """NVTE_* variables Megatron's run needs to match the config (TE reads them at import), where
    they differ from what TE assumes unset."""
    r, s = cfg.recipe, cfg.stability
    spec = recipes.get(r.name)
    env = spec.nvte_changed(r)
    if spec.quantizes_gemms and spec.te_high_precision_backward_ok and (bo := te_backward_override(r, s)):
        # Megatron passes fp8_wgrad only to DelayedScaling; every other TE recipe class takes its
        # backward_override default from this variable, which is what lowp's TE backend sets
        env["NVTE_BACKWARD_OVERRIDE"] = bo
    return env


def te20_notes(r: RecipeConfig) -> list[str]:
    """A `#` line per TE 2.20 recipe field away from its default: Megatron-LM has no flag for any
    (megatron/training/arguments.py); how to set it (its NVTE_* variable where TE reads one)."""
    spec, default, notes = recipes.get(r.name), RecipeConfig(), []
    var_of = {v.field: v for v in spec.nvte_vars}
    for name, value in recipes.te20_set(r).items():
        lead = f"# recipe.{name}={value}: Megatron-LM has no flag for it (megatron/training/arguments.py)"
        if (var := var_of.get(name)) is not None:
            notes.append(f"{lead}; TE reads its default from the environment: {var.var}={var.value(r)}")
        else:
            notes.append(
                f"{lead} and TE reads no NVTE_* variable for it: Megatron builds {spec.te_recipe_class}"
                "(fp8_format=...) in megatron/core/extensions/transformer_engine.py, so its run keeps "
                f"TE's default {getattr(default, name)!r} unless that call passes {name}={value!r}"
            )
    return notes


def _expressed_fields(spec: recipes.RecipeSpec) -> set[str]:
    """RecipeConfig fields that reach Megatron: as a flag, an NVTE_* variable or the spec's note."""
    out = set(_ALWAYS_EXPRESSED) | {v.field for v in spec.nvte_vars} | set(_ATTENTION_FIELDS)
    out |= _LOWP_ONLY_FIELDS | set(recipes.TE20_FIELDS)  # te20_notes says each
    if spec.megatron.history_flags:
        out |= _HISTORY_FIELDS
    if spec.megatron.quantizer_factory:
        out.add("quantizer_factory")
    if spec.megatron.note:
        out |= {name for _, name, _, _ in string.Formatter().parse(spec.megatron.note) if name}
    return out


def recipe_flags(cfg: Config) -> Part:
    """Format and recipe flags (from the recipe registry); comments for the fields Megatron lacks."""
    r = cfg.recipe
    spec, mg = recipes.get(r.name), recipes.get(r.name).megatron
    flags: list[Flag] = [("--bf16", None)]
    notes: list[str] = []
    if r.fp8:
        flags += [("--fp8-format", r.fp8), ("--fp8-recipe", mg.fp8_recipe)]
        if mg.history_flags:  # the guide's 1024/max are not Megatron's 1/most_recent
            flags += [
                ("--fp8-amax-history-len", r.fp8_amax_history_len),
                ("--fp8-amax-compute-algo", r.fp8_amax_compute_algo),
            ]
        if mg.quantizer_factory and r.quantizer_factory:
            flags.append(("--fp8-quantizer-factory", _dotted(r.quantizer_factory)))
    if r.fp4:
        flags.append(("--fp4-format", r.fp4))
        if mg.fp4_recipe:
            flags.append(("--fp4-recipe", mg.fp4_recipe))
        if mg.quantizer_factory and r.quantizer_factory:
            flags.append(("--fp4-quantizer-factory", _dotted(r.quantizer_factory)))
    if mg.note:
        notes.append(mg.note.format(**dataclasses.asdict(r)))
    if r.fp8_fast_accumulation != "fprop":
        notes.append(
            f"# recipe.fp8_fast_accumulation={r.fp8_fast_accumulation} has no Megatron equivalent: Megatron "
            "builds Float8CurrentScaling(fp8_format=...) with TE's default MMParams (split accumulator in "
            "dgrad and wgrad), so its run keeps them accurate"
        )
    if r.fp8_dpa:
        notes.append(
            "# recipe.fp8_dpa=true: set fp8_dot_product_attention=True"
            + (" and fp8_multi_head_attention=True" if r.fp8_mha else "")
            + " in the model provider's TransformerConfig (Megatron has no flag: arguments.py keeps "
            "these fields out of its argparse; it passes them to TE's recipe as fp8_dpa/fp8_mha)"
            + (
                "; Megatron builds Float8CurrentScaling with fp8_dpa only, so its run keeps the "
                "attention I/O in BF16 (fp8_mha is not expressed)"
                if r.fp8_mha and spec.te_recipe_class == "Float8CurrentScaling"
                else ""
            )
        )
    te20_vars = {v.var for v in spec.nvte_vars if v.field in recipes.TE20_FIELDS and v.value(r) is not None}
    notes += te20_notes(r)
    notes += [
        f"# requires env {var}={v} (no Megatron flag)"
        for var, v in nvte_env(cfg).items()
        if var not in te20_vars
    ]
    default, expressed = RecipeConfig(), _expressed_fields(spec)
    for f in dataclasses.fields(RecipeConfig):
        value, base = getattr(r, f.name), getattr(default, f.name)
        if f.name not in expressed and value != base:
            notes.append(
                f"# recipe.{f.name}={value!r} has no Megatron flag for recipe={r.name}: Megatron builds "
                f"the TE recipe with TE's default {base!r}"
            )
    return flags, notes


def stability_flags(cfg: Config) -> Part:
    s = cfg.stability
    flags: list[Flag] = []
    notes: list[str] = []
    if s.fp8_margin != MEGATRON_DEFAULTS["--fp8-margin"]:
        flags.append(("--fp8-margin", s.fp8_margin))
    if not s.fp8_wgrad:
        flags.append(("--no-fp8-wgrad", None))
        notes.append(
            "# warning: TE 2.x silently ignores --no-fp8-wgrad (DelayedScaling drops "
            "override_linear_precision, and Megatron passes it to no other recipe); the wgrad GEMM "
            "stays FP8 unless NVTE_BACKWARD_OVERRIDE=high_precision (not allowed with delayed scaling)"
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
    return flags, notes


def optimizer_flags(cfg: Config) -> Part:
    """The optimizer's memory knobs (precision-aware optimizer, quantized params, offload)."""
    o = cfg.optimizer
    if _fsdp2(cfg):
        flags, notes = fsdp2_optimizer_flags(cfg)
        return flags, notes + _optimizer_notes(cfg)
    flags: list[Flag] = []
    if o.fp8_param:
        flags.append(("--fp4-param-gather" if cfg.recipe.fp4 else "--fp8-param-gather", None))
    if o.reuse_grad_buf_for_mxfp8_param_ag:
        flags.append(("--reuse-grad-buf-for-mxfp8-param-ag", None))
    if o.use_distributed_optimizer:
        flags.append(("--use-distributed-optimizer", None))
    if o.optimizer_cpu_offload:
        flags.append(("--optimizer-cpu-offload", None))
    if o.use_precision_aware_optimizer:
        flags.append(("--use-precision-aware-optimizer", None))
    for flag, v in _state_dtypes(cfg).items():  # printed with or without the precision-aware optimizer
        flags.append((flag, v))
    return flags, _optimizer_notes(cfg)


def _state_dtypes(cfg: Config) -> dict[str, str]:
    """The precision-aware optimizer's dtypes where they differ from Megatron's fp32 defaults."""
    o = cfg.optimizer
    values = {
        "--main-grads-dtype": o.main_grads_dtype,
        "--main-params-dtype": o.main_params_dtype,
        "--exp-avg-dtype": o.exp_avg_dtype,
        "--exp-avg-sq-dtype": o.exp_avg_sq_dtype,
    }
    return {flag: v for flag, v in values.items() if v != MEGATRON_DEFAULTS[flag]}


def fsdp2_optimizer_flags(cfg: Config) -> Part:
    """The optimizer under --use-torch-fsdp2, which refuses Megatron's distributed optimizer
    (arguments.py:1038-1039) and so the precision-aware optimizer and its CPU offload, which are
    built only as one (core/optimizer/__init__.py:1057-1060; arguments.py:1884-1888): FSDP2 shards
    fp32 states itself. What lowp's run keeps beyond that is said, not printed."""
    o, r = cfg.optimizer, cfg.recipe
    if o.optimizer_cpu_offload:
        raise ConfigError(
            "parallel=fsdp2 with optimizer.optimizer_cpu_offload=true: Megatron offloads only through "
            "the precision-aware distributed optimizer, which --use-torch-fsdp2 refuses; use "
            "parallel=ddp or optimizer.optimizer_cpu_offload=false"
        )
    flags: list[Flag] = []
    notes: list[str] = []
    if o.fp8_param and r.fp4:  # kept under FSDP2 from TE 2.7 (arguments.py:1056-1061), which FP4 needs
        flags.append(("--fp4-param-gather", None))
    elif o.fp8_param:
        # the grad-buffer reuse goes with it: only Megatron's DDP config and distributed optimizer read it
        reuse = " (and reuse_grad_buf_for_mxfp8_param_ag=true)" if o.reuse_grad_buf_for_mxfp8_param_ag else ""
        notes.append(
            f"# optimizer.fp8_param=true{reuse} under parallel=fsdp2 has no Megatron equivalent: with TE "
            ">= 2.0 Megatron turns --fp8-param-gather off under --use-torch-fsdp2 and gathers BF16 weights "
            "(arguments.py:1050-1055), so it is not printed; lowp's run keeps FP8 weights. parallel=ddp "
            "with optimizer.use_distributed_optimizer=true exports them"
        )
    if o.use_distributed_optimizer:
        notes.append(
            "# optimizer.use_distributed_optimizer=true under parallel=fsdp2 -> no "
            "--use-distributed-optimizer: --use-torch-fsdp2 refuses it (arguments.py:1038-1039) and "
            "shards the optimizer states itself, as lowp's FSDP2 run does"
        )
    if o.use_precision_aware_optimizer:
        dtypes = "".join(f", {flag[2:].replace('-', '_')}={v}" for flag, v in _state_dtypes(cfg).items())
        notes.append(
            f"# optimizer.use_precision_aware_optimizer=true{dtypes} under parallel=fsdp2 has no Megatron "
            "equivalent: Megatron builds that optimizer only as its distributed optimizer "
            "(core/optimizer/__init__.py:1057-1060), which --use-torch-fsdp2 refuses, so its run keeps "
            "fp32 main grads and optimizer states"
        )
    return flags, notes


def _optimizer_notes(cfg: Config) -> list[str]:
    """What lowp's optimizer does that Megatron has no flag for, under any parallel strategy."""
    o = cfg.optimizer
    notes = []
    if not o.master_weights:
        notes.append(
            "# optimizer.master_weights=false (bf16 params updated in place, no fp32 master copy) has "
            "no Megatron equivalent: with --bf16 Megatron always keeps fp32 main params"
        )
    if o.step_in_backward:
        notes.append(
            "# optimizer.step_in_backward=true has no Megatron equivalent: Megatron steps after backward "
            "(the same update, without the overlap)"
        )
    if o.activation_func_fp8_input_store:
        notes.append(
            "# optimizer.activation_func_fp8_input_store=true is a TransformerConfig field with no "
            "Megatron flag (valid only with --swiglu): set activation_func_fp8_input_store=True in "
            "the model provider's config"
        )
    return notes


def data_parallel_size(cfg: Config) -> int:
    """The ranks the export's torchrun starts: this job's world size (torchrun/Slurm environment)
    under a parallel strategy, else 1."""
    from harness.parallel.process import world_size

    return world_size() if cfg.parallel.strategy != "none" else 1


def parallel_flags(cfg: Config) -> Part:
    """Data parallelism: Megatron's DDP is its default; FSDP2 has flags, the amax group a
    TransformerConfig field."""
    p = cfg.parallel
    flags: list[Flag] = []
    notes: list[str] = []
    if _fsdp2(cfg):
        # torch_dist is the default; --use-torch-fsdp2 asserts it or torch_dcp (arguments.py:1042-1043)
        flags += [("--use-torch-fsdp2", None), ("--ckpt-format", "torch_dist")]
        if not p.reshard_after_forward:  # arguments.py:3218, read by training.py:2627-2629
            flags.append(("--torch-fsdp2-no-reshard-after-forward", None))
        notes.append(
            "# --use-torch-fsdp2: start Megatron with CUDA_DEVICE_MAX_CONNECTIONS unset or above 1 "
            "(arguments.py:1048-1049 refuses 1, which Megatron's example scripts set)"
        )
    if p.tp_only_amax_red:
        notes.append(
            "# parallel.tp_only_amax_red=true: set tp_only_amax_red=True in the model provider's "
            "TransformerConfig (Megatron has no flag: arguments.py keeps the field out of its argparse); "
            "without tensor parallelism each rank then keeps its own amaxes, as in lowp's run"
        )
    dp = data_parallel_size(cfg)
    if dp > 1:
        accum = cfg.global_batch_size // (cfg.micro_batch_size * dp)
        notes.append(
            f"# data parallel over {dp} ranks ({p.strategy}): {accum} micro-batch(es) of "
            f"{cfg.micro_batch_size} per rank per step (Megatron derives it from --global-batch-size)"
        )
    return flags, notes


def training_flags(cfg: Config) -> Part:
    """Optimizer hyper-parameters and schedule, where they differ from Megatron's defaults."""
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
    }
    return [(k, v) for k, v in values.items() if v != MEGATRON_DEFAULTS[k]], []


def megatron_seed(seed: int) -> int:
    """Megatron refuses seeds < 1 (initialize.py: "should be a positive integer"): N -> N + 1."""
    return seed + 1


def run_flags(cfg: Config) -> Part:
    """What Megatron needs to start: iterations, batch, eval, seed, data, and the fusion switch."""
    tokens_per_iter = cfg.global_batch_size * cfg.model.seq_length
    budget = eval_budget(cfg)  # what lowp evaluates: eval_tokens, at most the training tokens
    eval_iters = math.ceil(budget / tokens_per_iter) if budget > 0 else 0
    flags: list[Flag] = [
        ("--train-iters", cfg.steps),
        ("--micro-batch-size", cfg.micro_batch_size),
        ("--global-batch-size", cfg.global_batch_size),
        # Megatron divides by --eval-interval even with --eval-iters 0; lowp's 0 means "at the end"
        ("--eval-interval", cfg.eval_interval if cfg.eval_interval > 0 else cfg.steps),
        ("--eval-iters", eval_iters),
        ("--log-interval", cfg.log_interval),
        ("--seed", megatron_seed(cfg.seed)),
        ("--no-gradient-accumulation-fusion", None),
    ]
    notes = [
        f"# seed={cfg.seed} -> --seed {megatron_seed(cfg.seed)}: Megatron needs a seed >= 1, so lowp's "
        "seed N is exported as N+1 (the two draw different streams from it either way)",
        "# --no-gradient-accumulation-fusion: Megatron's output layer fuses wgrad accumulation "
        "through apex (fused_weight_gradient_mlp_cuda); "
        + (
            "--use-torch-fsdp2 requires the flag (arguments.py:1040-1041). "
            if _fsdp2(cfg)
            else "drop the flag where apex is installed. "
        )
        + "It also turns off TE's fused wgrad accumulation into fp32 main grads, which lowp's TE "
        "backend keeps",
    ]
    if cfg.backend.deterministic:  # the same rule: its environment, torch's switch, no fused loss
        flags.append(("--deterministic-mode", None))
    if eval_iters * tokens_per_iter != cfg.eval_tokens:
        capped = f", capped at the run's {budget} training tokens," if budget < cfg.eval_tokens else ""
        notes.append(
            f"# eval_tokens={cfg.eval_tokens}{capped} -> --eval-iters {eval_iters} of {tokens_per_iter} "
            "tokens (Megatron evaluates whole global batches)"
        )
    data_flags, data_notes = _data_flags(cfg)
    return flags + data_flags, notes + data_notes


def _data_flags(cfg: Config) -> Part:
    d = cfg.data
    tokenizer: list[Flag] = [("--tokenizer-type", "NullTokenizer")]  # ids as they are; needs no files
    if d.name == "synthetic":
        return [("--mock-data", None), *tokenizer], [
            "# data=synthetic -> --mock-data: Megatron's own random tokens (another stream than lowp's)"
        ]
    if d.name == "megatron":
        if d.eval_path:
            return [("--train-data-path", d.path), ("--valid-data-path", d.eval_path), *tokenizer], []
        held = round(d.eval_fraction * 100, 6)
        return [("--data-path", d.path), ("--split", f"{100 - held!r},{held!r},0"), *tokenizer], [
            f"# data.eval_fraction={d.eval_fraction!r} -> --split: Megatron holds out whole "
            "documents, shuffled, where lowp holds out the last tokens"
        ]
    return [], [
        f"# data={d.name} has no Megatron dataset: add --data-path PREFIX (a Megatron indexed "
        "dataset, e.g. made with tools/preprocess_data.py) or --mock-data, with --tokenizer-type"
    ]


def provider_fields(cfg: Config) -> dict[str, object]:
    """TransformerConfig fields lowp sets that Megatron has no flag for (a model provider sets them)."""
    o, r = cfg.optimizer, cfg.recipe
    fields: dict[str, object] = {}
    if o.activation_func_fp8_input_store:
        fields["activation_func_fp8_input_store"] = True
    if cfg.parallel.tp_only_amax_red:
        fields["tp_only_amax_red"] = True
    for name, field in _ATTENTION_FIELDS.items():
        if field and getattr(r, name):
            fields[field] = True
    return fields


def megatron_args(cfg: Config) -> tuple[list[str], list[str]]:
    """(argv tokens, comment lines) for Megatron-LM's pretrain_gpt.py."""
    argv: list[str] = []
    notes: list[str] = []
    parts = (
        model_flags,
        recipe_flags,
        stability_flags,
        optimizer_flags,
        parallel_flags,
        training_flags,
        run_flags,
    )
    for part in parts:
        flags, part_notes = part(cfg)
        notes += part_notes
        for flag, value in flags:
            argv.append(flag)
            if value is not None:
                argv.append(_fmt(value))
    return argv, notes


def _flag_lines(argv: list[str]) -> list[str]:
    lines, i = [], 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(f"{argv[i]} {shlex.quote(argv[i + 1])}")
            i += 2
        else:
            lines.append(argv[i])
            i += 1
    return lines


def render(cfg: Config, fmt: str = "sh") -> str:
    """`sh`: comments, then one runnable torchrun command; `args`: comments, then a flag a line."""
    argv, notes = megatron_args(cfg)
    script = '"${MEGATRON_LM:?a Megatron-LM checkout}/pretrain_gpt.py"'
    if (
        cfg.objective.name == MASKED_DIFFUSION
    ):  # MegaDLMs' pretrain_difflm.py (harness.interop.megatron_difflm)
        argv, notes, script = difflm_command(cfg.objective, cfg.recipe, cfg.data, cfg.model, argv, notes)
    notes = [textwrap.fill(n, 108, subsequent_indent="#   ", break_on_hyphens=False) for n in notes]
    lines = _flag_lines(argv)
    if fmt == "args":
        return "\n".join([*notes, *lines])
    env = [f"{var}={v}" for var, v in nvte_env(cfg).items()]
    head = " ".join(
        [
            *env,
            f"torchrun --nproc-per-node {data_parallel_size(cfg)}",
            script,
        ]
    )
    return "\n".join([*notes, " \\\n  ".join([head, *lines])])
