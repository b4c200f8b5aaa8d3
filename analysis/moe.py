"""Mixture-of-experts runs in the report: whether a recipe changes how tokens spread over the experts,
and which expert's numerics are the worst.

- **Load balance.** A run's value of a load metric (`moe/tokens_per_expert_max_mean`, the mean over
  its MoE layers of max / mean tokens per expert, 1 when balanced; the fraction of experts without
  tokens; the router's entropy; dropped tokens) is the mean of its logged rows after the first
  `EARLY_FRAC` of its tokens. An arm's gap to BF16 is relative to the BF16 seed mean, with the loss
  gap's interval (paired t over matching seeds, else Welch t) and its verdict words (higher, lower,
  indistinguishable). The arm *departs from BF16's seed band* when its seed mean lies outside the
  band of the BF16 seeds: the wider of [min, max] and mean +- 2 sigma (pairing's band); one BF16 seed
  gives no band, and no warning.
- **Worst expert.** From the telemetry rows of each MoE layer's N worst experts per step (the harness
  keeps the experts with the lowest SQNR, `telemetry.moe_experts_per_layer`): per arm, the mean SQNR
  of each expert operand (fc, tensor) over the telemetry rows and seeds that list it; the worst expert
  is the one with the lowest, named with how often it was listed and the other experts' median.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pandas as pd

from analysis import keys as K
from analysis import stats as S
from analysis.pairing import EARLY_FRAC, Group

LOAD = K.MOE_TOKENS_PER_EXPERT_MAX_MEAN
METRICS = {
    LOAD: "tokens per expert max/mean",
    K.MOE_EXPERTS_WITHOUT_TOKENS: "experts without tokens",
    K.MOE_ROUTER_ENTROPY: "router entropy (nats)",
    K.MOE_DROPPED_TOKENS: "dropped tokens",
}
"""Load metrics of the MoE table (metrics.jsonl keys, the mean over MoE layers) and their headers."""
EXPERT = re.compile(r"^(?P<group>.+\.experts)\.(?P<fc>fc[12])\.(?P<expert>\d+)$")
"""An expert's own telemetry row (`blocks.3.mlp.experts.fc1.5`); `...fc1.median` sums up the others."""


def run_value(run, key: str) -> float | None:
    """The mean of `key` over the run's logged rows after the first EARLY_FRAC of its tokens."""
    values = run.train.get(key)
    if values is None:
        return None
    ok = np.isfinite(values)
    if not ok.any():
        return None
    tokens = run.train[K.TOKENS]
    late = ok & (tokens >= EARLY_FRAC * tokens[ok].max())
    return float(values[late if late.any() else ok].mean())


def is_moe(group: Group) -> bool:
    return any(LOAD in r.train for r in group.runs)


def _values(runs, key: str) -> dict:
    out = {}
    for r in runs:
        v = run_value(r, key) if r.status == K.COMPLETED else None
        if v is not None:
            out[r.seed] = v
    return out


def load_rows(group: Group) -> list[dict[str, Any]]:
    """One row per arm (baseline first): each load metric's seed mean, and for max/mean tokens per
    expert the gap to BF16 with its interval, the verdict, the BF16 band and whether the arm leaves it."""
    base_arm = next((a for a in group.arms if a.role == "baseline"), None)
    base = _values(base_arm.runs, LOAD) if base_arm else {}
    band = _band(list(base.values()))
    rows = []
    for arm in group.arms:
        row: dict[str, Any] = {"recipe": arm.name, "role": arm.role}
        for key in METRICS:
            vals = _values(arm.runs, key)
            row[key] = float(np.mean(list(vals.values()))) if vals else None
        row["seeds"] = len(_values(arm.runs, LOAD))
        if arm.role != "baseline" and base:
            _gap(row, _values(arm.runs, LOAD), base, band)
        rows.append(row)
    return rows


def _band(values: list[float]) -> tuple[float, float] | None:
    """pairing's band over the BF16 seeds: the wider of [min, max] and mean +- 2 sigma; None below 2."""
    if len(values) < 2:
        return None
    x = np.array(values)
    two_sigma = 2 * float(x.std(ddof=1))
    return min(x.min(), x.mean() - two_sigma), max(x.max(), x.mean() + two_sigma)


def _gap(row: dict[str, Any], vals: dict, base: dict, band: tuple[float, float] | None) -> None:
    ref = float(np.mean(list(base.values())))
    iv = S.gap_interval(vals, base)
    if iv is None or not ref:
        row["verdict"] = "no completed run"
        return
    rel = iv.scaled(1 / ref)
    row["gap_rel"], row["gap_rel_lo"], row["gap_rel_hi"], row["interval"] = (
        rel.mean,
        rel.lo,
        rel.hi,
        iv.method,
    )
    row["verdict"] = _verdict(rel)
    value = row[LOAD]
    row["bf16_band"] = band
    row["departs"] = band is not None and value is not None and not band[0] <= value <= band[1]


