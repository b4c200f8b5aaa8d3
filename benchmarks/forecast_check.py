"""Coverage of the report's gap forecasts, checked as they are used: fit on the first part of a measured
run, predict the rest.

    python -m benchmarks forecast_check [--out DIR]

Cases are arm x seed pairs read from collected run files (`python -m analysis.collect`'s JSON, or a
curves spec's result) under benchmarks/results/: every non-BF16 run paired with the BF16 run of the same
model, token budget and seed. For each extrapolation ratio r and case with T tokens, the forecast
(`analysis.forecast`: family chosen by hold-out, refusals included) is fitted on the points up to T/r
(past the early transient of that shorter run) and asked for the gap at T, averaged over the points of
the final smoothing window; the case is covered when the observed mean gap there lies inside the 95%
prediction interval. Coverage at r = covered / forecasts made (refusals are counted apart). The
validated ratio is the largest r whose coverage is >= 90% of nominal over >= 30 forecasts; the report
refuses beyond it (`analysis.forecast.VALIDATED_RATIO`).

The BF16 loss fit behind `lowp-report --target-loss` is checked the same way (`bf16_loss_fit` in the
output): every distinct BF16 run of the sources, `analysis.forecast.loss_fit` on its points up to T/r
past the early transient of that part (above the run's loss floor where the data has one), its 95%
prediction interval against the run's mean loss over the final smoothing window of T; coverage per r
and the validated ratio by the same rule (`analysis.forecast.LOSS_VALIDATED_RATIO`).

Sources: the 300-step H200 loss checks (markov_300_*: 13 train points per run, every 25 steps), the
main job's 25 runs (cpu_compare_cpu_*: 20 train points per run) and the CPU set made for this check
(`sweeps/forecast_cpu_set.yaml`: gpt_tiny at 10x the main job's tokens, 5 seeds, the main job's arms),
collected into forecast_cpu_set_*.json; a source that is absent is said.
"""

from __future__ import annotations

import glob
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis import forecast as F
from analysis.pairing import EARLY_FRAC, SMOOTH_FRAC
from benchmarks import specs

RESULTS = Path(__file__).resolve().parent / "results"
NOMINAL = 0.95
ENOUGH = 0.9 * NOMINAL
MIN_CASES = 30
SOURCES = ("markov_300_*.json", "cpu_compare_cpu_*.json", "forecast_cpu_set_*.json")
"""The H200 loss checks, the main job's runs (collected) and the CPU set made for this check."""


@dataclass(frozen=True)
class Options:
    sources: list[str] = field(default_factory=lambda: list(SOURCES))
    """Globs under benchmarks/results/ of collected run files."""
    ratios: list[float] = field(default_factory=lambda: [1.5, 2.0, 3.0, 5.0, 10.0])


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    return {}  # reads result files; trains nothing


@dataclass(frozen=True)
class Curve:
    """One run's raw train loss against tokens."""

    source: str
    label: str
    recipe: str
    model: str
    tokens: int
    seed: int
    t: np.ndarray
    loss: np.ndarray
    floor: float | None = None
    """summary.loss_floor (markov data), the loss fit's lowest asymptote."""


def _runs(obj: dict) -> dict:
    return obj.get("runs", obj) if isinstance(obj, dict) else {}


def read_curves(path: Path) -> list[Curve]:
    """Every completed run of a collected file, with tokens = step x tokens per step."""
    out = []
    for label, r in _runs(json.loads(path.read_text())).items():
        s = r.get("summary") if isinstance(r, dict) else None
        if not s or s.get("status") != "completed" or not r.get("train") or not s.get("steps"):
            continue
        rows = np.array([row[:2] for row in r["train"] if row[1] is not None], dtype=float)
        per_step = s["tokens"] / s["steps"]
        recipe = f"{s.get('recipe_label') or s.get('recipe')} [{s.get('variant')}]"
        out.append(Curve(path.name, label, recipe, s.get("model"), int(s["tokens"]), int(s.get("seed", 0)),
                         rows[:, 0] * per_step, rows[:, 1], s.get("loss_floor")))  # fmt: skip
    return out


def cases(curves: list[Curve]) -> list[tuple[Curve, Curve]]:
    """(arm run, BF16 run of the same model, tokens and seed): the first BF16 run found of each."""
    bf16: dict[tuple, Curve] = {}
    for c in curves:
        if c.recipe.startswith("bf16 "):
            bf16.setdefault((c.model, c.tokens, c.seed), c)
    seen, out = set(), []
    for c in curves:
        ref = bf16.get((c.model, c.tokens, c.seed))
        key = (c.model, c.tokens, c.seed, c.recipe, tuple(np.round(c.loss, 6)))
        if ref is None or c.recipe.startswith("bf16 ") or key in seen:
            continue
        seen.add(key)
        out.append((c, ref))
    return out


