"""Loss curves on the tokens axis: trailing smoothing, first crossings, cumulative wall time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis import keys as K
from analysis.run import Run


def smooth(tokens: np.ndarray, values: np.ndarray, window: float) -> np.ndarray:
    """Trailing mean of `values` over the logged points with tokens in (t - window, t]."""
    c = np.concatenate([[0.0], np.cumsum(values)])
    lo = np.searchsorted(tokens, tokens - window, side="right")
    hi = np.arange(1, len(values) + 1)
    return (c[hi] - c[lo]) / (hi - lo)


def first_crossing(x: np.ndarray, y: np.ndarray, target: float) -> float | None:
    """First x where y falls to `target` or below, interpolated linearly between points."""
    below = np.flatnonzero(y <= target)
    if not len(below):
        return None
    i = int(below[0])
    if i == 0:
        return float(x[0])
    y0, y1 = y[i - 1], y[i]
    return float(x[i - 1] + (x[i] - x[i - 1]) * (y0 - target) / (y0 - y1))


@dataclass(eq=False)
class Curve:
    """A run's finite train-loss points: raw, smoothed, and cumulative training wall time."""

    tokens: np.ndarray
    raw: np.ndarray
    smooth: np.ndarray
    wall_s: np.ndarray | None

    def at(self, grid: np.ndarray, what: str = "smooth") -> np.ndarray:
        y = self.smooth if what == "smooth" else self.wall_s
        return np.interp(grid, self.tokens, y, left=np.nan, right=np.nan)


def wall_seconds(run: Run) -> np.ndarray | None:
    """Cumulative training time at each train row, from `time/step_ms` (else tokens / tokens_per_s)."""
    step, ms = run.train[K.STEP], run.train.get(K.STEP_MS)
    if ms is not None and np.isfinite(ms).any():
        ms = np.where(np.isfinite(ms), ms, np.nanmedian(ms))
        return np.cumsum(np.diff(step, prepend=0.0).clip(min=0) * ms) / 1000.0
    tps = run.tokens_per_s
    return run.train[K.TOKENS] / tps if tps else None


def run_curve(run: Run, window: float) -> Curve | None:
    loss = run.train.get(K.LOSS_TRAIN)
    if loss is None:
        return None
    ok = np.isfinite(loss)
    if not ok.any():
        return None
    tokens = run.train[K.TOKENS][ok]
    wall = wall_seconds(run)
    return Curve(tokens, loss[ok], smooth(tokens, loss[ok], window), None if wall is None else wall[ok])