def _verdict(rel: S.Interval) -> str:
    """The loss verdict's words for a load gap (positive: less balanced than BF16)."""
    if not math.isfinite(rel.lo):
        return f"gap {S.pct(rel.mean)} from one seed: no interval"
    if rel.lo > 0:
        return f"less balanced than BF16 by {100 * rel.mean:.2f}% {S.ci_text(rel)}"
    if rel.hi < 0:
        return f"more balanced than BF16 by {100 * -rel.mean:.2f}% {S.ci_text(rel)}"
    return f"indistinguishable from BF16 (would detect >= {100 * rel.mde:.2f}%; gap {S.ci_text(rel)})"


def load_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """A sentence per arm whose max/mean tokens per expert leaves the BF16 seed band."""
    out = []
    for row in rows:
        if row.get("departs"):
            lo, hi = row["bf16_band"]
            out.append(
                f"{row['recipe']}: load balance departs from BF16's seed band: tokens per expert max/mean "
                f"{row[LOAD]:.3f} (mean of {row['seeds']} seeds) against BF16's band {lo:.3f}-{hi:.3f}; "
                f"{row['verdict']}"
            )
    return out


def worst_experts(group: Group, numerics: pd.DataFrame) -> list[str]:
    """A sentence per arm with expert telemetry, naming its worst expert (lowest mean SQNR)."""
    if not len(numerics) or K.TELEMETRY_LAYER not in numerics:
        return []
    out = []
    for arm in group.arms:
        df = numerics[numerics["run"].isin({r.name for r in arm.runs})]
        parts = df[K.TELEMETRY_LAYER].astype(str).str.extract(EXPERT.pattern)
        own = df[parts["expert"].notna()].assign(**{c: parts[c] for c in ("group", "fc", "expert")})
        sqnr = pd.to_numeric(own.get("sqnr_db"), errors="coerce")
        own = own[np.isfinite(sqnr)].assign(sqnr_db=sqnr)
        if not len(own):
            continue
        by = own.groupby(["group", "expert", "fc", K.TELEMETRY_TENSOR])
        means = by["sqnr_db"].mean()
        (grp, expert, fc, tensor), value = means.idxmin(), float(means.min())
        steps = df[["run", "step"]].drop_duplicates()
        listed = own[(own["group"] == grp) & (own["expert"] == expert)][["run", "step"]].drop_duplicates()
        medians = df[df[K.TELEMETRY_LAYER] == f"{grp}.{fc}.median"]
        medians = pd.to_numeric(medians[medians[K.TELEMETRY_TENSOR] == tensor]["sqnr_db"], errors="coerce")
        medians = medians[np.isfinite(medians)]
        tail = f"; the other experts' median {medians.mean():.1f} dB" if len(medians) else ""
        out.append(
            f"{arm.name}: worst expert {grp}.{expert}: {fc} {tensor} SQNR {value:.1f} dB, the mean over the "
            f"{len(listed)} of {len(steps)} telemetry steps (all seeds) that list it among its layer's "
            f"worst{tail}"
        )
    return out


def moe_section(group: Group, numerics: pd.DataFrame) -> dict[str, Any] | None:
    """The report's MoE part of a group: its table, the load-balance warnings, the worst experts;
    None for a group without MoE metrics."""
    if not is_moe(group):
        return None
    rows = load_rows(group)
    return {"rows": rows, "table": display_frame(rows), "warnings": load_warnings(rows),
            "experts": worst_experts(group, numerics)}  # fmt: skip


def display_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    def cell(v, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, float) and math.isfinite(v) else "—"

    def band(row) -> str:
        b = row.get("bf16_band")
        return "—" if b is None else f"{b[0]:.3f}-{b[1]:.3f}" + (" (outside)" if row.get("departs") else "")

    return pd.DataFrame([{
        "recipe": r["recipe"],
        **{title: cell(r.get(key), ".3f") for key, title in METRICS.items()},
        "max/mean vs BF16": "BF16" if r["role"] == "baseline" else r.get("verdict", "—"),
        "BF16 band": "—" if r["role"] == "baseline" else band(r),
        "seeds": r["seeds"],
    } for r in rows])  # fmt: skip


def frame(sections: list[tuple[Group, dict[str, Any]]]) -> pd.DataFrame:
    """moe.csv: one row per arm of each MoE group, the raw numbers."""
    out = []
    for g, sec in sections:
        for r in sec["rows"]:
            b = r.get("bf16_band")
            key = {
                "hardware": g.key.hardware,
                "model": g.key.model,
                "data": g.key.data,
                "tokens": g.key.tokens,
            }
            raw = {k: v for k, v in r.items() if k != "bf16_band"}
            out.append(
                {**key, **raw, "bf16_band_lo": b[0] if b else None, "bf16_band_hi": b[1] if b else None}
            )
    return pd.DataFrame(out)
