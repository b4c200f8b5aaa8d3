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
from analysis import stats as S
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
    "hardware", "model", "data", "tokens", "recipe", "recipe_label", "variant", "backend", "role", "rank",
    "runs", "seeds", "steps", "status", "divergence", "verdict", "verdict_text", "materiality",
    "baseline", "pairing",
    "interval", "gap_metric", "gap_rel", "gap_rel_lo", "gap_rel_hi", "mde_rel",
    "final_train_loss", "bf16_final_train_loss", "train_gap_abs", "train_gap_rel", "train_gap_rel_lo",
    "train_gap_rel_hi", "train_mde_rel",
    "final_eval_loss", "bf16_final_eval_loss", "eval_gap_abs", "eval_gap_rel", "eval_gap_rel_lo",
    "eval_gap_rel_hi", "eval_mde_rel",
    "bf16_seed_sd_rel", "loss_floor", "bf16_band_min", "bf16_band_max", "bf16_band_2sigma", "leaves_band",
    "curve_gap_rel_mean", "curve_gap_rel_max", "curve_frac_outside_band", "curve_frac_resolved",
    "rank_tied", "public_anchor", "within_anchor",
    "target_loss", "reached_target", "tokens_to_target", "tokens_to_target_lo", "tokens_to_target_hi",
    "wall_to_target_s", "equal_quality_loss", "token_efficiency", "token_efficiency_lo",
    "token_efficiency_hi", "speedup_equal_quality", "speedup_equal_quality_lo", "speedup_equal_quality_hi",
    "equal_quality_note", "tokens_per_s", "throughput_ratio", "throughput_ratio_lo", "throughput_ratio_hi",
    "peak_mem_gib", "memory_ratio", "mfu_bf16_peak", "speed_note", "config_warnings",
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
    eval_grid: np.ndarray | None = None
    """Tokens of the BF16 eval rows (those every BF16 run reached); None without eval rows."""
    eval_stack: np.ndarray | None = None
    """(n_runs, eval_grid) eval loss."""

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
    base = Baseline(chosen, variant, curves, grid, stack, notes)
    evals = [r.eval[K.TOKENS][np.isfinite(r.eval[K.LOSS_EVAL])] for r in chosen if len(r.eval[K.TOKENS])]
    if evals:
        common = evals[0][evals[0] <= min(e[-1] for e in evals if len(e))] if all(map(len, evals)) else None
        if common is not None and len(common):
            base.eval_grid = common.astype(float)
            base.eval_stack = np.array([eval_at(r, base.eval_grid) if eval_at(r, base.eval_grid) is not None
                                        else np.full(common.shape, np.nan) for r in chosen])  # fmt: skip
    return base


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


# --- arms: one row per (recipe label, variant, backend) of a group ---------------------------------


@dataclass
class Arm:
    key: GroupKey
    recipe: str | None
    """The numerics family."""
    recipe_label: str | None
    """The family and the recipe fields that differ from its preset (`Run.recipe_label`)."""
    variant: str
    backend: str | None
    role: str
    """`baseline` (the BF16 runs the group is measured against) or `arm`."""
    runs: list[Run]
    results: list[RunResult]
    row: dict[str, Any] = field(default_factory=dict)
    train_band: dict[str, np.ndarray] | None = None
    """Relative smoothed-train-loss gap along tokens: tokens, mean, lo, hi (the interval per point)."""
    eval_band: dict[str, np.ndarray] | None = None
    """The same for eval loss, on the BF16 eval tokens."""

    @property
    def name(self) -> str:
        return arm_name(self.recipe_label, self.variant, self.backend)


def arm_name(recipe_label: str | None, variant: str, backend: str | None) -> str:
    """An arm as tables, legends and telemetry name it: the recipe label, the presets where they are
    not the plain ones, the backend (one function, so a row and its curve carry the same name)."""
    presets = "" if variant == K.DEFAULT_VARIANT else f" [{variant}]"
    return f"{recipe_label}{presets} ({backend})"


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
            div.append(f"seed {r.seed} at step {(r.summary or {}).get('diverged_step')}: {cause}")
        elif r.status == K.FAILED:
            div.append(f"seed {r.seed} failed: {(r.summary or {}).get('error') or 'no error recorded'}")
    return status, "; ".join(div)


