"""Intervals from seeds, the minimum detectable gap, and the verdict in words.

Every interval here is a two-sided 95% Student-t interval over seeds:

- **paired t** when every run of an arm has a BF16 run of the same seed (same init and data order):
  the per-seed differences d_i = run_i - bf16_i, mean(d) +- t(0.975, n-1) * sd(d) / sqrt(n);
- **Welch t** otherwise: arm seeds against BF16 seeds as two independent samples, with
  Welch-Satterthwaite degrees of freedom.

The minimum detectable gap (MDE) is the true gap this design would call non-zero with 80% power at the
5% level: (t(0.975, df) + t(0.80, df)) * SE, with the same SE and df as the interval. A gap whose
interval holds 0 is "indistinguishable at this budget": not "equal", only "too small to resolve with
these seeds and steps", and the MDE says what size would have been resolved.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

LEVEL = 0.95
POWER = 0.80
MATERIAL_REL = 0.0025
"""A gap is material at >= 0.25% of the BF16 loss: the largest gap DeepSeek-V3 accepted for its FP8
recipe (anchors.md). A resolved gap below it is reported as resolved but negligible, not shouted."""


@dataclass(frozen=True)
class Interval:
    """mean, [lo, hi] at LEVEL, the standard error, degrees of freedom, n, the method, and the MDE."""

    mean: float
    lo: float
    hi: float
    se: float
    df: float
    n: int
    method: str
    mde: float

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def scaled(self, factor: float) -> Interval:
        """The same interval in other units (e.g. relative to the BF16 loss: factor = 1 / bf16)."""
        f = abs(factor)
        lo, hi = sorted((self.lo * factor, self.hi * factor))
        return Interval(self.mean * factor, lo, hi, self.se * f, self.df, self.n, self.method, self.mde * f)


def _tq(q: float, df: float) -> float:
    return float(_st.t.ppf(q, df))


def _finite(xs) -> np.ndarray:
    a = np.asarray([x for x in xs if x is not None], dtype=float)
    return a[np.isfinite(a)]


def _make(mean: float, se: float, df: float, n: int, method: str) -> Interval:
    if not (df > 0 and math.isfinite(se)):
        return Interval(mean, math.nan, math.nan, math.nan, df, n, method, math.nan)
    half = _tq(0.5 + LEVEL / 2, df) * se
    mde = (_tq(0.5 + LEVEL / 2, df) + _tq(POWER, df)) * se
    return Interval(mean, mean - half, mean + half, se, df, n, method, mde)


def one_sample(values) -> Interval | None:
    """t interval of the mean of per-seed values (paired differences, ratios); None without values."""
    x = _finite(values)
    if not len(x):
        return None
    n = len(x)
    se = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return _make(float(x.mean()), se, n - 1, n, "paired t" if n > 1 else "single seed")


def welch(a, b) -> Interval | None:
    """Welch t interval of mean(a) - mean(b); None when either side is empty."""
    a, b = _finite(a), _finite(b)
    if not len(a) or not len(b):
        return None
    mean = float(a.mean() - b.mean())
    if len(a) < 2 and len(b) < 2:
        return _make(mean, math.nan, 0, len(a), "single seed")
    va = a.var(ddof=1) / len(a) if len(a) > 1 else 0.0
    vb = b.var(ddof=1) / len(b) if len(b) > 1 else 0.0
    se2 = va + vb
    if len(a) < 2 or len(b) < 2:
        # One side has a single seed: its variance is taken to be the other side's (seed noise is a
        # property of the setup, not of the recipe), so the interval is not falsely narrow.
        s2 = a.var(ddof=1) if len(a) > 1 else b.var(ddof=1)
        se2 = s2 * (1 / len(a) + 1 / len(b))
        df = max(len(a), len(b)) - 1
    else:
        den = (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se2 > 0 else 0.0
        df = se2**2 / den if den > 0 else len(a) + len(b) - 2
    return _make(mean, math.sqrt(se2), df, len(a), "Welch t")


def gap_interval(run_values: dict, bf16_values: dict) -> Interval | None:
    """Gap run - BF16 from {seed: value} maps: paired t when every run seed has a BF16 seed, else Welch."""
    runs = {s: v for s, v in run_values.items() if v is not None and math.isfinite(v)}
    base = {s: v for s, v in bf16_values.items() if v is not None and math.isfinite(v)}
    if not runs or not base:
        return None
    if all(s is not None and s in base for s in runs) and len(runs) > 1:
        return one_sample([runs[s] - base[s] for s in runs])
    return welch(list(runs.values()), list(base.values()))


def ratio_interval(values) -> Interval | None:
    """t interval of per-seed ratios (speedup, token efficiency, memory), n stated in the Interval."""
    return one_sample(values)


def paired_band(diffs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column paired t interval of (n_seeds, points) differences: mean, lo, hi (NaN below 2 seeds)."""
    with np.errstate(invalid="ignore", divide="ignore"), _quiet():
        n = np.isfinite(diffs).sum(0)
        mean = np.nanmean(diffs, 0)
        se = np.nanstd(diffs, 0, ddof=1) / np.sqrt(n)
        t = np.where(n > 1, _st.t.ppf(0.5 + LEVEL / 2, np.maximum(n - 1, 1)), np.nan)
        return mean, mean - t * se, mean + t * se


