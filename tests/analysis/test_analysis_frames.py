"""`analysis.load` -> Runs DataFrames and `analysis.compare` -> the comparison DataFrame."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pandas")
pytest.importorskip("scipy")

import analysis
from analysis import keys as K
from analysis.pairing import COLUMNS


def test_load_gives_runs_curves_and_numerics_frames(tmp_path: Path, run_writer) -> None:
    for seed in (0, 1, 2):
        run_writer(tmp_path, f"bf16_s{seed}", seed=seed)
        run_writer(tmp_path, f"nv_s{seed}", recipe="nvfp4", seed=seed, offset=0.05)
    runs = analysis.load(tmp_path)
    assert len(runs) == 6 and list(runs.runs["run"]) == sorted(runs.runs["run"])
    row = runs.runs.set_index("run").loc["nv_s1"]
    assert (row["recipe"], row["backend"], row["seed"], row["status"]) == (
        "nvfp4",
        "emulated",
        1,
        "completed",
    )
    assert row["config.model.hidden_size"] == 64 and row["version.torch"] == "2.13.0"
    c = runs.curves
    assert list(c.columns) == ["run", "step", "tokens", "metric", "value"]
    assert str(c["run"].dtype) == "category" and not c["value"].isna().any()
    train = c[(c["run"] == "nv_s1") & (c["metric"] == K.LOSS_TRAIN)]
    assert list(train["step"]) == list(range(10, 201, 10)) and (train["tokens"] == train["step"] * 512).all()
    assert len(c[(c["run"] == "nv_s1") & (c["metric"] == K.LOSS_EVAL)]) == 4
    n = runs.numerics
    assert set(n["recipe"]) == {"nvfp4"} and len(n) == 3 * 4 * 4 * 3  # runs x steps x layers x tensors
    assert {"layer", "tensor", "underflow", "saturation", "sqnr_db"} <= set(n.columns)


def test_compare_is_a_dataframe_with_every_column(tmp_path: Path, run_writer) -> None:
    for seed in (0, 1, 2):
        run_writer(tmp_path, f"bf16_s{seed}", seed=seed, noise=0.02)
        run_writer(tmp_path, f"nv_s{seed}", recipe="nvfp4", seed=seed, offset=0.2, noise=0.02)
    table = analysis.compare(analysis.load(tmp_path))
    assert list(table.columns) == list(COLUMNS) and len(table) == 2
    nv = table[table["recipe"] == "nvfp4"].iloc[0]
    assert nv["verdict"] == "worse" and nv["gap_rel_lo"] > 0 and nv["rank"] == 1
    assert nv["interval"] == "paired t, 95%, n=3" and nv["steps"] == "200" and nv["seeds"] == "0,1,2"
    assert np.isfinite(nv["mde_rel"]) and nv["loss_floor"] == pytest.approx(1.9)
    base = table[table["role"] == "baseline"].iloc[0]
    assert base["verdict"] == "baseline" and base["rank"] == 0


def test_config_warnings_reach_the_frames(tmp_path: Path, run_writer) -> None:
    import json

    d = run_writer(tmp_path, "nv_s0", recipe="nvfp4")
    rj = json.loads((d / "run.json").read_text())
    rj["config_warnings"] = ["recipe=nvfp4 without stability.first_last_layers_bf16: ..."]
    (d / "run.json").write_text(json.dumps(rj))
    runs = analysis.load(tmp_path)
    assert runs.runs.loc[0, "config_warnings"].startswith("recipe=nvfp4 without")
    assert analysis.compare(runs).loc[0, "config_warnings"].startswith("recipe=nvfp4 without")