def _diverged(runs: list[Run]) -> str | None:
    """'at step N (seed s)' for the earliest diverged run of an arm, else None."""
    steps = [((r.summary or {}).get("diverged_step"), r.seed) for r in runs if r.status == K.DIVERGED]
    steps = [(s, seed) for s, seed in steps if s is not None] or [(None, seed) for _, seed in steps]
    if not steps:
        return None
    n = len(steps)
    step, seed = min(steps, key=lambda t: (t[0] is None, t[0] or 0))
    where = f"at step {step}" if step is not None else "(step not recorded)"
    return f"{where} (seed {seed}; {n}/{len(runs)} seeds diverged)"


def _set_interval(row: dict[str, Any], prefix: str, iv: S.Interval | None, offset: float = 0.0) -> None:
    """row[prefix], row[prefix_lo], row[prefix_hi] from an interval (offset added, e.g. 1 for ratios)."""
    if iv is None:
        return
    row[prefix] = iv.mean + offset
    if math.isfinite(iv.lo):
        row[f"{prefix}_lo"], row[f"{prefix}_hi"] = iv.lo + offset, iv.hi + offset


def _speed(row: dict[str, Any], arm_runs: list[Run], base: Baseline | None) -> None:
    """Throughput and memory of native runs against native BF16 runs, or the reason there are none.

    throughput_ratio's interval is the t interval over the arm's seeds of tokens_per_s / (mean native
    BF16 tokens_per_s); memory is deterministic enough to be given as the ratio of means.
    """
    note = ""
    if not any(r.backend for r in arm_runs):
        note = "n/a (backend unknown)"
    elif any(r.backend == K.EMULATED_BACKEND for r in arm_runs):
        note = "n/a (emulated)"
    elif not all(r.is_native for r in arm_runs):
        note = f"n/a (backend {arm_runs[0].backend})"
    done = [r for r in arm_runs if r.status == K.COMPLETED]
    if not note and not done:
        note = "n/a (no completed run)"
    row["speed_note"] = note
    if note:
        return
    row["tokens_per_s"] = _mean([r.tokens_per_s for r in done])
    row["peak_mem_gib"] = _mean([r.peak_mem_gib for r in done])
    row["mfu_bf16_peak"] = _mean([r.summary_number("mfu_bf16_peak") for r in done])
    if base is None or not base.native:
        row["speed_note"] = "n/a (no native BF16 baseline)"
        return
    b_tps = _mean([r.tokens_per_s for r in base.native])
    b_mem = _mean([r.peak_mem_gib for r in base.native])
    if b_tps:
        _set_interval(row, "throughput_ratio", S.ratio_interval([(r.tokens_per_s or math.nan) / b_tps
                                                                 for r in done]))  # fmt: skip
    if row["peak_mem_gib"] and b_mem:
        row["memory_ratio"] = row["peak_mem_gib"] / b_mem


def _arm_row(arm: Arm, base: Baseline | None, missing: str) -> dict[str, Any]:
    runs, key = arm.runs, arm.key
    status, divergence = _status_text(runs)
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    # the steps each run was launched with: a run stopped early is a status, not a second budget
    planned = [r.config.get("steps") if isinstance(r.config.get("steps"), int) else r.steps for r in runs]
    steps = sorted({s for s in planned if s is not None})
    row.update(
        hardware=key.hardware, model=key.model, data=key.data, tokens=key.tokens, recipe=arm.recipe,
        recipe_label=arm.recipe_label, variant=arm.variant, backend=arm.backend, role=arm.role,
        runs=len(runs), seeds=",".join(str(r.seed) for r in runs), steps=",".join(map(str, steps)),
        status=status, divergence=divergence, loss_floor=_mean([r.loss_floor for r in runs]),
        config_warnings="; ".join(dict.fromkeys(w for r in runs for w in r.config_warnings)),
    )  # fmt: skip
    _speed(row, runs, base)
    if base is None:
        row["baseline"] = missing
        row["verdict"], row["verdict_text"] = "no baseline", "no BF16 baseline in this group: not compared"
        row["final_eval_loss"] = _mean([r.final_eval_loss for r in runs if r.status == K.COMPLETED])
        return row
    row["baseline"] = f"bf16 [{base.variant}] seeds " + ",".join(map(str, base.seeds))
    _loss_columns(row, arm, base)
    return row


