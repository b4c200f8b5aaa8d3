"""Gap forecasts: the paired per-seed gap to BF16 as a function of tokens, fitted and extrapolated to
the user's budget with a prediction interval, or refused with the reason.

Data: for each seed of an arm, the raw train-loss gap to the BF16 run of the same seed at every logged
step, relative to that BF16 loss, past the early transient (`pairing.EARLY_FRAC` of the tokens).

Family (linear in its parameters, so every fit is ordinary least squares with a closed-form
prediction variance): `constant` g = a, and `decay(c)` g = a + b (t / t0)^-c for c in `EXPONENTS`
(t0 = the first fitted token). The member is chosen by hold-out: each is fitted on the first
`1 - HOLDOUT` of the points and scored on the rest; the lowest squared error wins (ties go to the
simpler). The chosen member is refitted on every point.

Prediction at tokens T for one seed: the fit's value with the OLS prediction variance
s^2 (x0' (X'X)^-1 x0 + 1/m), m = the points the target is averaged over (the final smoothing window);
the arm's forecast is the mean over seeds with a t interval over the per-seed predictions (one seed:
that seed's prediction interval).

Refusals, each with its reason: fewer than `MIN_POINTS` points past the early transient; a chosen fit
whose own hold-out mean falls outside its prediction interval; a target beyond `VALIDATED_RATIO` times
the measured tokens, the largest extrapolation ratio at which `python -m benchmarks forecast_check`
measured coverage of at least 90% of nominal (benchmarks/RESULTS.md).

Equal quality at a target loss (`--target-loss L`): BF16's tokens to L from the loss fit
e + b (t/t0)^-c on the BF16 runs' pooled raw points past the early transient (`loss_fit`: c on a grid,
e no lower than the data's loss floor), the arm's from it and its gap forecast there. forecast_check
checks that fit as the gap's (fit on the first 1/r of each BF16 run, its prediction interval against
the run's final loss); an answer whose BF16 tokens lie beyond `LOSS_VALIDATED_RATIO` times the measured
tokens (the measured tokens themselves while no ratio is validated) is refused with the figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

from analysis import keys as K
from analysis import stats as S
from analysis.pairing import EARLY_FRAC, Arm, Baseline, Group
from analysis.run import Run

EXPONENTS = (0.5, 1.0)
HOLDOUT = 0.3
MIN_POINTS = 5
VALIDATED_RATIO = 1.5
"""Largest target/measured token ratio at which forecast_check's coverage was >= 90% of nominal."""
VALIDATED_TEXT = (
    "forecast_check measured 95% coverage of the 95% interval over 64 forecasts at 1.5x, 83% over 58 at "
    "2x, 61% over 33 at 3x; benchmarks/RESULTS.md 'Gap forecasts'"
)


@dataclass(frozen=True)
class Fit:
    """One member of the family fitted to (tokens, gap) points."""

    name: str
    beta: np.ndarray
    xtx_inv: np.ndarray
    s2: float
    df: int
    t0: float
    c: float | None

    def design(self, t: np.ndarray) -> np.ndarray:
        return design(t, self.t0, self.c)

    def predict(self, t: float, m: int = 1) -> tuple[float, float]:
        """(value, prediction standard error) at tokens t for the mean of m new points."""
        x0 = self.design(np.array([t], dtype=float))[0]
        var = self.s2 * (float(x0 @ self.xtx_inv @ x0) + 1.0 / m)
        return float(x0 @ self.beta), math.sqrt(max(var, 0.0))

    def interval(self, t: float, m: int = 1) -> tuple[float, float, float]:
        y, se = self.predict(t, m)
        half = float(_st.t.ppf(0.5 + S.LEVEL / 2, max(self.df, 1))) * se
        return y, y - half, y + half


def design(t: np.ndarray, t0: float, c: float | None) -> np.ndarray:
    ones = np.ones_like(t, dtype=float)
    return ones[:, None] if c is None else np.column_stack([ones, (t / t0) ** -c])


