"""Gap forecasts: the family is chosen by hold-out, the interval covers, and every refusal says why;
forecast_check measures coverage on stored H200 loss checks, and of the BF16 loss fit behind
--target-loss, beyond whose validated ratio the report refuses."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy")

from analysis import forecast as F
from analysis import frames, report

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_hold_out_picks_a_constant_for_a_flat_gap_and_a_decay_for_a_shrinking_one() -> None:
    rng = np.random.default_rng(0)
    t = np.linspace(1e4, 1e5, 40)
    flat, why = F.choose(t, 0.002 + rng.normal(0, 1e-4, t.size))
    assert why is None and flat.name == "constant"
    value, lo, hi = flat.interval(2e5)
    assert lo < 0.002 < hi
    shrinking, why = F.choose(t, 0.001 + 0.02 * (t / 1e4) ** -1.0 + rng.normal(0, 2e-4, t.size))
    assert why is None and shrinking.name == "a + b (t/t0)^-1"
    assert shrinking.interval(2e5)[0] == pytest.approx(0.001 + 0.02 / 20, abs=5e-4)


def test_refusals_say_why() -> None:
    t = np.linspace(1e4, 1e5, 4)
    assert F.choose(t, np.zeros(4))[1] == "4 points past the early transient (needs >= 5)"
    t = np.linspace(1e4, 1e5, 30)
    jump = np.where(t > 0.75e5, 0.05, 0.0) + np.random.default_rng(1).normal(0, 1e-4, t.size)
    f, why = F.choose(t, jump)
    assert f is None and "fails its own hold-out" in why


def test_report_refuses_beyond_the_validated_ratio(tmp_path, run_writer) -> None:
    sweep = tmp_path / "sweep"
    for n, (recipe, offset) in enumerate((("bf16", 0.0), ("nvfp4", 0.02))):
        for seed in (0, 1, 2):
            run_writer(sweep, f"{3 * n + seed}_{recipe}_s{seed}", recipe=recipe, seed=seed, offset=offset,
                       log_interval=5)  # fmt: skip
    g = frames.comparison_of(frames.load([str(sweep)])).groups[0]
    budget = g.key.tokens
    ok = F.group_forecasts(g, F.VALIDATED_RATIO * budget)[0]
    assert ok.refused is None and ok.lo < ok.mean < ok.hi and ok.seeds == 3
    far = F.group_forecasts(g, 1000 * budget)[0]
    assert (
        far.refused.startswith(f"beyond {F.VALIDATED_RATIO:g}x the measured")
        and "forecast_check" in far.text()
    )
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = report.main([str(sweep), "--out", str(tmp_path / "out"), "--no-plots", "--target-tokens", "1e9"])
    assert rc == 0 and "forecast: nvfp4 (emulated): no forecast at 1B tokens" in buf.getvalue()
    assert "Gap forecasts" in (tmp_path / "out" / "report.md").read_text()


def test_bad_target_is_one_error_line(tmp_path, run_writer, capsys) -> None:
    run_writer(tmp_path / "s", "0_bf16_s0")
    assert report.main([str(tmp_path / "s"), "--target-tokens", "-5"]) == 2
    assert capsys.readouterr().err.startswith("error: --target-tokens=-5: must be a positive number")


def test_forecast_check_coverage_on_stored_h200_loss_checks() -> None:
    from benchmarks import forecast_check as C

    paths = [
        RESULTS / "markov_300_8b_band_h200_2026-12-01.json",
        RESULTS / "markov_300_8b_fastacc_h200_2026-12-01.json",
    ]
    out = C.measure(paths, [2.0, 3.0])
    assert out["pairs"] == 4  # the runs of seeds 0, 2 (the band file has no BF16 seed 1)
    two, three = out["by_ratio"]["2.0"], out["by_ratio"]["3.0"]
    assert two["forecasts"] + two["refused"] == 4 and two["forecasts"] >= 3
    assert three["refused"] == 4  # 4 points up to step 100: too few
    assert out["validated_ratio"] is None  # < 30 forecasts validate nothing


def test_equal_quality_at_a_target_loss_or_the_reason_not(tmp_path, run_writer) -> None:
    sweep = tmp_path / "sweep"
    for n, (recipe, offset) in enumerate((("bf16", 0.0), ("nvfp4", 0.02))):
        for seed in (0, 1, 2):
            run_writer(sweep, f"{3 * n + seed}_{recipe}_s{seed}", recipe=recipe, seed=seed, offset=offset,
                       log_interval=5)  # fmt: skip
    g = frames.comparison_of(frames.load([str(sweep)])).groups[0]
    final = float(g.baseline.band["mean"][-1])
    lines = F.equal_quality(g, final + 0.05)  # reached within the measured budget
    assert lines[0].startswith(f"equal quality at loss {final + 0.05:g}: BF16 reaches it at about")
    assert "token efficiency at loss" in lines[1] and "nvfp4 (emulated)" in lines[1]
    assert "refused" in F.equal_quality(g, 1.0)[0]  # below the fitted asymptote or far beyond the budget


def _bf16_curve(seed: int, loss: np.ndarray, floor: float | None = None):
    from benchmarks import forecast_check as C

    t = np.arange(1, 101) * 1000.0
    return C.Curve("s.json", f"bf16_s{seed}", "bf16 [none]", "gpt_tiny", 100_000, seed, t, loss, floor)


def test_bf16_loss_fit_coverage_per_extrapolation_ratio() -> None:
    from benchmarks import forecast_check as C

    rng = np.random.default_rng(0)
    x = np.arange(1, 101, dtype=float)
    runs = [_bf16_curve(s, 2.0 + 3.0 * x**-0.5 + rng.normal(0, 0.01, x.size)) for s in range(30)]
    out = C.coverage([C.check_loss_case(c, 2.0) for c in runs])
    two = out["by_ratio"]["2.0"]
    assert two["forecasts"] == 30 and two["coverage"] >= C.ENOUGH and out["validated_ratio"] == 2.0
    # a loss that falls faster than e + b t^-c once the learning rate decays: predicted too high
    decays = C.check_loss_case(_bf16_curve(0, 2.0 + 3.0 * x**-0.5 - 0.2 * (x / 100) ** 4), 2.0)
    assert decays["observed"] < decays["lo"] < decays["predicted"] and not decays["covered"]
    # an asymptote the data's loss floor forbids is refused, with the floor named
    floored = C.check_loss_case(_bf16_curve(0, 2.0 + 3.0 * x**-0.5, floor=2.5), 2.0)
    assert "e >= the loss floor 2.500" in floored["refused"]
    few = C.coverage([C.check_loss_case(c, 2.0) for c in runs[:29]])
    assert few["validated_ratio"] is None  # 29 forecasts validate nothing


def test_target_loss_refused_beyond_the_loss_fits_validated_ratio(tmp_path, run_writer, monkeypatch) -> None:
    sweep = tmp_path / "sweep"
    for n, (recipe, offset) in enumerate((("bf16", 0.0), ("nvfp4", 0.02))):
        for seed in (0, 1):
            run_writer(sweep, f"{2 * n + seed}_{recipe}_s{seed}", recipe=recipe, seed=seed, offset=offset)
    g = frames.comparison_of(frames.load([str(sweep)])).groups[0]
    f, why = F.bf16_loss_fit(g.baseline)
    assert why is None
    loss_at = lambda ratio: float(f.beta[0] + f.beta[1] * (ratio * g.key.tokens / f.t0) ** -f.c)  # noqa: E731
    assert F.LOSS_VALIDATED_RATIO is None  # forecast_check validated no extrapolation of the loss fit
    inside = F.equal_quality(g, loss_at(0.8))
    assert "BF16 reaches it at about" in inside[0] and "prediction interval of its loss there" in inside[0]
    beyond = F.equal_quality(g, loss_at(1.2))
    assert beyond == [
        f"equal quality at loss {loss_at(1.2):g}: refused, BF16 needs about {F._tokens(1.2 * g.key.tokens)} "
        f"tokens (1.2x), beyond the measured {F._tokens(g.key.tokens)} tokens: no extrapolation ratio of the "
        f"BF16 loss fit was validated ({F.LOSS_VALIDATED_TEXT}); BF16 loss fit {F.loss_text(f)}"
    ]
    assert "80% over 10 forecasts at 1.5x" in F.LOSS_VALIDATED_TEXT
    assert (
        report.forecast_lines(g, None, loss_at(1.2))[-1] == beyond[0]
    )  # what lowp-report --target-loss says
    monkeypatch.setattr(F, "LOSS_VALIDATED_RATIO", 1.5)  # had forecast_check validated 1.5x
    assert "BF16 reaches it at about" in F.equal_quality(g, loss_at(1.2))[0]
    assert "beyond 1.5x the measured" in F.equal_quality(g, loss_at(2.0))[0]