def _gap(row: dict[str, Any], which: str, done: list[RunResult], base: Baseline) -> S.Interval | None:
    """The final-loss gap interval (relative to BF16) of `which` ('train' or 'eval'), into the row."""
    if which == "train":
        run_vals = {x.run.seed: x.final_train for x in done}
        base_vals = {r.seed: (float(c.smooth[-1]) if c is not None else None)
                     for r, c in zip(base.runs, base.curves, strict=True)}  # fmt: skip
    else:
        run_vals = {x.run.seed: x.final_eval for x in done}
        base_vals = {r.seed: r.final_eval_loss for r in base.runs}
    ref = _mean(list(base_vals.values()))
    row[f"final_{which}_loss"] = _mean(list(run_vals.values()))
    row[f"bf16_final_{which}_loss"] = ref
    if row[f"final_{which}_loss"] is None or not ref:
        return None
    row[f"{which}_gap_abs"] = row[f"final_{which}_loss"] - ref
    if arm_is_self(done, base):
        return None
    iv = S.gap_interval(run_vals, base_vals)
    if iv is None:
        return None
    rel = iv.scaled(1 / ref)
    _set_interval(row, f"{which}_gap_rel", rel)
    row[f"{which}_mde_rel"] = rel.mde if math.isfinite(rel.mde) else None
    return rel


def arm_is_self(done: list[RunResult], base: Baseline) -> bool:
    return bool(done) and all(any(x.run is b for b in base.runs) for x in done)


def _loss_columns(row: dict[str, Any], arm: Arm, base: Baseline) -> None:
    done = [x for x in arm.results if x.run.status == K.COMPLETED]
    paired = sum(x.paired for x in done)
    row["pairing"] = (
        "no completed run" if not done else "paired by seed" if paired == len(done)
        else "unpaired (one seed)" if len(done) == 1
        else f"unpaired ({paired}/{len(done)} seeds match a BF16 seed)"
    )  # fmt: skip
    train, ev = _gap(row, "train", done, base), _gap(row, "eval", done, base)
    use_eval = ev is not None and all(r.final_eval_loss is not None for r in base.runs)
    headline = ev if use_eval else train
    row["gap_metric"] = "loss/eval" if use_eval else "loss/train (smoothed)"
    if headline is not None:
        _set_interval(row, "gap_rel", headline)
        row["mde_rel"] = headline.mde if math.isfinite(headline.mde) else None
        row["interval"] = f"{headline.method}, {100 * S.LEVEL:g}%, n={headline.n}"
    finals = [r.final_eval_loss for r in base.runs] if use_eval else [
        float(c.smooth[-1]) for c in base.curves if c is not None]  # fmt: skip
    finals = [f for f in finals if f is not None]
    if len(finals) > 1:
        row["bf16_seed_sd_rel"] = float(np.std(finals, ddof=1) / np.mean(finals))
    if arm.role == "baseline":
        row["verdict"] = "baseline"
        n = len(finals)
        row["verdict_text"] = (
            f"baseline: {n} BF16 seeds, seed-to-seed sd {100 * row['bf16_seed_sd_rel']:.2f}%"
            if row["bf16_seed_sd_rel"] is not None else f"baseline: {n} BF16 seed(s), no seed spread"
        )  # fmt: skip
    else:
        row["verdict"], row["verdict_text"] = S.verdict(headline, _diverged(arm.runs))
        row["materiality"] = S.materiality(headline) if row["verdict"] != "diverged" else "material"
    _band_columns(row, arm, base, use_eval)
    _curve_columns(row, arm, base)
    anchor = PUBLIC_ANCHORS.get(str(arm.recipe))
    if anchor:
        row["public_anchor"] = anchor[1]
        row["within_anchor"] = None if row["gap_rel"] is None else bool(row["gap_rel"] <= anchor[0])
    if arm.role != "baseline":
        _quality_columns(row, done)


def _curve_columns(row: dict[str, Any], arm: Arm, base: Baseline) -> None:
    """Gap along the train curve with its seed interval (arm.train_band), and the eval curve's."""
    late = base.late
    rel = [x.gap_curve[late] / base.band["mean"][late] for x in arm.results if x.gap_curve is not None]
    rel = [g[np.isfinite(g)] for g in rel]
    row["curve_gap_rel_mean"] = _mean([float(g.mean()) for g in rel if len(g)])
    row["curve_gap_rel_max"] = max((float(g.max()) for g in rel if len(g)), default=None)
    row["curve_frac_outside_band"] = _mean([x.frac_outside_band for x in arm.results])
    if arm.role == "baseline":
        return
    arm.train_band = curve_band(arm, base, "train")
    arm.eval_band = curve_band(arm, base, "eval")
    b = arm.train_band
    if b is not None:
        ok = late & np.isfinite(b["lo"])
        if ok.any():
            row["curve_frac_resolved"] = float(((b["lo"][ok] > 0) | (b["hi"][ok] < 0)).mean())


