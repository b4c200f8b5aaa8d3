"""The load benchmark runs (at a small size; the 200 x 10,000 figure comes from its own output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pandas")
pytest.importorskip("scipy")

from benchmarks import analysis_load


def test_analysis_load_benchmark_runs_small(tmp_path: Path, capsys) -> None:
    out = tmp_path / "t.json"
    args = ["--runs", "5", "--steps", "300", "--dir", str(tmp_path), "--workers", "1", "--json", str(out)]
    assert analysis_load.main(args) == 0
    text = capsys.readouterr().out
    assert "load:" in text and "compare:" in text and "comparison: 5 arms" in text
    rec = json.loads(out.read_text())
    assert rec["runs"] == 5 and rec["curve_rows"] > 5 * 300 and rec["total_s"] > 0


def test_analysis_load_benchmark_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        analysis_load.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--runs" in out and "--steps" in out
