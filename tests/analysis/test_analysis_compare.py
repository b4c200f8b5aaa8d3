"""Pairing, bands, gaps along the curve, equal-quality speedup and the speed rules of compare.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy")

from analysis import keys as K
from analysis.curves import first_crossing, smooth
from analysis.pairing import COLUMNS, compare
from analysis.reader import load_runs

TOKENS_PER_STEP = 8 * 64
NO_SMOOTHING = 1e-9  # a window shorter than one logging interval: the curve itself


def linear(offset: float = 0.0):
    """Loss falling linearly in tokens: interpolation and crossings are exact."""
    return lambda step: 5.0 - 1e-5 * step * TOKENS_PER_STEP + offset


def rows_by(comparison, **match):
    return [r for r in comparison.rows if all(r[k] == v for k, v in match.items())]


def test_smooth_is_a_trailing_mean_over_the_window() -> None:
    t = np.array([10.0, 20, 30, 40])
    y = np.array([4.0, 2, 6, 8])
    np.testing.assert_allclose(smooth(t, y, 15.0), [4, 3, 4, 7])
    np.testing.assert_allclose(smooth(t, y, 1e-9), y)


def test_first_crossing_interpolates() -> None:
    x, y = np.array([0.0, 10, 20]), np.array([3.0, 2.0, 1.0])
    assert first_crossing(x, y, 1.5) == pytest.approx(15.0)
    assert first_crossing(x, y, 5.0) == 0.0
    assert first_crossing(x, y, 0.5) is None


def test_gap_is_exact_when_logging_cadences_differ(tmp_path: Path, run_writer) -> None:
    kw = dict(steps=210, eval_interval=70)
    for seed in (0, 1):
        run_writer(tmp_path, f"bf16_s{seed}", seed=seed, loss_fn=linear(0.001 * seed), **kw)
        tw = linear(0.01 + 0.001 * seed)
        run_writer(tmp_path, f"tw_s{seed}", recipe="tensorwise", seed=seed, loss_fn=tw, log_interval=7, **kw)
    c = compare(load_runs(tmp_path), smooth_frac=NO_SMOOTHING)
    (g,) = c.groups
    (row,) = rows_by(c, recipe="tensorwise")
    assert row["pairing"] == "paired by seed"
    assert row["train_gap_abs"] == pytest.approx(0.01, abs=1e-9)
    assert row["eval_gap_abs"] == pytest.approx(0.01, abs=1e-9)
    assert row["gap_metric"] == K.LOSS_EVAL and row["gap_rel"] == pytest.approx(row["eval_gap_rel"])
    tw = next(a for a in g.arms if a.recipe == "tensorwise")
    for res in tw.results:
        gap = res.gap_curve[np.isfinite(res.gap_curve)]
        assert len(gap) > 0.9 * len(g.baseline.grid)
        np.testing.assert_allclose(gap, 0.01, atol=1e-9)  # paired: the seed offsets cancel
    assert row["leaves_band"] == "above"  # BF16 seeds differ by 0.001 only
    assert row["curve_frac_outside_band"] == pytest.approx(1.0)


def test_band_min_max_and_two_sigma(tmp_path: Path, run_writer) -> None:
    for seed, off in ((0, 0.0), (1, 0.02), (2, 0.04)):
        run_writer(tmp_path, f"bf16_s{seed}", seed=seed, loss_fn=linear(off))
    run_writer(tmp_path, "tw_s5", recipe="tensorwise", seed=5, loss_fn=linear(0.03))
    run_writer(tmp_path, "nv_s5", recipe="nvfp4", seed=5, loss_fn=linear(0.2))
    c = compare(load_runs(tmp_path), smooth_frac=NO_SMOOTHING)
    (tw,) = rows_by(c, recipe="tensorwise")
    bf16_final_eval = 5.0 - 1e-5 * 200 * TOKENS_PER_STEP + 0.05
    assert tw["pairing"] == "unpaired (one seed)"
    assert tw["bf16_band_min"] == pytest.approx(bf16_final_eval)
    assert tw["bf16_band_max"] == pytest.approx(bf16_final_eval + 0.04)
    assert tw["bf16_band_2sigma"] == pytest.approx(2 * 0.02)  # sample std of (0, .02, .04)
    assert tw["eval_gap_abs"] == pytest.approx(0.01)  # vs the BF16 mean (+0.02)
    assert tw["leaves_band"] == "inside"
    (nv,) = rows_by(c, recipe="nvfp4")
    assert nv["leaves_band"] == "above"
    assert nv["public_anchor"].startswith("NVFP4") and nv["within_anchor"] is False


def test_native_speed_and_equal_quality_speedup(tmp_path: Path, run_writer) -> None:
    delta = 0.1
    for seed in (0, 1):
        run_writer(tmp_path, f"bf16_s{seed}", seed=seed, backend="te", hardware="h100", loss_fn=linear(),
                   step_ms=100.0, peak_mem_gib=10.0)  # fmt: skip
        run_writer(tmp_path, f"tw_s{seed}", recipe="tensorwise", seed=seed, backend="te", hardware="h100",
                   loss_fn=linear(delta), step_ms=50.0, peak_mem_gib=8.0)  # fmt: skip
    c = compare(load_runs(tmp_path), smooth_frac=NO_SMOOTHING)
    (row,) = rows_by(c, recipe="tensorwise")
    assert row["throughput_ratio"] == pytest.approx(2.0)
    assert row["memory_ratio"] == pytest.approx(0.8)
    assert row["speed_note"] == ""
    assert row["reached_target"] == "0/2" and row["tokens_to_target"] is None  # it ends worse
    # Equal quality = the tensorwise final loss, which BF16 reaches delta / 1e-5 tokens before its end.
    budget = 200 * TOKENS_PER_STEP
    bf16_tokens = budget - delta / 1e-5
    assert row["token_efficiency"] == pytest.approx(bf16_tokens / budget)
    bf16_wall = bf16_tokens / TOKENS_PER_STEP * 0.100
    assert row["speedup_equal_quality"] == pytest.approx(bf16_wall / (200 * 0.050))
    (base,) = rows_by(c, recipe="bf16")
    assert base["role"] == "baseline" and base["throughput_ratio"] == pytest.approx(1.0)


def test_a_better_run_reaches_the_bf16_loss_early(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path, "bf16_s0", backend="te", hardware="h100", loss_fn=linear(), step_ms=100.0)
    run_writer(tmp_path, "tw_s0", recipe="tensorwise", backend="te", hardware="h100", loss_fn=linear(-0.1),
               step_ms=100.0)  # fmt: skip
    c = compare(load_runs(tmp_path), smooth_frac=NO_SMOOTHING)
    (row,) = rows_by(c, recipe="tensorwise")
    budget = 200 * TOKENS_PER_STEP
    assert row["reached_target"] == "1/1"
    assert row["tokens_to_target"] == pytest.approx(budget - 0.1 / 1e-5)
    assert row["wall_to_target_s"] == pytest.approx((budget - 0.1 / 1e-5) / TOKENS_PER_STEP * 0.1)
    assert row["speedup_equal_quality"] == pytest.approx(budget / (budget - 0.1 / 1e-5))
    assert row["leaves_band"] == "n/a (1 BF16 seed)"


def test_emulated_runs_never_contribute_speed(sweep_dir: Path) -> None:
    c = compare(load_runs(sweep_dir))
    emulated = [r for r in c.rows if r["backend"] == K.EMULATED_BACKEND]
    assert emulated
    for r in emulated:
        assert r["speed_note"] == "n/a (emulated)"
        for col in (
            "throughput_ratio",
            "memory_ratio",
            "speedup_equal_quality",
            "tokens_per_s",
            "wall_to_target_s",
        ):
            assert r[col] is None, (r["recipe"], col)
    for r in c.rows:
        assert list(r) == list(COLUMNS)
        assert r["seeds"] and r["steps"] and r["verdict"] and r["verdict_text"]
        if r["role"] == "arm" and r["baseline"].startswith("bf16"):
            assert r["gap_rel"] is not None


def test_native_is_compared_only_with_native_bf16(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path, "bf16_s0", backend="emulated", hardware="h200")
    run_writer(tmp_path, "tw_s0", recipe="tensorwise", backend="te", hardware="h200")
    run_writer(tmp_path, "tw_h100_s0", recipe="tensorwise", backend="te", hardware="h100")
    c = compare(load_runs(tmp_path))
    (h200,) = rows_by(c, recipe="tensorwise", hardware="h200")
    assert h200["throughput_ratio"] is None and h200["speed_note"] == "n/a (no native BF16 baseline)"
    assert h200["gap_rel"] is not None  # numerics compare across backends
    (h100,) = rows_by(c, recipe="tensorwise", hardware="h100")
    assert h100["baseline"].startswith("missing")  # never compared with the h200 BF16 run


def test_missing_baseline_is_reported_not_borrowed(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path, "bf16_s0", steps=200)
    run_writer(tmp_path, "tw_s0", recipe="tensorwise", steps=200)
    run_writer(tmp_path, "tw_long_s0", recipe="tensorwise", steps=400)
    run_writer(tmp_path, "tw_small_s0", recipe="tensorwise", model="gpt_small")
    c = compare(load_runs(tmp_path))
    assert len(c.groups) == 3
    (long,) = rows_by(c, recipe="tensorwise", tokens=400 * TOKENS_PER_STEP)
    assert long["baseline"].startswith("missing: no completed BF16 run in this group")
    assert "tokens=102400" in long["baseline"]  # says where a BF16 run does exist
    for col in ("gap_rel", "train_gap_abs", "eval_gap_abs", "throughput_ratio", "bf16_band_min"):
        assert long[col] is None
    (small,) = rows_by(c, recipe="tensorwise", model="gpt_small")
    assert small["baseline"] == "missing: no completed BF16 run in this group"
    assert sum("no completed BF16 run" in n for n in c.notes) == 2
    assert any("tw_long_s0" in n for n in c.notes)


def test_diverged_run_stays_in_its_group(tmp_path: Path, run_writer) -> None:
    for seed in (0, 1):
        run_writer(tmp_path, f"bf16_s{seed}", seed=seed)
    run_writer(tmp_path, "nv_s0", recipe="nvfp4", seed=0, offset=0.05)
    run_writer(tmp_path, "nv_s1", recipe="nvfp4", seed=1, status="diverged", diverged_step=120, offset=0.05)
    runs = load_runs(tmp_path)
    c = compare(runs)
    assert len(c.groups) == 1
    (row,) = rows_by(c, recipe="nvfp4")
    assert row["status"] == "1 completed, 1 diverged"
    assert row["divergence"] == "seed 1 at step 120: loss is nan"
    assert row["runs"] == 2 and row["pairing"] == "paired by seed"  # gaps from the completed seed only
    assert row["verdict"] == "diverged" and row["verdict_text"].startswith("diverged at step 120 (seed 1;")
    nv = next(a for a in c.groups[0].arms if a.recipe == "nvfp4")
    diverged = next(x for x in nv.results if x.run.seed == 1)
    assert diverged.final_train is None and diverged.tokens_to_target is None
    covered = np.isfinite(diverged.gap_curve)
    assert covered.any() and not covered[-1]  # the curve gap runs up to the divergence


def test_unequal_seeds_pair_where_they_match(tmp_path: Path, run_writer) -> None:
    for seed in (0, 1):
        run_writer(tmp_path, f"bf16_s{seed}", seed=seed)
    for seed in (1, 2):
        run_writer(tmp_path, f"tw_s{seed}", recipe="tensorwise", seed=seed, offset=0.01)
    c = compare(load_runs(tmp_path))
    (row,) = rows_by(c, recipe="tensorwise")
    assert row["pairing"] == "unpaired (1/2 seeds match a BF16 seed)"
    assert row["interval"].startswith("Welch t")
    tw = next(a for a in c.groups[0].arms if a.recipe == "tensorwise")
    refs = {x.run.seed: x.reference for x in tw.results}
    assert refs == {1: "BF16 seed 1 (paired)", 2: "BF16 mean of seeds 0, 1"}


def test_incomplete_bf16_is_not_a_baseline(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path, "bf16_s0", seed=0)
    run_writer(tmp_path, "bf16_s1", seed=1, summary=False)
    run_writer(tmp_path, "tw_s1", recipe="tensorwise", seed=1)
    with pytest.warns(UserWarning):
        c = compare(load_runs(tmp_path))
    (g,) = c.groups
    assert [r.name for r in g.baseline.runs] == ["bf16_s0"]
    assert any("bf16_s1 is incomplete" in n for n in c.notes)
    (row,) = rows_by(c, recipe="tensorwise")
    assert row["pairing"] == "unpaired (one seed)"


def test_baseline_is_the_plain_bf16_variant(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path, "bf16_s0")
    run_writer(tmp_path, "bf16_lean_s0", optimizer="bf16_states", offset=0.02)
    run_writer(tmp_path, "tw_s0", recipe="tensorwise", stability="first_last_bf16")
    c = compare(load_runs(tmp_path))
    roles = {(r["recipe"], r["variant"]): r["role"] for r in c.rows}
    assert roles == {
        ("bf16", "none+adamw_fp32"): "baseline",
        ("bf16", "none+bf16_states"): "arm",
        ("tensorwise", "first_last_bf16+adamw_fp32"): "arm",
    }
    (lean,) = rows_by(c, variant="none+bf16_states")
    assert lean["train_gap_abs"] == pytest.approx(0.02, abs=1e-6)