def curve_band(arm: Arm, base: Baseline, which: str) -> dict[str, np.ndarray] | None:
    """Relative gap to BF16 along tokens with its interval per point (same method as the final gap)."""
    if which == "train":
        grid, base_stack = base.grid, base.stack
        runs = [x.curve.at(grid) if x.curve is not None else None for x in arm.results]
    else:
        grid, base_stack = base.eval_grid, base.eval_stack
        if grid is None or not len(grid):
            return None
        runs = [eval_at(x.run, grid) for x in arm.results]
    seeds = [x.run.seed for x, c in zip(arm.results, runs, strict=True) if c is not None]
    stack = np.array([c for c in runs if c is not None])
    if not len(stack):
        return None
    ref = np.nanmean(base_stack, 0)
    base_seeds = [r.seed for r in base.runs]
    idx = [base_seeds.index(s) if s in base_seeds else None for s in seeds]
    if all(i is not None for i in idx) and len(idx) > 1:
        mean, lo, hi = S.paired_band(stack - base_stack[idx])
    else:
        mean, lo, hi = S.welch_band(stack, base_stack)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"tokens": grid, "mean": mean / ref, "lo": lo / ref, "hi": hi / ref}


def eval_at(run: Run, grid: np.ndarray) -> np.ndarray | None:
    ev = run.eval.get(K.LOSS_EVAL)
    if ev is None:
        return None
    ok = np.isfinite(ev)
    if not ok.any():
        return None
    return np.interp(grid, run.eval[K.TOKENS][ok], ev[ok], left=np.nan, right=np.nan)


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
    """Tokens to the BF16 loss, token efficiency and speedup at equal quality, each with a t interval
    over seeds, or withheld (equal_quality_note says why)."""
    if not done:
        row["equal_quality_note"] = "withheld: no completed run"
        return
    notes = []
    row["target_loss"] = _mean([x.target_loss for x in done])
    reached = [x for x in done if x.tokens_to_target is not None]
    row["reached_target"] = f"{len(reached)}/{len(done)}"
    if len(reached) == len(done):
        _set_interval(row, "tokens_to_target", S.one_sample([x.tokens_to_target for x in done]))
        if not row["speed_note"]:
            row["wall_to_target_s"] = _mean([x.wall_to_target for x in done])
    else:
        notes.append(f"tokens to BF16 loss withheld: reached by {len(reached)}/{len(done)} seeds")
    row["equal_quality_loss"] = _mean([x.equal_quality_loss for x in done])
    if all(x.tokens_at_q and x.ref_tokens_at_q for x in done):
        _set_interval(row, "token_efficiency",
                      S.one_sample([x.ref_tokens_at_q / x.tokens_at_q for x in done]))  # fmt: skip
    else:
        notes.append("token efficiency withheld: a seed never reaches the equal-quality loss")
    if row["speed_note"]:
        notes.append(f"speedup {row['speed_note']}")
    elif all(x.wall_at_q and x.ref_wall_at_q for x in done):
        _set_interval(row, "speedup_equal_quality",
                      S.one_sample([x.ref_wall_at_q / x.wall_at_q for x in done]))  # fmt: skip
    else:
        notes.append("speedup withheld: no wall time to the equal-quality loss")
    if len(done) < 2:
        notes.append("one seed: no intervals")
    row["equal_quality_note"] = "; ".join(notes)


def _missing_text(key: GroupKey, all_runs: list[Run]) -> str:
    near = sorted(
        {str(group_key(r).tokens) for r in all_runs if r.is_baseline and r.status == K.COMPLETED
         and (r.hardware, r.model, r.data) == (key.hardware, key.model, key.data)}
    )  # fmt: skip
    hint = f" (BF16 exists for this hardware/model/data at tokens={','.join(near)})" if near else ""
    return "missing: no completed BF16 run in this group" + hint


_PRESET_SECTIONS = ("recipe", "stability", "optimizer")


def _settings(run: Run) -> dict[str, Any]:
    out = {}
    for section in _PRESET_SECTIONS:
        d = run.config.get(section)
        if isinstance(d, dict):
            out.update({f"{section}.{k}": str(v) for k, v in d.items() if k != "name"})
    return out


