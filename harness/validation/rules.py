"""Validation before any work: the low-precision guide's rules, TE's limits and lowp's own support.

Every error is one line that names the options and the fix (exit code 2 at the entry point);
warnings where the guide only recommends. `legality.py` is what the guide and TE forbid (the
Megatron export checks only these), `support.py` what lowp cannot run yet, `keys.py` the run-level
keys, `megatron_rules.py` what Megatron-LM's own argument checks refuse, `telemetry_rules.py` the
counterfactual candidates; `validate` runs them all.
"""

from __future__ import annotations

import warnings

from harness import recipes
from harness.backends.capability import auto_note, te_blocker
from harness.backends.te_options import option_warnings
from harness.config.errors import ConfigError, ConfigWarning  # noqa: F401 - re-exported
from harness.config.schema import Config
from harness.validation.keys import check_known_keys, run_errors  # noqa: F401 - re-exported
from harness.validation.legality import legality_errors, name_errors, uses_te
from harness.validation.megatron_rules import reference_errors
from harness.validation.moe_rules import moe_export_errors, moe_warnings
from harness.validation.schedule_rules import schedule_errors
from harness.validation.support import support_errors
from harness.validation.telemetry_rules import telemetry_errors, telemetry_warnings


def recommendations(cfg: Config) -> list[str]:
    """Warnings: what the guide recommends but does not require."""
    r, s, o, m = cfg.recipe, cfg.stability, cfg.optimizer, cfg.model
    out = []
    spec = recipes.get(r.name)
    if spec.recommends_grad_buf_reuse and o.fp8_param and not o.reuse_grad_buf_for_mxfp8_param_ag:
        out.append(
            f"recipe={r.name} with optimizer.fp8_param=true: the guide strongly recommends "
            "optimizer.reuse_grad_buf_for_mxfp8_param_ag=true"
        )
    if s.fp8_margin and not spec.margin_applies:
        out.append(
            f"stability.fp8_margin={s.fp8_margin} has no effect on recipe={r.name} "
            "(TE applies the margin only in delayed scaling)"
        )
    if (
        s.first_last_layers_bf16
        and spec.scheme is not None
        and (s.num_layers_at_start_in_bf16 + s.num_layers_at_end_in_bf16 == m.num_layers)
    ):
        out.append(f"stability: all {m.num_layers} blocks are BF16, so recipe={r.name} quantizes nothing")
    if spec.fp4_family and not s.first_last_layers_bf16:
        out.append(
            f"recipe={r.name} without stability.first_last_layers_bf16: the guide advises BF16 "
            "first/last layers for FP4 (NVFP4 diverges if every linear layer is FP4)"
        )
    out += option_warnings(r, m, cfg.backend, uses_te(cfg)) + moe_warnings(cfg) + telemetry_warnings(cfg)
    if note := auto_note(cfg.backend.name, cfg.hardware.name, te_blocker(r, s, m)):
        out.append(note)
    if not s.fp8_wgrad and uses_te(cfg):
        out.append(
            "stability.fp8_wgrad=false on backend=te maps to TE's high-precision backward, which "
            "also keeps dgrad in high precision (recorded in run.json)"
        )
    if not s.fp8_wgrad and r.fp8_fast_accumulation == "all":
        out.append(
            "recipe.fp8_fast_accumulation=all has no effect on the backward GEMMs with "
            "stability.fp8_wgrad=false: TE's high-precision backward runs dgrad and wgrad in BF16; "
            "use recipe.fp8_fast_accumulation=fprop for that run"
        )
    return out


def validate(cfg: Config, *, for_export: bool = False) -> list[str]:
    """Raise ConfigError on the first problem; return (and emit) the warnings."""
    errs = legality_errors(cfg)
    if not errs:
        errs += run_errors(cfg)  # out-of-range numbers before the rules that compare them
    if not name_errors(cfg):  # the reference rules ask the registry about the names
        errs += reference_errors(cfg)  # then what Megatron-LM and TE refuse
    errs += moe_export_errors(cfg) if for_export else support_errors(cfg)
    errs += [] if errs else schedule_errors(cfg)
    errs += telemetry_errors(cfg)
    if errs:
        raise ConfigError(errs[0])
    notes = recommendations(cfg)
    for note in notes:
        warnings.warn(note, ConfigWarning, stacklevel=2)
    return notes
