"""Telemetry's rules: the counterfactual candidates (`telemetry.candidates`) are parsed here, before any
work, by the same parser the backends use (harness.numerics.counterfactual.parse), so that a bad entry
is refused in one line (exit 2) before a run, or any job of a multirun, starts; a list that no
telemetry step will read is a warning."""

from __future__ import annotations

from harness.config.schema import Config
from harness.numerics import counterfactual


def telemetry_errors(cfg: Config) -> list[str]:
    """One line naming `telemetry.candidates[i]` and the fix for the first entry lowp cannot quantize
    with (an unknown recipe, one that quantizes nothing, delayed scaling, an unknown field, a repeat)."""
    try:
        counterfactual.parse(cfg.telemetry.candidates)
    except (ValueError, TypeError) as e:
        return [str(e)]
    return []


def telemetry_warnings(cfg: Config) -> list[str]:
    """Candidates without telemetry steps: nothing reads them."""
    if cfg.telemetry.candidates and cfg.telemetry_interval <= 0:
        return [
            "telemetry.candidates is set but telemetry_interval=0: no telemetry step quantizes with "
            "them; set telemetry_interval=N (every N steps) or drop the candidates"
        ]
    return []