def fit(t: np.ndarray, y: np.ndarray, c: float | None, t0: float | None = None) -> Fit | None:
    """OLS fit of one member (c=None: constant); None with too few points for its parameters."""
    t0 = float(t[0]) if t0 is None else t0
    x = design(t, t0, c)
    n, p = x.shape
    if n <= p:
        return None
    xtx_inv = np.linalg.pinv(x.T @ x)
    beta = xtx_inv @ x.T @ y
    resid = y - x @ beta
    s2 = float(resid @ resid / (n - p))
    name = "constant" if c is None else f"a + b (t/t0)^-{c:g}"
    return Fit(name, beta, xtx_inv, s2, n - p, t0, c)


def choose(t: np.ndarray, y: np.ndarray) -> tuple[Fit | None, str | None]:
    """The family member with the lowest hold-out error, refitted on all points; or the refusal."""
    if len(t) < MIN_POINTS:
        return None, f"{len(t)} points past the early transient (needs >= {MIN_POINTS})"
    cut = max(2, int(round(len(t) * (1 - HOLDOUT))))
    best, best_err, best_head = None, math.inf, None
    for c in (None, *EXPONENTS):
        head = fit(t[:cut], y[:cut], c, float(t[0]))
        if head is None:
            continue
        err = float(np.mean((y[cut:] - head.design(t[cut:]) @ head.beta) ** 2))
        if err < best_err - 1e-15:
            best, best_err, best_head = c, err, head
    if best_head is None:
        return None, "too few points to hold any out"
    _, lo, hi = best_head.interval(float(np.mean(t[cut:])), len(t) - cut)
    held = float(np.mean(y[cut:]))
    if not lo <= held <= hi:
        return None, (f"the chosen fit ({best_head.name}) fails its own hold-out: the last {len(t) - cut} "
                      f"points average {100 * held:+.3f}%, outside its interval "
                      f"[{100 * lo:+.3f}, {100 * hi:+.3f}]%")  # fmt: skip
    return fit(t, y, best, float(t[0])), None


