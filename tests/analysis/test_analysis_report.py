"""The report CLI (`python -m analysis.report`), its files and the figures in them."""

from __future__ import annotations

import contextlib
import csv
import io
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("pandas")
pytest.importorskip("scipy")
pytest.importorskip("jinja2")
pytest.importorskip("matplotlib")

from analysis import report
from analysis.pairing import COLUMNS

REPO = Path(report.__file__).parents[1]


@pytest.fixture(scope="session")
def report_run(sweep_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """(exit code, stdout, out dir) of one full report (figures included) per sweep source."""
    out = tmp_path_factory.mktemp("report")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = report.main([str(sweep_dir), "--out", str(out)])
    return rc, buf.getvalue(), out


def test_report_writes_every_file_and_ends_with_its_path(report_run) -> None:
    rc, stdout, out = report_run
    assert rc == 0
    for name in ("comparison.csv", "runs.csv", "report.md", "report.html"):
        assert (out / name).stat().st_size > 0, name
    assert stdout.rstrip().splitlines()[-1] == f"report: {(out / 'report.html').resolve()}"
    assert "gap [95% CI]" in stdout and "verdict" in stdout
    # emulated rows say they give no speed: "n/a (emulated)" beside measured ones, or one line for a
    # group whose every arm is emulated (its speed columns carry nothing)
    assert "n/a (emulated)" in stdout or "emulated speed is not the recipe's speed" in stdout
    for name in ("gaps.csv",):
        assert (out / name).stat().st_size > 0, name


def test_comparison_csv_has_every_column_and_every_arm(report_run, sweep_dir: Path) -> None:
    _, _, out = report_run
    with open(out / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(COLUMNS)
    assert {r["recipe"] for r in rows} >= {"bf16"} and len({r["recipe"] for r in rows}) >= 3
    arms = [r for r in rows if r["role"] == "arm"]
    assert arms and all(r["verdict"] and r["interval"] and r["gap_rel_lo"] for r in arms)
    with open(out / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == len(list(sweep_dir.rglob("run.json")))


def test_figures_are_png_and_svg(report_run, sweep_dir: Path) -> None:
    _, _, out = report_run
    pngs = sorted((out / "plots").glob("*.png"))
    kinds = {p.stem.rsplit("_", 1)[-1] for p in pngs}
    assert {"loss", "gap"} <= kinds
    has_telemetry = any(f.stat().st_size for f in sweep_dir.rglob("numerics.jsonl"))
    assert ("telemetry" in kinds) == has_telemetry
    has_native = any('"backend": "te"' in f.read_text() for f in sweep_dir.rglob("summary.json"))
    assert ("pareto" in kinds) == has_native
    md = (out / "report.md").read_text()
    if not has_native:  # no empty panel: one line says what is absent and why
        assert "pareto: absent (no native (te) low-precision run" in md
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert p.with_suffix(".svg").read_text().lstrip().startswith("<?xml")


def test_html_is_self_contained(report_run) -> None:
    _, _, out = report_run
    html = (out / "report.html").read_text()
    n_png = len(list((out / "plots").glob("*.png")))
    assert html.count('src="data:image/png;base64,') == n_png
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert "How every number was obtained" in html


def test_markdown_states_how_numbers_were_obtained(report_run) -> None:
    _, _, out = report_run
    md = (out / "report.md").read_text()
    assert "## How every number was obtained" in md and "trailing mean" in md
    assert "| rank | recipe | verdict | gap [95% CI] |" in md and "seeds × steps" in md
    assert "Welch t" in md and "Paired t" in md and "would detect" in md
    assert "Intervals: paired t, 95%, n=2" in md
    assert "](plots/" in md


def test_missing_baseline_and_warnings_reach_the_report(tmp_path: Path, run_writer, capsys) -> None:
    run_writer(tmp_path / "sweep", "0_tensorwise_s0", recipe="tensorwise", corrupt=True)
    run_writer(tmp_path / "sweep", "1_nvfp4_s0", recipe="nvfp4", summary=False)
    rc = report.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out"), "--no-plots"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "warning: run 0_tensorwise_s0: metrics.jsonl: skipped 2 unparseable line(s)" in captured.err
    assert "(baseline: NONE)" in captured.out and "no BF16 baseline" in captured.out
    md = (tmp_path / "out" / "report.md").read_text()
    assert "no completed BF16 run, so nothing is compared" in md and "1_nvfp4_s0: no summary.json" in md


def test_cli_errors(tmp_path: Path, capsys) -> None:
    assert report.main([str(tmp_path / "nope")]) == 2
    assert report.main([str(tmp_path)]) == 1
    assert "no run directories" in capsys.readouterr().err


def test_the_module_runs_as_main(tmp_path: Path, run_writer, monkeypatch, capsys) -> None:
    """What `python -m analysis.report` runs, in this process (runpy is what `-m` uses); that loading
    the package does not import the module first is test_analysis_structure's."""
    run_writer(tmp_path / "s", "0_bf16_s0")
    monkeypatch.delitem(sys.modules, "analysis.report")
    argv = ["analysis.report", str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--no-plots"]
    monkeypatch.setattr(sys, "argv", argv)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exit_:
        warnings.simplefilter("always")
        runpy.run_module("analysis.report", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.rstrip().endswith("report.html")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.slow
def test_python_dash_m_entry_point(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path / "s", "0_bf16_s0")
    cmd = [
        sys.executable,
        "-m",
        "analysis.report",
        str(tmp_path / "s"),
        "--out",
        str(tmp_path / "o"),
        "--no-plots",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.rstrip().endswith("report.html")
    assert "RuntimeWarning" not in out.stderr
