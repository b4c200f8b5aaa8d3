"""The report read as a new user reads it: the axes span the curves, verdicts say whether a resolved
gap matters, unresolved arms are not ranked, every arm is accounted for, tables in job order, empty
columns said in one line, the header counts incomplete runs, one budget reads as one."""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("jinja2")

from matplotlib.figure import Figure

from analysis import frames, plots, report, report_text
from analysis import stats as S


def _sweep(root: Path, write_run, arms: dict[str, float], seeds=(0, 1, 2), **kw) -> Path:
    sweep = root / "sweep"
    n = 0
    for recipe, offset in {"bf16": 0.0, **arms}.items():
        for seed in seeds:
            write_run(sweep, f"{n}_{recipe}_s{seed}", recipe=recipe, seed=seed, offset=offset, **kw)
            n += 1
    return sweep


def test_a_resolved_gap_below_the_threshold_is_negligible_not_material() -> None:
    small = S.Interval(0.001, 0.0002, 0.0018, 0.0003, 4, 5, "paired t", 0.001)
    big = S.Interval(0.01, 0.005, 0.015, 0.002, 4, 5, "paired t", 0.006)
    assert S.materiality(small) == "negligible" and "resolved, negligible: < 0.25%" in S.verdict(small)[1]
    assert S.materiality(big) == "material" and "material, >= 0.25%" in S.verdict(big)[1]
    assert S.materiality(S.Interval(0.01, -0.01, 0.03, 0.01, 4, 5, "paired t", 0.03)) == "unresolved"


def test_arms_whose_interval_holds_zero_share_one_rank_alphabetically(tmp_path, run_writer) -> None:
    # per-seed gaps of both signs: no arm resolves; nvfp4's larger point estimate must not rank it
    sweep = tmp_path / "sweep"
    for n, (recipe, d) in enumerate((("bf16", 0.0), ("tensorwise", 0.01), ("nvfp4", 0.02), ("mxfp8", 0.005))):
        for seed, sign in ((0, 1.0), (1, -1.0), (2, 0.2)):
            curve = lambda step, s=sign * d: 2.0 + 3.5 * (1.0 + step / 20.0) ** -0.7 + s  # noqa: E731
            run_writer(sweep, f"{3 * n + seed}_{recipe}_s{seed}", recipe=recipe, seed=seed, loss_fn=curve)
    comp = frames.comparison_of(frames.load([str(sweep)]))
    rows = [a.row for a in comp.groups[0].arms if a.role != "baseline"]
    assert all(r["verdict"] == "indistinguishable" for r in rows)
    assert {r["rank"] for r in rows} == {1} and all(r["rank_tied"] for r in rows)
    assert [r["recipe"] for r in rows] == ["mxfp8", "nvfp4", "tensorwise"]
    assert set(report.display_frame(frames.comparison_frame(comp))["rank"]) == {"BF16", "1="}


def test_decision_names_the_separated_arm_the_unresolved_group_and_the_fix(tmp_path, run_writer) -> None:
    sweep = tmp_path / "sweep"
    n = 0
    for recipe, fields, offset in (("bf16", None, 0.0), ("tensorwise", None, 0.0),
                                   ("nvfp4", {"disable_rht": True}, 0.05), ("nvfp4", None, 0.0)):  # fmt: skip
        for seed in (0, 1, 2):
            label = "nvfp4 + no RHT" if fields else None
            run_writer(sweep, f"{n}_{recipe}_s{seed}", recipe=recipe, recipe_fields=fields,
                       recipe_label=label, seed=seed, offset=offset, noise=0.002)  # fmt: skip
            n += 1
    comp = frames.comparison_of(frames.load([str(sweep)]))
    g = comp.groups[0]
    text = report_text.decision(g, report.group_rows(frames.comparison_frame(comp), g))
    assert "nvfp4 + no RHT (emulated) is worse than BF16 by" in text and "material, >= 0.25%" in text
    assert "cannot be told from BF16" in text and "listed alphabetically, not ranked" in text
    assert "nvfp4 + no RHT (emulated) -> nvfp4 (emulated): -" in text and "resolved" in text
    assert "3 seeds x 200 steps" in text


def test_header_counts_incomplete_runs_and_a_stopped_run_is_not_a_second_budget(tmp_path, run_writer) -> None:
    sweep = _sweep(tmp_path, run_writer, {"tensorwise": 0.0}, seeds=(0, 1))
    run_writer(sweep, "9_nvfp4_s0", recipe="nvfp4", seed=0, summary=False)
    run_writer(sweep, "10_nvfp4_s1", recipe="nvfp4", seed=1, diverged_step=50, status="diverged")
    runs = frames.load([str(sweep)])
    assert report_text.status_counts(runs.objects) == "6 runs: 4 completed, 1 incomplete, 1 diverged"
    g = frames.comparison_of(runs).groups[0]
    budget = report_text.budget_text(g)
    assert "2 seeds x 200 steps" in budget and "10_nvfp4_s1 diverged at step 50" in budget
    assert "50,200" not in budget and "2 seeds x 50" not in budget


