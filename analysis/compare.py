"""Pair every low-precision run with the BF16 runs of its group and measure what it costs.

Groups are (hardware, model, data, token budget), as architecture.md says; nothing is compared across
groups. Inside a group:

- **Smoothing.** Train loss is smoothed by a trailing mean over the logged points of the last
  `smooth_frac` of the token budget (default 5%), the same window for every run of the group, so
  lags cancel in differences. "Final train loss" is the last smoothed value.
- **Pairing.** A run whose seed matches a BF16 seed is compared with that seed (same data order and
  init); otherwise with the mean of all BF16 seeds. Runs of the baseline are always compared with the mean.
- **Band.** Over the BF16 seeds, on a common token grid: min/max and mean +- 2 sigma (sample std); a
  gap "leaves the band" when it lies outside the wider of the two. One BF16 seed gives no band.
- **Curves.** Every curve is interpolated linearly onto the grid, so different logging cadences compare.
- **Time to the BF16 loss.** The target is the reference's final smoothed train loss; tokens to
  target is the first crossing of the run's smoothed curve (linear between logged points), None when
  the run never gets there. Wall time is the sum of logged step times (`time/step_ms` times the steps
  since the previous log row; evals and start-up excluded).
- **Equal quality.** A run that ends worse than BF16 never reaches the BF16 final loss, so both sides
  are measured at q = the worse of the two final losses, which both curves reach within the budget:
  token efficiency = BF16 tokens to q / run tokens to q (numerics, every backend); speedup at equal
  quality = BF16 wall time to q / run wall time to q (native only). A faster recipe that needs more
  tokens for the same loss loses part of its throughput gain here.
- **Speed and memory** compare native (`te`) runs with native BF16 runs only (same hardware by
  construction of the group); emulated runs contribute numerics, never speed ("n/a (emulated)").
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from analysis import keys as K
from analysis.curves import Curve, first_crossing, run_curve
from analysis.run import Run

SMOOTH_FRAC = 0.05
GRID_POINTS = 200
EARLY_FRAC = 0.1
"""Curve statistics skip the first 10% of tokens, where the loss falls fast and gaps are transients."""

PUBLIC_ANCHORS: dict[str, tuple[float, str]] = {
    "blockwise": (0.0025, "DeepSeek-V3 FP8 blockwise: < 0.25% relative loss gap"),
    "nvfp4": (0.015, "NVFP4 12B/10T tokens: < 1% stable phase, ~1.5% after decay"),
}
"""Relative loss gaps published for a recipe (anchors.md "Public anchors"), at far larger scale."""

COLUMNS = (
    "hardware", "model", "data", "tokens", "recipe", "variant", "backend", "role", "runs", "seeds",
    "status", "divergence", "baseline", "pairing", "gap_metric",
    "final_train_loss", "bf16_final_train_loss", "train_gap_abs", "train_gap_rel",
    "final_eval_loss", "bf16_final_eval_loss", "eval_gap_abs", "eval_gap_rel",
    "gap_rel", "bf16_band_min", "bf16_band_max", "bf16_band_2sigma", "leaves_band",
    "curve_gap_rel_mean", "curve_gap_rel_max", "curve_frac_outside_band",
    "public_anchor", "within_anchor",
    "target_loss", "reached_target", "tokens_to_target", "wall_to_target_s",
    "equal_quality_loss", "token_efficiency", "speedup_equal_quality",
    "tokens_per_s", "throughput_ratio", "peak_mem_gib", "memory_ratio",
    "mfu_bf16_peak", "speed_note", "obtained",
)  # fmt: skip


# --- groups and baselines -------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupKey:
    hardware: str | None
    model: str | None
    data: str | None
    tokens: int | None

    def __str__(self) -> str:
        return f"hardware={self.hardware}, model={self.model}, data={self.data}, tokens={self.tokens}"

    @property
    def slug(self) -> str:
        s = f"{self.hardware}_{self.model}_{self.data}_{self.tokens}"
        return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in s)


def group_key(run: Run) -> GroupKey:
    return GroupKey(run.hardware, run.model, run.data, run.token_budget)


@dataclass
class Baseline:
    """The completed BF16 runs of one variant in a group, and their band on the group's grid."""

    runs: list[Run]
    variant: str
    curves: list[Curve | None]
    grid: np.ndarray
    stack: np.ndarray
    """(n_runs, grid) smoothed train loss; NaN where a run has no value."""
    notes: list[str] = field(default_factory=list)

    @property
    def seeds(self) -> list[int | None]:
        return [r.seed for r in self.runs]

    @property
    def native(self) -> list[Run]:
        return [r for r in self.runs if r.is_native]

    @cached_property
    def band(self) -> dict[str, np.ndarray]:
        """mean, min, max, std over seeds on the grid (std NaN where fewer than two seeds have data)."""
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: NaN is the answer
            n = np.isfinite(self.stack).sum(0)
            std = np.nanstd(self.stack, 0, ddof=1) if len(self.runs) > 1 else np.full(self.grid.shape, np.nan)
            return {
                "mean": np.nanmean(self.stack, 0),
                "min": np.nanmin(self.stack, 0),
                "max": np.nanmax(self.stack, 0),
                "std": np.where(n > 1, std, np.nan),
            }

    @property
    def late(self) -> np.ndarray:
        """Grid points past the first EARLY_FRAC of tokens, where curve statistics are taken."""
        return self.grid >= EARLY_FRAC * self.grid[-1]

    def run_for_seed(self, seed: int | None) -> int | None:
        for i, r in enumerate(self.runs):
            if seed is not None and r.seed == seed and self.curves[i] is not None:
                return i
        return None


