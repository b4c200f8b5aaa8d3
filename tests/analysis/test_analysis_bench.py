"""The load benchmark script runs (at a small size; the 200 x 10,000 figure is in its own output)."""

from __future__ import annotations

from pathlib import Path

from analysis import bench_load


def test_bench_load_runs_small(tmp_path: Path, capsys) -> None:
    assert bench_load.main(["--runs", "5", "--steps", "300", "--dir", str(tmp_path), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "load_runs:" in out and "compare:" in out and "arms: 5" in out