def check_case(arm: Curve, ref: Curve, ratio: float) -> dict:
    """Fit on tokens <= T/ratio, predict the mean gap over the final smoothing window of T."""
    total = float(arm.tokens)
    gap = (arm.loss - np.interp(arm.t, ref.t, ref.loss)) / np.interp(arm.t, ref.t, ref.loss)
    cut = total / ratio
    fit_pts = (arm.t >= EARLY_FRAC * cut) & (arm.t <= cut * (1 + 1e-9))
    final = arm.t >= total * (1 - SMOOTH_FRAC) - 1e-9
    final = final if final.sum() else arm.t == arm.t[-1]
    row = {"case": f"{arm.source}:{arm.label}", "recipe": arm.recipe, "seed": arm.seed, "ratio": ratio,
           "points": int(fit_pts.sum()), "observed": float(gap[final].mean())}  # fmt: skip
    f, why = F.choose(arm.t[fit_pts], gap[fit_pts])
    if f is None:
        return {**row, "refused": why}
    y, lo, hi = f.interval(float(arm.t[final].mean()), int(final.sum()))
    return {**row, "family": f.name, "predicted": y, "lo": lo, "hi": hi,
            "covered": bool(lo <= row["observed"] <= hi)}  # fmt: skip


def bf16_runs(curves: list[Curve]) -> list[Curve]:
    """Every distinct BF16 run (the same curve in two files counted once)."""
    seen, out = set(), []
    for c in curves:
        key = (c.model, c.tokens, c.seed, tuple(np.round(c.loss, 6)))
        if c.recipe.startswith("bf16 ") and key not in seen:
            seen.add(key)
            out.append(c)
    return out


def check_loss_case(run: Curve, ratio: float) -> dict:
    """The BF16 loss fit behind --target-loss (`analysis.forecast.loss_fit`) on tokens <= T/ratio
    past the early transient of that part; covered when the mean loss over the final smoothing
    window of T lies inside its 95% prediction interval for the mean of that window's points."""
    total = float(run.tokens)
    cut = total / ratio
    fit_pts = (run.t >= EARLY_FRAC * cut) & (run.t <= cut * (1 + 1e-9))
    final = run.t >= total * (1 - SMOOTH_FRAC) - 1e-9
    final = final if final.sum() else run.t == run.t[-1]
    row = {"case": f"{run.source}:{run.label}", "model": run.model, "seed": run.seed, "ratio": ratio,
           "points": int(fit_pts.sum()), "observed": float(run.loss[final].mean())}  # fmt: skip
    f, why = F.loss_fit(run.t[fit_pts], run.loss[fit_pts], run.floor)
    if f is None:
        return {**row, "refused": why}
    y, lo, hi = f.interval(float(run.t[final].mean()), int(final.sum()))
    return {**row, "fit": F.loss_text(f), "predicted": y, "lo": lo, "hi": hi,
            "covered": bool(lo <= row["observed"] <= hi)}  # fmt: skip


def coverage(rows: list[dict]) -> dict:
    """Per ratio: forecasts, refusals, covered, coverage; and the largest validated ratio."""
    by: dict[float, dict] = {}
    for r in rows:
        d = by.setdefault(r["ratio"], {"cases": 0, "refused": 0, "forecasts": 0, "covered": 0})
        d["cases"] += 1
        if "refused" in r:
            d["refused"] += 1
        else:
            d["forecasts"] += 1
            d["covered"] += r["covered"]
    for d in by.values():
        d["coverage"] = d["covered"] / d["forecasts"] if d["forecasts"] else math.nan
    ok = [r for r, d in by.items() if d["forecasts"] >= MIN_CASES and d["coverage"] >= ENOUGH]
    return {"by_ratio": {str(k): v for k, v in sorted(by.items())}, "validated_ratio": max(ok, default=None),
            "nominal": NOMINAL, "enough": ENOUGH, "min_cases": MIN_CASES}  # fmt: skip


def measure(paths: list[Path], ratios: list[float]) -> dict:
    curves = [c for p in paths for c in read_curves(p)]
    pairs = cases(curves)
    rows = [check_case(a, b, r) for r in ratios for a, b in pairs]
    bf16 = bf16_runs(curves)
    loss_rows = [check_loss_case(c, r) for r in ratios for c in bf16]
    loss = {"bf16_runs": len(bf16), **coverage(loss_rows), "rows": loss_rows}
    return {"sources": [p.name for p in paths], "pairs": len(pairs), **coverage(rows), "rows": rows,
            "bf16_loss_fit": loss}  # fmt: skip


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    paths, missing = [], []
    for pattern in opts.sources:
        found = sorted(Path(p) for p in glob.glob(str(RESULTS / pattern)))
        paths += found
        if not found:
            missing.append(pattern)
    result = {"_meta": specs.meta(spec, opts), "missing_sources": missing, **measure(paths, opts.ratios)}
    specs.write_json(out, result)
    for r, d in result["by_ratio"].items():
        print(f"ratio {r}: {d['covered']}/{d['forecasts']} covered ({100 * d['coverage']:.0f}%), "
              f"{d['refused']} refused of {d['cases']} cases")  # fmt: skip
    print(f"validated ratio (coverage >= {100 * ENOUGH:.1f}% over >= {MIN_CASES} forecasts): "
          f"{result['validated_ratio']}; absent sources: {missing or 'none'}")  # fmt: skip
    loss = result["bf16_loss_fit"]
    for r, d in loss["by_ratio"].items():
        print(f"BF16 loss fit, ratio {r}: {d['covered']}/{d['forecasts']} covered "
              f"({100 * d['coverage']:.0f}%), {d['refused']} refused of {d['cases']} BF16 runs")  # fmt: skip
    print(f"BF16 loss fit's validated ratio: {loss['validated_ratio']}")
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