def _pick_baseline_variant(bf16: list[Run]) -> str | None:
    variants = Counter(r.variant for r in bf16)
    if not variants:
        return None
    return K.DEFAULT_VARIANT if K.DEFAULT_VARIANT in variants else variants.most_common(1)[0][0]


def build_baseline(runs: list[Run], budget: int | None, window: float) -> Baseline | None:
    bf16 = [r for r in runs if r.is_baseline and r.status == K.COMPLETED]
    variant = _pick_baseline_variant(bf16)
    if variant is None:
        return None
    chosen = [r for r in bf16 if r.variant == variant]
    curves = [run_curve(r, window) for r in chosen]
    notes = [
        f"BF16 run {r.name} has no train-loss curve" for r, c in zip(chosen, curves, strict=True) if c is None
    ]
    ok = [c for c in curves if c is not None]
    if ok:
        lo, hi = max(c.tokens[0] for c in ok), min(c.tokens[-1] for c in ok)
    else:
        lo = hi = float(budget or 0)
    grid = np.linspace(lo, hi, GRID_POINTS) if hi > lo else np.array([hi], dtype=float)
    stack = np.array([c.at(grid) if c is not None else np.full(grid.shape, np.nan) for c in curves])
    seeds = Counter(r.seed for r in chosen)
    notes += [f"{n} BF16 runs share seed {s}: pairing uses the first" for s, n in seeds.items() if n > 1]
    return Baseline(chosen, variant, curves, grid, stack, notes)


# --- per-run comparison ---------------------------------------------------------------------------


@dataclass
class RunResult:
    """One run measured against its reference (a paired BF16 seed, or the BF16 mean)."""

    run: Run
    reference: str
    paired: bool
    curve: Curve | None
    gap_curve: np.ndarray | None = None
    """Smoothed train-loss gap to the reference on the baseline grid (NaN where the run has no data)."""
    gap_vs_mean: np.ndarray | None = None
    final_train: float | None = None
    ref_final_train: float | None = None
    final_eval: float | None = None
    ref_final_eval: float | None = None
    frac_outside_band: float | None = None
    target_loss: float | None = None
    """The reference's final smoothed train loss."""
    tokens_to_target: float | None = None
    wall_to_target: float | None = None
    equal_quality_loss: float | None = None
    """The worse of the run's and the reference's final smoothed train loss."""
    tokens_at_q: float | None = None
    ref_tokens_at_q: float | None = None
    wall_at_q: float | None = None
    ref_wall_at_q: float | None = None
    """Mean over the native BF16 reference runs; None when there are none."""

    @property
    def train_gap(self) -> float | None:
        return _diff(self.final_train, self.ref_final_train)

    @property
    def eval_gap(self) -> float | None:
        return _diff(self.final_eval, self.ref_final_eval)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _rel(gap: float | None, ref: float | None) -> float | None:
    return None if gap is None or not ref else gap / ref


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else None


