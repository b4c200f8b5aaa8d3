"""A sweep on a real single-node Slurm (tests/slurm/cluster.py, as tests/test_slurm.py), watched and
cancelled as a user does: the driver's piped output shows the running Slurm job's step, loss and
tokens/s, read from its run directory; `status` names each job's Slurm id and state; `logs` prints the
job's train.log; `cancel` stops the driver and scancels the recorded jobs. Runs where test_slurm.py's do
(CI=true or LOWP_TEST_SLURM=1)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from harness.multirun import launch as L
from tests.helpers import REPO
from tests.test_slurm import rows, squeue
from tests.test_slurm import slurm as slurm  # the real cluster fixture, module-scoped
from tests.test_sweep_live import TWO_JOBS

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_a_slurm_sweep_is_watched_from_its_run_dirs_and_cancelled_with_scancel(
    slurm, tmp_path, capsys, monkeypatch
):
    for key, value in slurm.env.items():
        monkeypatch.setenv(key, value)  # status and cancel (this process) ask this cluster
    own = tmp_path / "long.yaml"
    own.write_text(TWO_JOBS.format(steps=4000, logger="logger=none"))
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "harness.sweep", str(own), f"hydra.sweep.dir={sweep_dir}", "--no-report",
           "hydra/launcher=slurm", "hydra.launcher.poll_s=1", "hydra.launcher.progress_s=1",
           "hydra.launcher.max_parallel=1"]  # fmt: skip
    env = {**slurm.env, "PYTHONUNBUFFERED": "1"}
    driver = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while len(rows(sweep_dir / "0_bf16_s0")) < 20 and time.monotonic() < deadline:
            assert driver.poll() is None, driver.communicate()[0][-3000:]
            time.sleep(0.5)
        time.sleep(3)  # a few of the driver's progress lines
        job_id = json.loads((sweep_dir / "slurm_jobs.json").read_text())["0_bf16_s0"]
        assert L.main(["status", str(sweep_dir)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[2].split()[:2] == ["0_bf16_s0", "running"] and out[2].split()[-1] == job_id, out
        assert L.main(["logs", str(sweep_dir), "0_bf16_s0"]) == 0
        assert "step 20/4000" in capsys.readouterr().out
        assert L.main(["cancel", str(sweep_dir)]) == 0
        said = capsys.readouterr().out
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert f"driver pid {driver.pid} stopped" in said and f"Slurm jobs {job_id} cancelled (scancel)" in said
    assert driver.returncode == 128 + 15, out[-3000:]
    live = [ln for ln in out.splitlines() if ln.startswith("  0_bf16_s0 ")]
    assert live and all("/4000  loss " in ln and " tok/s" in ln for ln in live), out[-3000:]
    assert "ETA -" not in out.split("running 1")[-1]
    deadline = time.monotonic() + 60
    while "lowp:long:0_bf16_s0" in squeue(slurm) and time.monotonic() < deadline:
        time.sleep(1)
    assert "lowp:long:0_bf16_s0" not in squeue(slurm), "scancel ended the job"
    assert "1_tensorwise_s0" not in json.loads((sweep_dir / "slurm_jobs.json").read_text())
