"""The run-level keys: every key of a composed config names a schema field, and the numbers of the
run, the schedule, the initialisation and the divergence rule are in range."""

from __future__ import annotations

import math

from harness.config.errors import ConfigError
from harness.config.schema import Config


def run_errors(cfg: Config) -> list[str]:
    """Out-of-range numbers of the run-level keys, the schedule and the divergence rule."""
    o, d, m = cfg.optimizer, cfg.divergence, cfg.model
    checks = [  # math.isfinite: inf passes a `> 0`, and would train as a divergence, not be refused
        (
            "optimizer.lr",
            o.lr,
            math.isfinite(o.lr) and o.lr > 0,
            "use a positive learning rate, e.g. optimizer.lr=3e-3",
        ),
        (
            "optimizer.min_lr",
            o.min_lr,
            math.isfinite(o.min_lr) and 0 <= o.min_lr,
            "use optimizer.min_lr >= 0 (min_lr <= lr is the Megatron rule in reference_rules)",
        ),
        (
            "model.init_method_std",
            m.init_method_std,
            math.isfinite(m.init_method_std) and m.init_method_std >= 0,
            "use a standard deviation >= 0, e.g. model.init_method_std=0.02",
        ),
        ("optimizer.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, "use 0 or more warm-up steps"),
        ("optimizer.clip_grad", o.clip_grad, o.clip_grad >= 0, "use 0 (off) or a positive norm, e.g. 1.0"),
        (
            "optimizer.weight_decay",
            o.weight_decay,
            o.weight_decay >= 0,
            "use 0 or a positive decay, e.g. 0.1",
        ),
        ("optimizer.eps", o.eps, o.eps > 0, "use a positive epsilon, e.g. 1e-8"),
        (
            "optimizer.betas",
            o.betas,
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
            "use two values in [0, 1), e.g. [0.9,0.95]",
        ),
        ("log_interval", cfg.log_interval, cfg.log_interval >= 1, "use log_interval>=1"),
        ("eval_interval", cfg.eval_interval, cfg.eval_interval >= 0, "use 0 (only at the end) or more steps"),
        ("eval_tokens", cfg.eval_tokens, cfg.eval_tokens >= 0, "use 0 (no eval) or a token budget"),
        ("telemetry_interval", cfg.telemetry_interval, cfg.telemetry_interval >= 0, "use 0 (off) or more"),
        (
            "telemetry.moe_experts_per_layer",
            cfg.telemetry.moe_experts_per_layer,
            cfg.telemetry.moe_experts_per_layer >= 0,
            "use 0 (only the others' max and median) or more experts, e.g. 4",
        ),
        (
            "checkpoint_interval",
            cfg.checkpoint_interval,
            cfg.checkpoint_interval is None or cfg.checkpoint_interval >= -1,
            "use null (every 10%), 0 (only at the end), -1 (only when a signal stops the run) or a number "
            "of steps",
        ),
        ("checkpoint_keep", cfg.checkpoint_keep, cfg.checkpoint_keep >= 1, "keep at least 1 checkpoint"),
        ("bench_warmup_steps", cfg.bench_warmup_steps, cfg.bench_warmup_steps >= 0, "use 0 or more"),
        ("divergence.patience", d.patience, d.patience >= 1, "use divergence.patience>=1"),
        (
            "divergence.loss_spike_factor",
            d.loss_spike_factor,
            d.loss_spike_factor == 0 or d.loss_spike_factor > 1,
            "use 0 (no spike check) or a factor above 1, e.g. 2.0",
        ),
        ("data.num_tokens", cfg.data.num_tokens, cfg.data.num_tokens >= 1, "use a positive token count"),
    ]
    return [f"{key}={value}: out of range; {fix}" for key, value, ok, fix in checks if not ok]


def unknown_keys(tree: dict, schema_cls: type = Config, prefix: str = "") -> list[str]:
    """Dotted keys of a composed config that name no field of the schema (a mistyped `+key=value`
    would otherwise be carried along and silently ignored)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema_cls)
    fields = {f.name for f in dataclasses.fields(schema_cls)}
    out = []
    for key, value in tree.items():
        if not prefix and key == "hydra":
            continue
        if key not in fields:
            out.append(prefix + str(key))
        elif isinstance(value, dict) and dataclasses.is_dataclass(hints[key]):
            out += unknown_keys(value, hints[key], f"{prefix}{key}.")
    return out


def check_known_keys(dcfg) -> None:
    """Raise ConfigError (one line) for the first key that is not a config field."""
    from omegaconf import OmegaConf

    unknown = unknown_keys(OmegaConf.to_container(dcfg, resolve=False))
    if unknown:
        key = unknown[0]
        parent = key.rpartition(".")[0]
        raise ConfigError(
            f"{key}: no such config field{f' in {parent}' if parent else ''}; check the spelling "
            "(lowp-train --cfg job lists every field), or put free-form tags under extras.<name>"
        )
