"""The telemetry-cost benchmark runs end to end (here on the emulated backend of a tiny model; the
H200 figure is its TE run at the 1.4B shape), and one failing recipe does not lose the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import te_telemetry_cost

TINY = ["hardware=auto", "model=gpt_tiny", "backend=emulated", "micro_batch_size=2", "global_batch_size=2",
        "data=markov", "data.num_tokens=100000"]  # fmt: skip


@pytest.mark.slow
def test_telemetry_cost_benchmark_runs_and_keeps_going(tmp_path: Path) -> None:
    args = ["--recipes", "nosuch,tensorwise", "--out", str(tmp_path), "--warmup", "1", "--steps", "2"]
    assert te_telemetry_cost.main([*args, "--interval", "2", *TINY]) == 0
    runs = json.loads((tmp_path / "te_telemetry_cost.json").read_text())["runs"]
    assert "error" in runs["nosuch"]
    tw = runs["tensorwise"]
    assert tw["rows_per_telemetry_step"] == 2 * 4 * 3  # gpt_tiny: 2 blocks x 4 linears x 3 tensors
    assert len(tw["samples"]["telemetry"]) == 2 and len(tw["samples"]["between"]) == 2
    assert tw["step_ms_off"] > 0 and tw["step_ms_telemetry_step"] > 0
