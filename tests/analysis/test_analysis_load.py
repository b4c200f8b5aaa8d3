"""Discovery and robust loading of run directories (architecture.md "Artifacts")."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pandas")

from analysis import keys as K
from analysis import reader as load
from analysis import telemetry
from analysis.reader import RunWarning, load_runs
from analysis.telemetry import load_numerics, numerics_matrix

ANALYSIS_DIR = Path(load.__file__).parent


def test_finds_every_run_of_a_multirun_sweep(sweep_dir: Path) -> None:
    runs = load_runs(sweep_dir)
    assert len(runs) >= 6
    for r in runs:
        assert r.config and r.provenance, r.name
        assert r.recipe and r.backend in ("te", "emulated") and r.hardware and r.seed is not None
        assert r.status == K.COMPLETED
        steps = r.train[K.STEP]
        assert len(steps) and np.all(np.diff(steps) > 0)
        assert r.token_budget and r.token_budget > 0
    recipes = {r.recipe for r in runs}
    assert "bf16" in recipes and len(recipes) >= 3
    assert sum(r.recipe == "bf16" for r in runs) >= 2


def test_nested_runs_and_names(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path / "a" / "deeper", "0_bf16_s0")
    run_writer(tmp_path / "b", "1_tensorwise_s0", recipe="tensorwise")
    (tmp_path / "a" / "deeper" / "0_bf16_s0" / "checkpoints" / "x").mkdir(parents=True)
    names = [r.name for r in load_runs(tmp_path)]
    assert names == ["a/deeper/0_bf16_s0", "b/1_tensorwise_s0"]
    assert load_runs(tmp_path / "b" / "1_tensorwise_s0")[0].name == "1_tensorwise_s0"


def test_corrupted_metrics_lines_are_skipped_with_a_warning(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path, "2_tensorwise_s0", recipe="tensorwise", corrupt=True)
    with pytest.warns(RunWarning, match=r"run 2_tensorwise_s0: metrics.jsonl: skipped 2 unparseable line"):
        (run,) = load_runs(tmp_path)
    assert len(run.train[K.LOSS_TRAIN]) == 20  # 200 steps logged every 10: nothing good was lost
    assert len(run.eval[K.LOSS_EVAL]) == 4
    assert any("unparseable" in i for i in run.issues)


def test_missing_summary_is_incomplete(tmp_path: Path, run_writer) -> None:
    run_writer(tmp_path, "0_bf16_s0", summary=False)
    with pytest.warns(RunWarning, match="run 0_bf16_s0: no summary.json: reported as incomplete"):
        (run,) = load_runs(tmp_path)
    assert run.status == K.INCOMPLETE
    assert run.recipe == "bf16" and run.hardware == "cpu" and run.seed == 0  # from config/provenance
    assert run.token_budget == 200 * 8 * 64  # the planned budget


def test_unreadable_run_json_still_loads_what_it_can(tmp_path: Path, run_writer) -> None:
    d = run_writer(tmp_path, "0_bf16_s0")
    (d / "run.json").write_text("{not json")
    with pytest.warns(RunWarning, match="run 0_bf16_s0: run.json unreadable"):
        (run,) = load_runs(tmp_path)
    assert run.recipe == "bf16" and run.backend == "emulated"  # from summary.json
    assert len(run.train[K.LOSS_TRAIN]) == 20


def test_repeated_steps_keep_the_last_row(tmp_path: Path, run_writer) -> None:
    d = run_writer(tmp_path, "0_bf16_s0")
    with open(d / "metrics.jsonl", "a") as f:  # a resumed run logs steps 190 and 200 again
        f.write(json.dumps({"step": 190, "tokens": 190 * 512, "loss/train": 1.5}) + "\n")
        f.write(json.dumps({"step": 200, "tokens": 200 * 512, "loss/train": 1.25}) + "\n")
    with pytest.warns(RunWarning, match="2 step.s. logged more than once"):
        (run,) = load_runs(tmp_path)
    assert len(run.train[K.STEP]) == 20
    assert run.train[K.LOSS_TRAIN][-2:].tolist() == [1.5, 1.25]


def test_numerics_are_read_only_on_request(tmp_path: Path, run_writer, monkeypatch) -> None:
    run_writer(tmp_path, "1_nvfp4_s0", recipe="nvfp4")
    opened = []
    real = load.parse_jsonl
    spy = lambda p, issues: opened.append(p.name) or real(p, issues)  # noqa: E731
    monkeypatch.setattr(load, "parse_jsonl", spy)
    monkeypatch.setattr(telemetry, "parse_jsonl", spy)
    (run,) = load_runs(tmp_path, workers=1)
    assert opened == ["metrics.jsonl"]
    rows = load_numerics(run)
    assert opened[-1] == "numerics.jsonl" and len(rows) == 4 * 4 * 3
    layers, tensors, m = numerics_matrix(rows, "underflow")
    assert layers[0] == "blocks.0.attn.qkv" and tensors == ["input", "weight", "grad"]
    assert m.shape == (4, 3)
    assert m[0, 2] == pytest.approx(0.001 * 3 * 5)


def test_numerics_fall_back_to_metrics_keys(tmp_path: Path, run_writer, recwarn) -> None:
    d = run_writer(tmp_path, "1_tensorwise_s0", recipe="tensorwise", telemetry=False)
    with open(d / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps({"step": 200, "tokens": 102400, "numerics/blocks.0/mlp/fc1/grad/underflow": 0.25})
            + "\n"
        )
    (run,) = load_runs(tmp_path)
    assert "numerics/blocks.0/mlp/fc1/grad/underflow" not in run.train
    assert not [w for w in recwarn if w.category is RunWarning]  # a telemetry-only row is no clash
    assert np.isfinite(run.train[K.LOSS_TRAIN][-1])
    rows = load_numerics(run)
    assert rows == [{"step": 200, "layer": "blocks.0/mlp/fc1", "tensor": "grad", "underflow": 0.25}]


@pytest.mark.slow  # a process pool
def test_parallel_loading_matches_serial(sweep_dir: Path) -> None:
    serial, parallel = load_runs(sweep_dir, workers=1), load_runs(sweep_dir, workers=2)
    assert [r.name for r in serial] == [r.name for r in parallel]
    for a, b in zip(serial, parallel, strict=True):
        assert a.summary == b.summary
        np.testing.assert_array_equal(a.train[K.LOSS_TRAIN], b.train[K.LOSS_TRAIN])


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_runs(tmp_path / "nope")


def test_analysis_never_imports_harness() -> None:
    for path in ANALYSIS_DIR.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "harness" or n.startswith("harness.") for n in names), path