def band_edges(band: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The wider of min/max and mean +- 2 sigma, as offsets from the mean."""
    lo = np.fmin(band["min"] - band["mean"], -2 * band["std"])
    hi = np.fmax(band["max"] - band["mean"], 2 * band["std"])
    return lo, hi


def compare_run(run: Run, base: Baseline, window: float) -> RunResult:
    in_base = any(run is b for b in base.runs)
    j = None if in_base else base.run_for_seed(run.seed)
    ref_curve = base.curves[j] if j is not None else None
    if j is not None:
        reference = f"BF16 seed {run.seed} (paired)"
    else:
        reference = "BF16 mean of seeds " + ", ".join(map(str, base.seeds))
    res = RunResult(run, reference, j is not None, run_curve(run, window))
    band = base.band
    mean_final = _mean([c.smooth[-1] for c in base.curves if c is not None])
    evals = [r.final_eval_loss for r in base.runs]
    res.ref_final_train = float(ref_curve.smooth[-1]) if ref_curve else mean_final
    res.ref_final_eval = base.runs[j].final_eval_loss if j is not None else _mean(evals)
    if res.curve is not None:
        run_g = res.curve.at(base.grid)
        res.gap_vs_mean = run_g - band["mean"]
        res.gap_curve = run_g - base.stack[j] if j is not None else res.gap_vs_mean
        late = base.late & np.isfinite(res.gap_vs_mean)
        lo, hi = band_edges(band)
        if late.any() and np.isfinite(band["std"][late]).any():
            out = (res.gap_vs_mean[late] < lo[late]) | (res.gap_vs_mean[late] > hi[late])
            res.frac_outside_band = float(out.mean())
    if run.status == K.COMPLETED:
        res.final_eval = run.final_eval_loss
        if res.curve is not None:
            res.final_train = float(res.curve.smooth[-1])
        _time_to_target(res, base, ref_curve)
    return res


def _time_to_target(res: RunResult, base: Baseline, ref_curve: Curve | None) -> None:
    """Tokens (and wall time) to the reference's final loss, and both sides at equal quality."""
    res.target_loss = res.ref_final_train
    if res.curve is None or res.target_loss is None or res.final_train is None:
        return
    c = res.curve
    res.tokens_to_target = first_crossing(c.tokens, c.smooth, res.target_loss)
    if res.tokens_to_target is not None and c.wall_s is not None:
        res.wall_to_target = float(np.interp(res.tokens_to_target, c.tokens, c.wall_s))
    # Equal quality: the worse of the two final losses, which both curves reach within the budget.
    q = max(res.final_train, res.target_loss)
    res.equal_quality_loss = q
    res.tokens_at_q = first_crossing(c.tokens, c.smooth, q)
    if ref_curve is not None:
        res.ref_tokens_at_q = first_crossing(ref_curve.tokens, ref_curve.smooth, q)
    else:  # the BF16 mean curve; it may end a hair above the mean of finals: then its last point
        mean = base.band["mean"]
        ok = np.isfinite(mean)
        crossing = first_crossing(base.grid[ok], mean[ok], q)
        res.ref_tokens_at_q = crossing if crossing is not None else float(base.grid[ok][-1])
    if c.wall_s is not None and res.tokens_at_q is not None:
        res.wall_at_q = float(np.interp(res.tokens_at_q, c.tokens, c.wall_s))
    native = [x for x, r in zip(base.curves, base.runs, strict=True) if x is not None and r.is_native]
    if any(x is ref_curve for x in native):
        native = [ref_curve]
    if res.ref_tokens_at_q is not None:
        walls = [
            float(np.interp(res.ref_tokens_at_q, x.tokens, x.wall_s)) for x in native if x.wall_s is not None
        ]
        res.ref_wall_at_q = _mean(walls)


# --- arms: one row per (recipe, variant, backend) of a group ---------------------------------------


@dataclass
class Arm:
    key: GroupKey
    recipe: str | None
    variant: str
    backend: str | None
    role: str
    """`baseline` (the BF16 runs the group is measured against) or `arm`."""
    runs: list[Run]
    results: list[RunResult]
    row: dict[str, Any] = field(default_factory=dict)


@dataclass
class Group:
    key: GroupKey
    runs: list[Run]
    baseline: Baseline | None
    arms: list[Arm]
    notes: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    runs: list[Run]
    groups: list[Group]
    smooth_frac: float = SMOOTH_FRAC

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One row per arm, in `COLUMNS` order."""
        return [a.row for g in self.groups for a in g.arms]

    @property
    def notes(self) -> list[str]:
        return [f"[{g.key}] {n}" for g in self.groups for n in g.notes]


def _status_text(runs: list[Run]) -> tuple[str, str]:
    counts = Counter(r.status for r in runs)
    status = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    div = []
    for r in runs:
        if r.status == K.DIVERGED or r.get("diverged_step") is not None:
            cause = (r.summary or {}).get("divergence_cause") or "cause not recorded"
            div.append(f"seed {r.seed} @ step {(r.summary or {}).get('diverged_step')}: {cause}")
        elif r.status == K.FAILED:
            div.append(f"seed {r.seed} failed: {(r.summary or {}).get('error') or 'no error recorded'}")
    return status, "; ".join(div)


def _speed(arm_runs: list[Run], base: Baseline | None) -> tuple[dict[str, Any], str]:
    """Throughput and memory of native runs against native BF16 runs, or the reason there are none."""
    if not any(r.backend for r in arm_runs):
        return {}, "n/a (backend unknown)"
    if any(r.backend == K.EMULATED_BACKEND for r in arm_runs):
        return {}, "n/a (emulated)"
    if not all(r.is_native for r in arm_runs):
        return {}, f"n/a (backend {arm_runs[0].backend})"
    done = [r for r in arm_runs if r.status == K.COMPLETED]
    if not done:
        return {}, "n/a (no completed run)"
    out = {
        "tokens_per_s": _mean([r.tokens_per_s for r in done]),
        "peak_mem_gib": _mean([r.peak_mem_gib for r in done]),
        "mfu_bf16_peak": _mean([r.summary_number("mfu_bf16_peak") for r in done]),
    }
    if base is None or not base.native:
        return out, "n/a (no native BF16 baseline)"
    b_tps = _mean([r.tokens_per_s for r in base.native])
    b_mem = _mean([r.peak_mem_gib for r in base.native])
    if out["tokens_per_s"] and b_tps:
        out["throughput_ratio"] = out["tokens_per_s"] / b_tps
    if out["peak_mem_gib"] and b_mem:
        out["memory_ratio"] = out["peak_mem_gib"] / b_mem
    return out, ""


def _obtained(arm_runs: list[Run], base: Baseline | None) -> str:
    def desc(runs: list[Run]) -> str:
        backends = ",".join(sorted({str(r.backend) for r in runs}))
        hw = ",".join(sorted({str(r.hardware) for r in runs}))
        seeds = ",".join(str(r.seed) for r in runs)
        steps = ",".join(sorted({str(r.steps) for r in runs}))
        return f"backend={backends} hardware={hw} seeds={seeds} steps={steps}"

    s = desc(arm_runs)
    if base is not None:
        s += f"; BF16 [{base.variant}]: {desc(base.runs)}"
    return s


def _arm_row(arm: Arm, base: Baseline | None, missing: str) -> dict[str, Any]:
    runs, key = arm.runs, arm.key
    status, divergence = _status_text(runs)
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(
        hardware=key.hardware, model=key.model, data=key.data, tokens=key.tokens, recipe=arm.recipe,
        variant=arm.variant, backend=arm.backend, role=arm.role, runs=len(runs),
        seeds=",".join(str(r.seed) for r in runs), status=status, divergence=divergence,
        obtained=_obtained(runs, base),
    )  # fmt: skip
    speed, note = _speed(runs, base)
    row.update(speed)
    row["speed_note"] = note
    if base is None:
        row["baseline"] = missing
        row["final_eval_loss"] = _mean([r.final_eval_loss for r in runs if r.status == K.COMPLETED])
        return row
    row["baseline"] = f"bf16 [{base.variant}] seeds " + ",".join(map(str, base.seeds))
    _loss_columns(row, arm, base)
    return row


def _loss_columns(row: dict[str, Any], arm: Arm, base: Baseline) -> None:
    done = [x for x in arm.results if x.run.status == K.COMPLETED]
    paired = sum(x.paired for x in done)
    row["pairing"] = (
        "no completed run" if not done else "paired by seed" if paired == len(done)
        else "vs BF16 mean" if paired == 0 else f"paired {paired}/{len(done)}, rest vs BF16 mean"
    )  # fmt: skip
    row["final_train_loss"] = _mean([x.final_train for x in done])
    row["bf16_final_train_loss"] = _mean([x.ref_final_train for x in done])
    row["train_gap_abs"] = _mean([x.train_gap for x in done])
    row["train_gap_rel"] = _rel(row["train_gap_abs"], row["bf16_final_train_loss"])
    row["final_eval_loss"] = _mean([x.final_eval for x in done])
    row["bf16_final_eval_loss"] = _mean([x.ref_final_eval for x in done])
    row["eval_gap_abs"] = (
        _mean([x.eval_gap for x in done]) if all(x.eval_gap is not None for x in done) else None
    )
    row["eval_gap_rel"] = _rel(row["eval_gap_abs"], row["bf16_final_eval_loss"])
    use_eval = row["eval_gap_rel"] is not None and all(r.final_eval_loss is not None for r in base.runs)
    row["gap_metric"] = "loss/eval" if use_eval else "loss/train (smoothed)"
    row["gap_rel"] = row["eval_gap_rel"] if use_eval else row["train_gap_rel"]
    _band_columns(row, arm, base, use_eval)
    late = base.late
    rel = [x.gap_curve[late] / base.band["mean"][late] for x in arm.results if x.gap_curve is not None]
    rel = [g[np.isfinite(g)] for g in rel]
    row["curve_gap_rel_mean"] = _mean([float(g.mean()) for g in rel if len(g)])
    row["curve_gap_rel_max"] = max((float(g.max()) for g in rel if len(g)), default=None)
    row["curve_frac_outside_band"] = _mean([x.frac_outside_band for x in arm.results])
    anchor = PUBLIC_ANCHORS.get(str(arm.recipe))
    if anchor:
        row["public_anchor"] = anchor[1]
        row["within_anchor"] = None if row["gap_rel"] is None else bool(row["gap_rel"] <= anchor[0])
    if arm.role != "baseline":
        _quality_columns(row, done)


def _band_columns(row: dict[str, Any], arm: Arm, base: Baseline, use_eval: bool) -> None:
    if use_eval:
        finals = [r.final_eval_loss for r in base.runs]
    else:
        finals = [float(c.smooth[-1]) for c in base.curves if c is not None]
    finals = np.array([f for f in finals if f is not None], dtype=float)
    if not len(finals):
        return
    mean = float(finals.mean())
    row["bf16_band_min"], row["bf16_band_max"] = float(finals.min()), float(finals.max())
    if len(finals) < 2:
        row["leaves_band"] = "n/a (1 BF16 seed)"
        return
    two_sigma = 2 * float(finals.std(ddof=1))
    row["bf16_band_2sigma"] = two_sigma
    value = row["final_eval_loss"] if use_eval else row["final_train_loss"]
    if value is None:
        row["leaves_band"] = "n/a (no completed run)"
        return
    lo, hi = min(finals.min(), mean - two_sigma), max(finals.max(), mean + two_sigma)
    row["leaves_band"] = "above" if value > hi else "below" if value < lo else "inside"


def _quality_columns(row: dict[str, Any], done: list[RunResult]) -> None:
    if not done:
        return
    row["target_loss"] = _mean([x.target_loss for x in done])
    reached = [x for x in done if x.tokens_to_target is not None]
    row["reached_target"] = f"{len(reached)}/{len(done)}"
    if len(reached) == len(done):
        row["tokens_to_target"] = _mean([x.tokens_to_target for x in done])
        if not row["speed_note"]:
            row["wall_to_target_s"] = _mean([x.wall_to_target for x in done])
    row["equal_quality_loss"] = _mean([x.equal_quality_loss for x in done])
    if all(x.tokens_at_q and x.ref_tokens_at_q for x in done):
        row["token_efficiency"] = _mean([x.ref_tokens_at_q / x.tokens_at_q for x in done])
    if not row["speed_note"] and all(x.wall_at_q and x.ref_wall_at_q for x in done):
        row["speedup_equal_quality"] = _mean([x.ref_wall_at_q / x.wall_at_q for x in done])


def _missing_text(key: GroupKey, all_runs: list[Run]) -> str:
    near = sorted(
        {str(group_key(r).tokens) for r in all_runs if r.is_baseline and r.status == K.COMPLETED
         and (r.hardware, r.model, r.data) == (key.hardware, key.model, key.data)}
    )  # fmt: skip
    hint = f" (BF16 exists for this hardware/model/data at tokens={','.join(near)})" if near else ""
    return "missing: no completed BF16 run in this group" + hint


def compare(runs: list[Run], *, smooth_frac: float = SMOOTH_FRAC) -> Comparison:
    """Group the runs and measure every arm of every group against the group's BF16 baseline."""
    by_group: dict[GroupKey, list[Run]] = defaultdict(list)
    for r in runs:
        by_group[group_key(r)].append(r)
    groups = []
    for key in sorted(by_group, key=lambda k: tuple(str(x) for x in (k.hardware, k.model, k.data, k.tokens))):
        groups.append(_compare_group(key, by_group[key], runs, smooth_frac))
    return Comparison(runs, groups, smooth_frac)


def _compare_group(key: GroupKey, runs: list[Run], all_runs: list[Run], smooth_frac: float) -> Group:
    window = smooth_frac * (key.tokens or 0)
    base = build_baseline(runs, key.tokens, window)
    group = Group(key, runs, base, [], list(base.notes) if base else [])
    if base is None:
        group.notes.append(_missing_text(key, all_runs) + ": " + ", ".join(r.name for r in runs))
    for r in runs:
        if r.is_baseline and r.status != K.COMPLETED:
            group.notes.append(f"BF16 run {r.name} is {r.status}: not part of the baseline")
    arms: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        arms[(r.recipe, r.variant, r.backend)].append(r)
    missing = _missing_text(key, all_runs)
    for (recipe, variant, backend), arm_runs in sorted(arms.items(), key=lambda kv: _arm_order(kv[0], base)):
        role = "baseline" if base and variant == base.variant and recipe == K.BASELINE_RECIPE else "arm"
        arm_runs.sort(key=lambda r: (r.seed is None, r.seed or 0, r.name))
        results = [compare_run(r, base, window) for r in arm_runs] if base else []
        arm = Arm(key, recipe, variant, backend, role, arm_runs, results)
        arm.row = _arm_row(arm, base, missing)
        group.arms.append(arm)
    return group


def _arm_order(arm_key: tuple, base: Baseline | None) -> tuple:
    recipe, variant, backend = arm_key
    is_base = recipe == K.BASELINE_RECIPE and base is not None and variant == base.variant
    return (not is_base, str(recipe), str(variant), str(backend))
