"""Arms are recipe labels: a family plus the recipe fields that differ from its preset, in words.

Runs of one family that differ in a recipe field are separate arms named by their labels
(`tensorwise + fast accumulation`), not by a `{field=value}` signature; a run written under a name
from before the families (`tensorwise_fastacc`) is that family with that label; runs written before
labels whose fields differ are still split by the signature.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pandas")
pytest.importorskip("scipy")
pytest.importorskip("jinja2")
pytest.importorskip("matplotlib")

import analysis
from analysis import frames, plots, report
from analysis.reader import load_runs
from analysis.telemetry import group_cells

FASTACC = "tensorwise + fast accumulation"


def write_fastacc_sweep(root: Path, run_writer) -> Path:
    """BF16, tensorwise and tensorwise with fast accumulation, seeds 0 and 1, emulated."""
    for seed in (0, 1):
        run_writer(root, f"bf16_s{seed}", seed=seed)
        run_writer(root, f"tw_s{seed}", recipe="tensorwise", seed=seed, offset=0.004,
                   recipe_fields={"fp8_fast_accumulation": "none"})  # fmt: skip
        run_writer(root, f"tw_fastacc_s{seed}", recipe="tensorwise", recipe_label=FASTACC, seed=seed,
                   offset=0.01, recipe_fields={"fp8_fast_accumulation": "all"})  # fmt: skip
    return root


def test_a_recipe_field_is_an_arm_named_by_its_label(tmp_path: Path, run_writer) -> None:
    runs = analysis.load(write_fastacc_sweep(tmp_path, run_writer))
    assert set(runs.runs["recipe"]) == {"bf16", "tensorwise"}
    assert set(runs.runs["recipe_label"]) == {"bf16", "tensorwise", FASTACC}
    table = analysis.compare(runs)
    assert list(table.columns[4:7]) == ["recipe", "recipe_label", "variant"]
    tw = table[table["recipe"] == "tensorwise"].set_index("recipe_label")
    assert sorted(tw.index) == ["tensorwise", FASTACC]
    assert (tw["runs"] == 2).all() and (tw["pairing"] == "paired by seed").all()
    # the label says what differs: no {fp8_fast_accumulation=...} signature beside it
    assert (tw["variant"] == "none+adamw_fp32").all()
    assert tw.loc[FASTACC, "train_gap_abs"] == pytest.approx(0.01, abs=3e-3)
    (base,) = table[table["role"] == "baseline"].itertuples()
    assert (base.recipe, base.recipe_label) == ("bf16", "bf16")
    assert set(frames.gap_curves(runs.comparison)["recipe_label"]) == {"tensorwise", FASTACC}
    assert set(runs.numerics["recipe_label"]) == {"tensorwise", FASTACC}


def test_the_report_legends_and_telemetry_name_arms_by_label(tmp_path: Path, run_writer) -> None:
    runs = analysis.load(write_fastacc_sweep(tmp_path / "sweep", run_writer))
    comparison = frames.comparison_of(runs)
    report.write_report(runs, comparison, tmp_path / "out", ["sweep"], figures=False)
    md = (tmp_path / "out" / "report.md").read_text()
    html = (tmp_path / "out" / "report.html").read_text()
    for text in (md, html):
        assert f"{FASTACC} (emulated)" in text and "tensorwise (emulated)" in text
        assert "fp8_fast_accumulation=" not in text
    assert f"| {FASTACC} (emulated) |" in md  # the ranked table's recipe cell
    (group,) = comparison.groups
    fig = plots.loss_curves(group)
    legend = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert f"{FASTACC} (emulated) mean of 2" in legend
    assert set(group_cells(group, runs.numerics)["arm"]) == {"tensorwise (emulated)", f"{FASTACC} (emulated)"}


def test_a_name_from_before_the_families_is_its_family_and_label(tmp_path: Path, run_writer) -> None:
    for seed in (0, 1):
        run_writer(tmp_path, f"bf16_s{seed}", seed=seed)
    fields = {"fp8_fast_accumulation": "all"}
    old = run_writer(tmp_path, "old_s0", recipe="tensorwise_fastacc", recipe_label=False, seed=0,
                     offset=0.01, recipe_fields=fields)  # fmt: skip
    run_writer(tmp_path, "new_s1", recipe="tensorwise", recipe_label=FASTACC, seed=1, offset=0.01,
               recipe_fields=fields)  # fmt: skip
    assert "recipe_label" not in json.loads((old / "summary.json").read_text())
    by_name = {r.name: r for r in load_runs(tmp_path)}
    assert (by_name["old_s0"].recipe, by_name["old_s0"].recipe_label) == ("tensorwise", FASTACC)
    table = analysis.compare(analysis.load(tmp_path))
    (row,) = table[table["role"] == "arm"].itertuples()
    assert (row.recipe, row.recipe_label, row.variant) == ("tensorwise", FASTACC, "none+adamw_fp32")
    assert (row.runs, row.seeds, row.pairing) == (2, "0,1", "paired by seed")


def test_a_name_from_before_the_families_without_a_summary(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path, "old_s0", recipe="tensorwise_fp8head", recipe_label=False, summary=False)
    with pytest.warns(UserWarning, match="no summary.json"):
        (run,) = load_runs(tmp_path)
    assert (run.recipe, run.recipe_label) == ("tensorwise", "tensorwise + FP8 LM head")  # from config


def test_runs_from_before_labels_are_still_split_by_their_fields(tmp_path: Path, run_writer) -> None:
    """NVFP4 with recipe.disable_rht=True against NVFP4 at its defaults, neither labelled: the
    signature tells them apart. Stability fields that differ show beside labels as before."""
    run_writer(tmp_path, "bf16_s0")
    for rht in (False, True):
        run_writer(tmp_path, f"nv_rht{rht}_s0", recipe="nvfp4", recipe_label=False,
                   recipe_fields={"disable_rht": rht})  # fmt: skip
    run_writer(tmp_path, "tw_s0", recipe="tensorwise", recipe_fields={"fp8_fast_accumulation": "none"})
    d = run_writer(tmp_path, "tw_fastacc_s0", recipe="tensorwise", recipe_label=FASTACC,
                   recipe_fields={"fp8_fast_accumulation": "all"})  # fmt: skip
    rj = json.loads((d / "run.json").read_text())
    rj["config"]["stability"]["fp8_margin"] = 1
    (d / "run.json").write_text(json.dumps(rj))
    table = analysis.compare(analysis.load(tmp_path))
    variants = {(r.recipe_label, r.variant) for r in table.itertuples()}
    assert variants == {
        ("bf16", "none+adamw_fp32"),
        ("nvfp4", "none+adamw_fp32 {disable_rht=False}"),
        ("nvfp4", "none+adamw_fp32 {disable_rht=True}"),
        ("tensorwise", "none+adamw_fp32 {fp8_margin=0}"),
        (FASTACC, "none+adamw_fp32 {fp8_margin=1}"),
    }
    md_names = set(report.display_frame(table)["recipe"])
    assert f"{FASTACC} [none+adamw_fp32 {{fp8_margin=1}}] (emulated)" in md_names