def seed_gap(run: Run, bf16: Run, until: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Relative raw train-loss gap of `run` to `bf16` (same seed) at the run's logged tokens, past the
    early transient of the run's budget and up to `until` tokens."""
    t, y = run.train[K.TOKENS], run.train.get(K.LOSS_TRAIN)
    tb, yb = bf16.train[K.TOKENS], bf16.train.get(K.LOSS_TRAIN)
    if y is None or yb is None or not len(t):
        return np.zeros(0), np.zeros(0)
    ok = np.isfinite(y)
    ref = np.interp(t, tb[np.isfinite(yb)], yb[np.isfinite(yb)], left=np.nan, right=np.nan)
    budget = run.token_budget or float(t[-1])
    keep = ok & np.isfinite(ref) & (t >= EARLY_FRAC * budget) & (t <= (until if until else math.inf))
    return t[keep].astype(float), (y[keep] - ref[keep]) / ref[keep]


@dataclass(frozen=True)
class Forecast:
    """An arm's gap forecast at `target` tokens: mean [lo, hi] relative to BF16, or `refused`."""

    arm: str
    target: float
    measured: float
    mean: float | None = None
    lo: float | None = None
    hi: float | None = None
    family: str = ""
    seeds: int = 0
    refused: str | None = None

    def text(self) -> str:
        where = f"at {_tokens(self.target)} tokens ({self.target / self.measured:.3g}x the measured budget)"
        if self.refused:
            return f"{self.arm}: no forecast {where}: {self.refused}"
        ci = f"[{100 * self.lo:+.2f}, {100 * self.hi:+.2f}]%"
        return (f"{self.arm}: gap {where} {100 * self.mean:+.2f}% {ci} ({S.LEVEL:.0%} prediction interval "
                f"over {self.seeds} seed(s); fit {self.family})")  # fmt: skip


def _tokens(v: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.0f}"


Prediction = tuple[float, float, float]


def seed_prediction(run: Run, bf16: Run, target: float, until: float | None = None,
                    m: int = 1) -> tuple[Fit | None, str | None, Prediction | None]:  # fmt: skip
    """(fit, refusal, (value, lo, hi) at target) for one arm seed against its BF16 seed."""
    t, y = seed_gap(run, bf16, until)
    f, why = choose(t, y)
    if f is None:
        return None, why, None
    return f, None, f.interval(target, m)


def arm_forecast(arm: Arm, group: Group, target: float, ratio: float = VALIDATED_RATIO) -> Forecast:
    """The arm's gap at `target` tokens from its seeds paired with BF16 seeds, or the refusal."""
    measured = float(group.key.tokens or 0)
    base = group.baseline
    out = dict(arm=arm.name, target=float(target), measured=measured or float(target))
    if not measured or base is None:
        return Forecast(**out, refused="no BF16 baseline or token budget")
    if target > ratio * measured * (1 + 1e-9):
        why = (f"beyond {ratio:g}x the measured {_tokens(measured)} tokens, the largest extrapolation ratio "
               f"validated ({VALIDATED_TEXT})")  # fmt: skip
        return Forecast(**out, refused=why)
    preds, fits, reasons = [], [], []
    for x in arm.results:
        j = base.run_for_seed(x.run.seed)
        if j is None or x.run.status != K.COMPLETED:
            continue
        f, why, p = seed_prediction(x.run, base.runs[j], target)
        if why:
            reasons.append(f"seed {x.run.seed}: {why}")
        else:
            preds.append(p)
            fits.append(f.name)
    if reasons or not preds:
        return Forecast(**out, refused="; ".join(reasons) or "no completed seed paired with a BF16 seed")
    vals = np.array([p[0] for p in preds])
    if len(vals) == 1:
        mean, lo, hi = preds[0]
    else:
        iv = S.one_sample(vals)
        mean, lo, hi = iv.mean, iv.lo, iv.hi
    family = ", ".join(f"{n} x{fits.count(n)}" for n in dict.fromkeys(fits))
    return Forecast(**out, mean=mean, lo=lo, hi=hi, family=family, seeds=len(vals))


def group_forecasts(group: Group, target: float | None) -> list[Forecast]:
    """Every low-precision arm's forecast at `target` tokens (default: the validated ratio x budget)."""
    if not group.key.tokens:
        return []
    target = target or VALIDATED_RATIO * group.key.tokens
    return [arm_forecast(a, group, target) for a in group.arms if a.role != "baseline"]


# --- equal quality at a target loss ---------------------------------------------------------------

LOSS_EXPONENTS = np.linspace(0.05, 1.5, 59)
LOSS_VALIDATED_RATIO: float | None = None
"""Largest target/measured token ratio at which forecast_check's coverage of the BF16 loss fit was
>= 90% of nominal over enough forecasts (None: none, so --target-loss answers only within the budget)."""
LOSS_VALIDATED_TEXT = (
    "forecast_check measured the BF16 loss fit's coverage of its 95% interval at 80% over 10 forecasts at "
    "1.5x (9 of 19 BF16 runs refused), 10% over 10 at 2x, against >= 85.5% over >= 30 needed; "
    "benchmarks/RESULTS.md 'Gap forecasts'"
)


def loss_fit(t: np.ndarray, y: np.ndarray, floor: float | None = None) -> tuple[Fit | None, str | None]:
    """BF16 loss L(t) = e + b (t/t0)^-c (t0 the first point; c on a grid, e and b by least squares:
    the member with the lowest squared error whose asymptote e is no lower than the data's loss floor,
    when known, and whose b > 0), as a `Fit` with its prediction interval (c taken as known); or the
    refusal."""
    if len(t) < MIN_POINTS:
        return None, f"{len(t)} BF16 points past the early transient (needs >= {MIN_POINTS})"
    best, best_err = None, math.inf
    for c in LOSS_EXPONENTS:
        f = fit(t, y, float(c), float(t[0]))
        err = f.s2 * f.df
        if f.beta[1] > 0 and (floor is None or f.beta[0] >= floor) and err < best_err:
            best, best_err = f, err
    if best is None:
        above = "" if floor is None else f"e >= the loss floor {floor:.3f}, "
        return None, f"BF16's loss curve does not fit e + b (t/t0)^-c with {above}b > 0"
    return best, None


def loss_text(f: Fit) -> str:
    e, b = f.beta
    return f"{e:.3f} + {b:.3g} (t/{_tokens(f.t0)})^-{f.c:.2f}"


def tokens_to_loss(target_loss: float, f: Fit) -> float | None:
    """Tokens at which the fitted loss reaches `target_loss` (None at or below its asymptote)."""
    e, b = f.beta
    return None if target_loss <= e else float(f.t0 * (b / (target_loss - e)) ** (1 / f.c))


def bf16_points(base: Baseline) -> tuple[np.ndarray, np.ndarray]:
    """The BF16 runs' raw train loss against tokens past the early transient, pooled and sorted."""
    ts, ys = [], []
    for run in base.runs:
        t, y = run.train[K.TOKENS], run.train.get(K.LOSS_TRAIN)
        if y is None:
            continue
        keep = np.isfinite(y) & (t >= EARLY_FRAC * (run.token_budget or float(t[-1])))
        ts.append(t[keep].astype(float))
        ys.append(y[keep].astype(float))
    t, y = (np.concatenate(ts), np.concatenate(ys)) if ts else (np.zeros(0), np.zeros(0))
    order = np.argsort(t, kind="stable")
    return t[order], y[order]


def bf16_loss_fit(base: Baseline) -> tuple[Fit | None, str | None]:
    """`loss_fit` on the BF16 runs' pooled raw points, above the lowest loss floor they state."""
    floors = [r.loss_floor for r in base.runs if r.loss_floor is not None]
    return loss_fit(*bf16_points(base), min(floors) if floors else None)


def loss_refusal(t_b: float, measured: float) -> str | None:
    """Why BF16's tokens to the target loss are beyond the validated extrapolation of its loss fit."""
    ratio = LOSS_VALIDATED_RATIO or 1.0
    if t_b <= ratio * measured * (1 + 1e-9):
        return None
    validated = (f"{ratio:g}x the measured {_tokens(measured)} tokens, the largest extrapolation ratio "
                 f"of the BF16 loss fit validated" if LOSS_VALIDATED_RATIO
                 else f"the measured {_tokens(measured)} tokens: no extrapolation ratio of the BF16 loss "
                      "fit was validated")  # fmt: skip
    needs = f"BF16 needs about {_tokens(t_b)} tokens ({t_b / measured:.3g}x)"
    return f"{needs}, beyond {validated} ({LOSS_VALIDATED_TEXT})"


def equal_quality(group: Group, target_loss: float) -> list[str]:
    """Per arm: BF16's and the arm's forecast tokens to `target_loss` and their ratio (token
    efficiency at equal loss), or why not. BF16's tokens come from the loss fit on its runs' raw
    points; the arm's loss is BF16's fit x (1 + its forecast gap at the tokens BF16 needs)."""
    base = group.baseline
    if base is None or not group.key.tokens:
        return ["equal quality: no BF16 baseline"]
    f, why = bf16_loss_fit(base)
    measured = float(group.key.tokens)
    at = f"equal quality at loss {target_loss:g}"
    if f is None:
        return [f"{at}: refused, {why}"]
    t_b = tokens_to_loss(target_loss, f)
    head = f"BF16 loss fit {loss_text(f)}"
    if t_b is None:
        return [f"{at}: refused, below the fitted BF16 asymptote {f.beta[0]:.3f} ({head})"]
    if why := loss_refusal(t_b, measured):
        return [f"{at}: refused, {why}; {head}"]
    _, lo, hi = f.interval(t_b)
    lines = [f"{at}: BF16 reaches it at about {_tokens(t_b)} tokens ({head}; {S.LEVEL:.0%} prediction "
             f"interval of its loss there [{lo:.4f}, {hi:.4f}])"]  # fmt: skip
    for fc in group_forecasts(group, t_b):
        if fc.refused:
            lines.append(f"{fc.arm}: no equal-quality forecast: {fc.refused}")
            continue
        ends = []
        for gap in (fc.lo, fc.mean, fc.hi):
            t_a = tokens_to_loss(target_loss / (1 + gap), f)
            ends.append(None if t_a is None else t_b / t_a)
        if ends[1] is None or None in ends:
            lines.append(f"{fc.arm}: loss {target_loss:g} is out of reach under its forecast gap")
            continue
        lo, hi = sorted((ends[0], ends[2]))
        lines.append(f"{fc.arm}: token efficiency at loss {target_loss:g} (BF16 tokens / arm tokens) "
                     f"{ends[1]:.3f}x [{lo:.3f}, {hi:.3f}] (from the gap forecast's interval at "
                     f"{_tokens(fc.target)} tokens)")  # fmt: skip
    return lines
