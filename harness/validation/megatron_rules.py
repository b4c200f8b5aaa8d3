"""Rules Megatron-LM and Transformer Engine enforce, mirrored so that lowp refuses what they refuse.

Every config lowp accepts must pass Megatron-LM's `validate_args`, build its TransformerConfig,
DDP and optimizer configs, and give TE recipe objects its recipe classes accept. Each rule cites
where the reference enforces it (Megatron-LM main at d98e8a6, TransformerEngine main at d0067d0,
2.20.0.dev0, whose recipe module is 2.20.2's); docs/validation_rules.md is the table of them.
Where lowp is stricter than the references, the message says what they would do instead; those
rules live beside lowp's others in validate.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness import recipes
from harness.config.schema import Config


@dataclass(frozen=True)
class Rule:
    """One reference rule: `check(cfg)` is None where the config passes, else the one-line error."""

    name: str
    source: str
    """File and lines in the reference that enforce it."""
    check: Callable[[Config], str | None]


def _cpu_offload_needs_precision_aware(cfg: Config) -> str | None:
    o = cfg.optimizer
    if o.optimizer_cpu_offload and not o.use_precision_aware_optimizer:
        return (
            "optimizer.optimizer_cpu_offload=true needs optimizer.use_precision_aware_optimizer=true: "
            "Megatron refuses --optimizer-cpu-offload without --use-precision-aware-optimizer (its "
            "hybrid device optimizer reuses that code path); set it"
        )
    return None


def _cpu_offload_fp8_param_needs_delayed(cfg: Config) -> str | None:
    o, r = cfg.optimizer, cfg.recipe
    delayed = recipes.get(r.name).delayed_scaling  # what Megatron's --fp8-recipe delayed builds
    if o.optimizer_cpu_offload and o.fp8_param and r.fp8 and not delayed:
        return (
            f"optimizer.optimizer_cpu_offload=true with optimizer.fp8_param=true and recipe={r.name}: "
            "Megatron refuses --optimizer-cpu-offload with --fp8-param-gather unless --fp8-recipe "
            "delayed; use recipe=delayed or optimizer.fp8_param=false"
        )
    return None


def _precision_aware_needs_distributed(cfg: Config) -> str | None:
    o = cfg.optimizer
    if o.use_precision_aware_optimizer and not o.use_distributed_optimizer:
        return (
            "optimizer.use_precision_aware_optimizer=true needs optimizer.use_distributed_optimizer=true: "
            "Megatron builds the precision-aware optimizer only as a distributed optimizer, on one "
            "GPU too; set it"
        )
    return None


def _fp8_param_needs_distributed(cfg: Config) -> str | None:
    o = cfg.optimizer
    # --fp4-param-gather has no such check in Megatron; the export maps fp8_param to it under FP4.
    # Megatron's check admits --use-torch-fsdp2 too, but with TE >= 2.0 it has already turned the
    # gather off there (arguments.py:1050-1055): lowp's FSDP2 run keeps FP8 weights, and its export
    # says that Megatron's cannot, so FSDP2 passes here but is no remedy to suggest
    fsdp = cfg.parallel.strategy == "fsdp2"
    if o.fp8_param and not cfg.recipe.fp4 and not o.use_distributed_optimizer and not fsdp:
        return (
            "optimizer.fp8_param=true needs optimizer.use_distributed_optimizer=true: Megatron refuses "
            "--fp8-param-gather without the distributed optimizer at any world size, one GPU too; set it"
        )
    return None


def _reuse_grad_buf_needs_fp8_param(cfg: Config) -> str | None:
    o = cfg.optimizer
    if not o.reuse_grad_buf_for_mxfp8_param_ag:
        return None
    if cfg.recipe.fp4:  # fp8_param is exported as --fp4-param-gather, which the DDP check ignores
        return (
            f"optimizer.reuse_grad_buf_for_mxfp8_param_ag=true with recipe={cfg.recipe.name} (FP4): "
            "Megatron's DDP config reuses the grad buffer only for FP8 params (--fp8-param-gather); "
            "drop the knob"
        )
    if not o.fp8_param:
        return (
            "optimizer.reuse_grad_buf_for_mxfp8_param_ag=true needs optimizer.fp8_param=true: Megatron's "
            "DDP config reuses the grad buffer only for an all-gather of MXFP8 params; set "
            "optimizer.fp8_param=true or drop the knob"
        )
    return None


def _min_lr_at_most_lr(cfg: Config) -> str | None:
    o = cfg.optimizer
    if o.min_lr > o.lr:
        return (
            f"optimizer.min_lr={o.min_lr!r} exceeds optimizer.lr={o.lr!r}: Megatron requires "
            "min_lr <= lr (the cosine decays down to min_lr); lower optimizer.min_lr"
        )
    return None


def _act_fp8_input_store_needs_swiglu(cfg: Config) -> str | None:
    if cfg.optimizer.activation_func_fp8_input_store and cfg.model.activation != "swiglu":
        return (
            f"optimizer.activation_func_fp8_input_store=true with model.activation={cfg.model.activation}: "
            "Megatron's TransformerConfig stores the activation input in FP8 only for SwiGLU; "
            "set model.activation=swiglu or drop the knob"
        )
    return None


# Float8BlockScaling's three GEMMs and the operands that meet in each.
_BLOCK_GEMMS = (
    ("fprop", "x_block_dim", "w_block_dim"),
    ("dgrad", "grad_block_dim", "w_block_dim"),
    ("wgrad", "x_block_dim", "grad_block_dim"),
)


def _blockwise_no_2d_by_2d(cfg: Config) -> str | None:
    r = cfg.recipe
    if recipes.get(r.name).te_recipe_class != "Float8BlockScaling":  # the block dims bind only it
        return None
    for gemm, a, b in _BLOCK_GEMMS:
        if getattr(r, a) == 2 and getattr(r, b) == 2:
            return (
                f"recipe.{a}=2 with recipe.{b}=2: TE's Float8BlockScaling refuses a 2D by 2D block "
                f"GEMM ({gemm} multiplies those operands); set one of them to 1 (TE's default is "
                "x_block_dim=1 w_block_dim=2 grad_block_dim=1)"
            )
    return None


MEGATRON = "Megatron-LM"
TE = "TransformerEngine"
RULES: tuple[Rule, ...] = (
    Rule(
        "cpu_offload_needs_precision_aware",
        f"{MEGATRON} megatron/training/arguments.py:1884-1888 (validate_args)",
        _cpu_offload_needs_precision_aware,
    ),
    Rule(
        "cpu_offload_fp8_param_needs_delayed",
        f"{MEGATRON} megatron/training/arguments.py:1889-1892 (validate_args)",
        _cpu_offload_fp8_param_needs_delayed,
    ),
    Rule(
        "precision_aware_needs_distributed",
        f"{MEGATRON} megatron/core/optimizer/__init__.py:1057-1060 (get_megatron_optimizer)",
        _precision_aware_needs_distributed,
    ),
    Rule(
        "fp8_param_needs_distributed",
        f"{MEGATRON} megatron/training/arguments.py:1095-1097 (validate_args)",
        _fp8_param_needs_distributed,
    ),
    Rule(
        "reuse_grad_buf_needs_fp8_param",
        f"{MEGATRON} megatron/core/distributed/distributed_data_parallel_config.py:259-260 "
        "(DistributedDataParallelConfig.__post_init__)",
        _reuse_grad_buf_needs_fp8_param,
    ),
    Rule(
        "min_lr_at_most_lr",
        f"{MEGATRON} megatron/training/arguments.py:1359-1360 (validate_args)",
        _min_lr_at_most_lr,
    ),
    Rule(
        "activation_func_fp8_input_store_needs_swiglu",
        f"{MEGATRON} megatron/core/transformer/transformer_config.py:2467-2469 "
        "(TransformerConfig.__post_init__)",
        _act_fp8_input_store_needs_swiglu,
    ),
    Rule(
        "blockwise_no_2d_by_2d",
        f"{TE} transformer_engine/common/recipe/__init__.py:449-457 (Float8BlockScaling.__post_init__)",
        _blockwise_no_2d_by_2d,
    ),
)


def reference_errors(cfg: Config) -> list[str]:
    """The messages of every rule the config breaks, in RULES order."""
    return [msg for rule in RULES if (msg := rule.check(cfg)) is not None]
