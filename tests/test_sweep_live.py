"""Real local sweeps, watched and steered as a user does: the report logged to W&B (offline) after runs
that logged there; `status`, `logs` and `cancel` from another process; through a pipe, the running
job's step, loss and tokens/s every `progress_s` seconds (slow: they start processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from harness.multirun import launch as L
from tests.helpers import REPO, run_cli

pytestmark = pytest.mark.slow

TWO_JOBS = """overrides: [model=gpt_tiny, backend=emulated, hardware=cpu, data.num_tokens=20000,
            steps={steps}, log_interval=1, eval_interval=0, eval_tokens=512, micro_batch_size=4,
            global_batch_size=4, checkpoint_interval=-1, {logger}]
seeds: [0]
arms:
  tensorwise: [recipe=tensorwise]
"""


def test_the_report_of_runs_that_logged_to_wandb_goes_to_wandb_too(capsys, tmp_path):
    own = tmp_path / "short.yaml"
    own.write_text(TWO_JOBS.format(steps=3, logger="logger=wandb"))
    sweep_dir = tmp_path / "sweep"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    res = run_cli(["-m", "harness.sweep", str(own), f"hydra.sweep.dir={sweep_dir}"], env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "analysis.report" in res.stdout and "--wandb" in res.stdout
    assert list((sweep_dir / "report" / "wandb").glob("offline-run-*")), "the report's W&B run, offline"

    assert L.main(["status", str(sweep_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("2 jobs; no driver (ended or stopped)")
    assert out[2].split()[:3] == ["0_bf16_s0", "completed", "3/3"]
    assert L.main(["logs", str(sweep_dir), "1"]) == 0
    assert "step 3/3" in capsys.readouterr().out


def test_status_and_cancel_from_another_process_while_it_runs(capsys, tmp_path):
    own = tmp_path / "long.yaml"
    own.write_text(TWO_JOBS.format(steps=4000, logger="logger=none"))
    sweep_dir = tmp_path / "sweep"
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.sweep",
            str(own),
            f"hydra.sweep.dir={sweep_dir}",
            "--no-report",
            "hydra.launcher.progress_s=0.5",
            "hydra.launcher.poll_s=0.2",
        ],  # fmt: skip
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (sweep_dir / "0_bf16_s0" / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert driver.poll() is None, driver.communicate()[0][-3000:]
            time.sleep(0.2)
        time.sleep(1.5)  # a few of the pipe's progress lines
        assert L.main(["status", str(sweep_dir)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert f"driver pid {driver.pid}" in out[0] and out[2].split()[:2] == ["0_bf16_s0", "running"]
        assert L.main(["cancel", str(sweep_dir)]) == 0
        said = capsys.readouterr().out
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert f"driver pid {driver.pid} stopped" in said and f"--resume {sweep_dir}" in said
    assert driver.returncode == 128 + 15, out[-3000:]
    assert "stopped by SIGTERM" in out
    # through a pipe: the status line with an ETA and the running job's step, loss and tokens/s
    live = [ln for ln in out.splitlines() if ln.startswith("  0_bf16_s0 ")]
    assert live and all(" step " in ln and "/4000  loss " in ln and " tok/s  left " in ln for ln in live), out
    assert "running 1  queued 1  failed 0" in out and "ETA -" not in out.split("running 1")[-1]
    summary = json.loads((sweep_dir / "0_bf16_s0" / "summary.json").read_text())
    assert summary["status"] == "preempted" and (sweep_dir / "0_bf16_s0" / "checkpoints").exists()