def arm_variants(runs: list[Run]) -> dict[int, str]:
    """The variant of each run (by id): its stability+optimizer presets, plus the fields that differ
    between runs that would otherwise share an arm, so that such runs are separate arms: recipe fields
    between runs of the same recipe label (e.g. NVFP4 with `recipe.disable_rht=True` against NVFP4 at
    its defaults, both written before recipe labels), stability and optimizer fields between runs of
    the same family and presets. Recipe fields that the labels already tell apart are not repeated."""
    settings = {id(r): _settings(r) for r in runs}
    varying: dict[int, set[str]] = defaultdict(set)
    for sections, key in ((("stability", "optimizer"), lambda r: (r.recipe, r.variant)),
                          (("recipe",), lambda r: (r.recipe_label, r.variant))):  # fmt: skip
        together: dict[tuple, list[Run]] = defaultdict(list)
        for r in runs:
            together[key(r)].append(r)
        for rs in together.values():
            sts = [settings[id(r)] for r in rs]
            keys = {k for k in set().union(*sts) if k.split(".", 1)[0] in sections}
            differ = {k for k in keys if len({st.get(k) for st in sts}) > 1}
            for r in rs:
                varying[id(r)] |= differ
    out = {}
    for r in runs:
        st = settings[id(r)]
        sig = ",".join(f"{k.split('.', 1)[1]}={st.get(k)}" for k in sorted(varying[id(r)]))
        out[id(r)] = f"{r.variant} {{{sig}}}" if sig else r.variant
    return out


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
    if base is not None and len(base.runs) < 3:
        group.notes.append(
            f"only {len(base.runs)} BF16 seed(s): intervals are wide or missing; run >= 3 seeds per arm"
        )
    arms: dict[tuple, list[Run]] = defaultdict(list)
    variants = arm_variants(runs)
    for r in runs:
        arms[(r.recipe, r.recipe_label, variants[id(r)], r.backend)].append(r)
    missing = _missing_text(key, all_runs)
    for arm_key, arm_runs in sorted(arms.items(), key=lambda kv: _arm_order(kv[0], base)):
        recipe, label, variant, backend = arm_key
        role = "baseline" if _is_baseline_arm(arm_key, base) else "arm"
        arm_runs.sort(key=lambda r: (r.seed is None, r.seed or 0, r.name))
        results = [compare_run(r, base, window) for r in arm_runs] if base else []
        arm = Arm(key, recipe, label, variant, backend, role, arm_runs, results)
        arm.row = _arm_row(arm, base, missing)
        group.arms.append(arm)
    _rank(group)
    return group


def _rank(group: Group) -> None:
    """rank 1 = best: baseline first (rank 0), then by verdict (better .. diverged). Resolved arms are
    ordered by gap; arms whose interval holds 0 share one rank (`rank_tied`) in alphabetical order:
    their point estimates say nothing about their order."""
    arms = [a for a in group.arms if a.role != "baseline"]
    arms.sort(key=_rank_key)
    rank, previous = 0, None
    for i, a in enumerate(arms, 1):
        tied = a.row["verdict"] in S.UNRESOLVED
        rank = rank if tied and previous in S.UNRESOLVED else i
        a.row["rank"], a.row["rank_tied"] = rank, tied
        previous = a.row["verdict"] if tied else None
    shared = Counter(a.row["rank"] for a in arms)
    for a in arms:
        a.row["rank_tied"] = shared[a.row["rank"]] > 1
    for a in group.arms:
        if a.role == "baseline":
            a.row["rank"], a.row["rank_tied"] = 0, False
    group.arms.sort(key=lambda a: (a.row["rank"], a.name))


def _rank_key(arm: Arm) -> tuple:
    gap = arm.row["gap_rel"] if arm.row["gap_rel"] is not None else math.inf
    order = S.VERDICT_ORDER.get(arm.row["verdict"], 9)
    return (order, arm.name) if arm.row["verdict"] in S.UNRESOLVED else (order, gap, arm.name)


def _is_baseline_arm(arm_key: tuple, base: Baseline | None) -> bool:
    """BF16 at its preset (recipe label == family) with the baseline's presets."""
    recipe, label, variant, _ = arm_key
    return base is not None and recipe == label == K.BASELINE_RECIPE and variant == base.variant


def _arm_order(arm_key: tuple, base: Baseline | None) -> tuple:
    return (not _is_baseline_arm(arm_key, base), *map(str, arm_key))
