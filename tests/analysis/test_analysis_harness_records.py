"""What the harness records for analysis: config warnings in run.json, filterable `resolved.*` W&B keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pandas")
pytest.importorskip("scipy")

import analysis
from analysis.wandb_offline import find_offline_runs, iter_records

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_config_warning_and_resolved_keys_reach_run_json_wandb_and_the_report(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness.train", "model=gpt_tiny", "recipe=nvfp4", "backend=auto",
           "hardware=cpu",
           "steps=2", "log_interval=1", "eval_interval=2", "eval_tokens=1024", "micro_batch_size=2",
           "global_batch_size=2", "data.num_tokens=50000", "logger=wandb", "logger.wandb.mode=offline",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning: recipe=nvfp4 without stability.first_last_layers_bf16" in res.stderr
    warnings = json.loads((run_dir / "run.json").read_text())["config_warnings"]
    assert any(w.startswith("recipe=nvfp4 without stability.first_last_layers_bf16") for w in warnings)
    runs = analysis.load(run_dir)
    assert runs.runs.loc[0, "config_warnings"].startswith("recipe=nvfp4 without")
    (f,) = find_offline_runs(run_dir)
    config = {}
    for rec in iter_records(f):
        if rec.WhichOneof("record_type") in ("run", "config"):
            items = rec.run.config.update if rec.WhichOneof("record_type") == "run" else rec.config.update
            config.update({it.key: json.loads(it.value_json) for it in items})
    resolved = config["resolved"]["value"] if "value" in config["resolved"] else config["resolved"]
    assert resolved["backend"] == "emulated"  # backend=auto resolved, filterable as resolved.backend
    assert (
        resolved["recipe"] == "nvfp4" and resolved["hardware"] == "cpu" and resolved["config_warnings"] == 1
    )
    assert "te_version" in resolved and "torch_version" in resolved