def test_runs_table_in_job_order_emulated_speed_marked_empty_columns_said(tmp_path, run_writer) -> None:
    sweep = tmp_path / "sweep"
    for n in (10, 2, 1, 0):
        run_writer(sweep, f"{n}_bf16_s{n}", seed=n, peak_mem_gib=math.nan)
    table, lines = report.runs_table(frames.load([str(sweep)]))
    assert list(table["run"]) == ["0_bf16_s0", "1_bf16_s1", "2_bf16_s2", "10_bf16_s10"]
    assert table["tokens_per_s"].str.endswith("(emulated: not the recipe's speed)").all()
    assert "peak_mem_gib" not in table and any(line.startswith("peak_mem_gib: ") for line in lines)


def test_loss_axis_spans_the_curves_and_states_a_far_floor() -> None:
    ax = Figure().add_subplot()
    ys = np.linspace(4.8, 5.2, 20)
    words = plots.loss_axis(ax, ys, 3.07)
    lo, hi = ax.get_ylim()
    assert 4.7 < lo < 4.8 and 5.2 < hi < 5.3
    assert "loss floor 3.070 nats" in words and "off this axis" in words
    assert plots.loss_axis(Figure().add_subplot(), ys, 4.8) == ""


def test_gap_axis_set_by_data_and_an_anchor_off_scale_is_said(tmp_path, run_writer) -> None:
    sweep = _sweep(tmp_path, run_writer, {"nvfp4": 0.001}, noise=0.001)
    g = frames.comparison_of(frames.load([str(sweep)])).groups[0]
    fig = plots.gap_curves(g)
    ax = fig.axes[0]
    assert ax.get_ylim()[1] < 1.0  # percent; the public NVFP4 anchor at 1.5% does not set the scale
    assert "NVFP4 12B/10T tokens" in ax.get_title() and "off this scale" in ax.get_title()


def test_every_arm_in_telemetry_or_a_line_why(tmp_path, run_writer) -> None:
    sweep = tmp_path / "sweep"
    for n, (recipe, tel) in enumerate((("bf16", True), ("tensorwise", True), ("int4_qat", False))):
        for seed in (0, 1):
            run_writer(sweep, f"{2 * n + seed}_{recipe}_s{seed}", recipe=recipe, seed=seed, telemetry=tel)
    runs = frames.load([str(sweep)])
    g = frames.comparison_of(runs).groups[0]
    from analysis.telemetry import group_cells

    lines = report_text.telemetry_absent(g, group_cells(g, runs.numerics))
    assert len(lines) == 1 and lines[0].startswith("int4_qat (emulated) is not in the telemetry figure: ")


def test_heatmap_zeros_have_their_own_colour_and_the_title_is_wrapped() -> None:
    import pandas as pd

    cells = pd.DataFrame({"arm": ["a (emulated)"] * 2, "layer": ["l0", "l1"], "tensor": ["grad"] * 2,
                          "underflow": [0.0, 1e-4], "saturation": [0.0, 0.0],
                          "sqnr_db": [30.0, 20.0]})  # fmt: skip
    fig = plots.telemetry_heatmaps(cells, "telemetry, mean over steps and seeds; " + "x" * 300)
    img = fig.axes[0].images[0]
    zero, small = img.to_rgba(img.get_array())[0, 0], img.to_rgba(img.get_array())[1, 0]
    assert tuple(np.round(zero[:3], 3)) != tuple(np.round(small[:3], 3))
    assert "exact 0" in fig.axes[0].get_title()
    assert "\n" in fig._suptitle.get_text()


def test_the_report_leaks_no_library_warning(tmp_path, run_writer) -> None:
    sweep = _sweep(tmp_path, run_writer, {"tensorwise": 0.001, "nvfp4": 0.05}, seeds=(0, 1))
    run_writer(sweep, "9_mxfp8_s0", recipe="mxfp8", seed=0)  # one seed: no interval
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        assert report.main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    assert [str(w.message) for w in caught] == []
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.count("<h2>Warnings</h2>") == 1 and "config warnings printed" not in html.lower()


def test_the_reports_own_wandb_analysis_run_is_not_read_as_a_run() -> None:
    # written by `lowp-sweep cpu_compare` (report --wandb) into DIR/report/wandb: job_type analysis
    data = Path(__file__).parent / "data" / "wandb_analysis_run"
    assert len(frames.load([str(data)])) == 0