def welch_band(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column Welch t interval of mean(a) - mean(b) for (seeds, points) stacks."""
    with np.errstate(invalid="ignore", divide="ignore"), _quiet():
        na, nb = np.isfinite(a).sum(0), np.isfinite(b).sum(0)
        mean = np.nanmean(a, 0) - np.nanmean(b, 0)
        va, vb = np.nanvar(a, 0, ddof=1) / na, np.nanvar(b, 0, ddof=1) / nb
        se2 = va + vb
        df = se2**2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
        ok = (na > 1) & (nb > 1) & np.isfinite(df) & (df > 0)
        t = np.where(ok, _st.t.ppf(0.5 + LEVEL / 2, np.where(ok, df, 1)), np.nan)
        half = t * np.sqrt(se2)
        return mean, mean - half, mean + half


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: NaN is the answer
        yield


# --- words ----------------------------------------------------------------------------------------


def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def ci_text(iv: Interval, unit: str = "%") -> str:
    if not math.isfinite(iv.lo):
        return "[no interval: one seed]"
    if unit == "%":
        return f"[{100 * iv.lo:+.2f}, {100 * iv.hi:+.2f}]%"
    return f"[{iv.lo:.2f}, {iv.hi:.2f}]{unit}"


def materiality(rel: Interval | None, threshold: float = MATERIAL_REL) -> str:
    """'material' when the interval excludes 0 and |gap| >= threshold, 'negligible' when it excludes 0
    below it, 'unresolved' otherwise (no interval, or one that holds 0)."""
    if rel is None or not math.isfinite(rel.lo) or not rel.excludes_zero:
        return "unresolved"
    return "material" if abs(rel.mean) >= threshold else "negligible"


def verdict(rel: Interval | None, diverged: str | None = None) -> tuple[str, str]:
    """(short verdict, sentence) for a relative gap interval (positive = worse than BF16). A resolved
    gap says whether it is material (`MATERIAL_REL`)."""
    if diverged:
        return "diverged", f"diverged {diverged}"
    if rel is None:
        return "no data", "no completed run to compare"
    if not math.isfinite(rel.lo):
        return "one seed", f"gap {pct(rel.mean)} from one seed: no interval (run >= 3 seeds)"
    detect = f"would detect >= {100 * rel.mde:.2f}%"
    side = "worse" if rel.lo > 0 else "better" if rel.hi < 0 else None
    if side is None:
        text = f"indistinguishable from BF16 at this budget ({detect}; gap {ci_text(rel)})"
        return "indistinguishable", text
    size = f"{side} than BF16 by {100 * abs(rel.mean):.2f}% {ci_text(rel)}"
    return side, f"{size}, {materiality_text(materiality(rel))}"


def materiality_text(kind: str) -> str:
    """'material, >= 0.25%' or 'resolved, negligible: < 0.25%'."""
    thr = f"{100 * MATERIAL_REL:g}%"
    return f"material, >= {thr}" if kind == "material" else f"resolved, negligible: < {thr}"


VERDICT_ORDER = {"better": 0, "indistinguishable": 1, "one seed": 1, "worse": 3, "diverged": 4, "no data": 5}
"""Ranking of verdicts inside a group: resolved ones by gap; arms whose interval holds 0 (or that have
no interval) share one rank and are listed alphabetically, since their point estimates do not order them."""
UNRESOLVED = ("indistinguishable", "one seed")
