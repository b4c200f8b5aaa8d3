"""Faults the way a cluster makes them, through the real CLI: a disk that fills up under a multirun,
a SIGKILL that lands inside a checkpoint write, a SIGTERM to a run that takes no periodic
checkpoints. Each is made for real (tests/faults.py); none is a monkeypatched exception."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.lifecycle import checkpoint as C
from tests.faults import tmpfs
from tests.helpers import REPO, TINY, run_cli, start_train

pytestmark = pytest.mark.slow  # each starts `python -m harness.train`

QUICK = [*TINY, "eval_interval=0", "eval_tokens=512", "log_interval=1", "data.num_tokens=20000"]


def loss_steps(run_dir: Path) -> list[int]:
    rows = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in rows if "loss/train" in r]


def resumed_from(run_dir: Path) -> int | None:
    """The step the last attempt resumed from (run.json's attempts)."""
    return json.loads((run_dir / "run.json").read_text())["attempts"][-1]["resumed_from_step"]


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_full_disk_in_a_multirun_fails_that_job_and_runs_the_next(tmp_path):
    """Job 0's second checkpoint finds the disk full (a 2.6 MB tmpfs, room for one checkpoint of
    gpt_tiny): one error line naming the path, the cause and the fix, its run dir `failed` with its
    first checkpoint and rows intact; job 1 (no checkpoints) still runs; the multirun exits 1."""
    with tmpfs(tmp_path / "sweep", 2_600_000) as sweep:
        res = run_cli(
            ["-m", "harness.train", "-m", *QUICK, "steps=4", "log_interval=2", "checkpoint_interval=2,-1",
             f"hydra.sweep.dir={sweep}"]
        )  # fmt: skip
        (job0,) = sweep.glob("0_*")
        (job1,) = sweep.glob("1_*")
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert len(errors) == 2 and errors[1].startswith(f"error: 1 of 2 jobs failed ({job0.name})"), errors
        for needle in ("cannot write checkpoint 4", str(job0 / "checkpoints"), "No space left on device"):
            assert needle in errors[0], errors[0]
        assert "free space there" in errors[0] and "restart to resume" in errors[0]
        assert json.loads((job0 / "summary.json").read_text())["status"] == "failed"
        assert "No space left on device" in (job0 / "error.txt").read_text()
        assert [p.name for p in C.candidates(job0)] == ["step_00000002"] and C.load_latest(job0)[1] == 2
        assert not list((job0 / "checkpoints").glob(".tmp-*")) and loss_steps(job0) == [1, 2, 4]
        assert json.loads((job1 / "summary.json").read_text())["status"] == "completed"


def test_sigkill_inside_a_checkpoint_write_is_cleaned_up_on_restart(tmp_path):
    """SIGKILL while checkpoint k is being written (its .tmp- directory exists: the process is
    stopped there first, so the kill lands inside the write) leaves that directory behind; the
    restart removes it and resumes from checkpoint k-1, to the same rows as an uninterrupted run."""
    args = [*QUICK, "steps=30", "checkpoint_interval=1", "checkpoint_keep=2", f"hydra.run.dir={tmp_path}"]
    proc = start_train(*args)
    partial: list[Path] = []
    try:
        while not partial:
            wait_for(  # a write after the first checkpoint: the restart has one to resume from
                lambda: C.candidates(tmp_path) and list(tmp_path.glob("checkpoints/.tmp-*")),
                "a checkpoint write",
            )
            proc.send_signal(signal.SIGSTOP)
            partial = list(tmp_path.glob("checkpoints/.tmp-*"))
            if partial:
                proc.kill()
            else:  # that write had just finished: let it run to the next one
                proc.send_signal(signal.SIGCONT)
    finally:
        proc.kill()
        proc.communicate()
    killed_at = int(partial[0].name.split("-")[1].removeprefix("step_"))
    assert partial[0].is_dir() and C.load_latest(tmp_path)[1] == killed_at - 1
    res = run_cli(["-m", "harness.train", *args])
    assert res.returncode == 0, res.stderr[-3000:]
    assert not list(tmp_path.glob("checkpoints/.tmp-*"))
    assert (
        f"removed 1 partial checkpoint(s) of an interrupted write in {tmp_path / 'checkpoints'}" in res.stdout
    )
    assert (
        json.loads((tmp_path / "run.json").read_text())["attempts"][-1]["resumed_from_step"] == killed_at - 1
    )
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    assert loss_steps(tmp_path) == list(range(1, 31))


def test_sigterm_without_periodic_checkpoints_resumes_where_it_stopped(tmp_path):
    """checkpoint_interval=-1 (no periodic checkpoints) and a SIGTERM: the run still checkpoints at
    the step boundary, and the resume command it printed continues it (before: it started over and
    cut metrics.jsonl back to nothing)."""
    args = [*QUICK, "steps=30", "checkpoint_interval=-1", f"hydra.run.dir={tmp_path}"]
    proc = start_train(*args)
    wait_for(lambda: (tmp_path / "metrics.jsonl").exists() and len(loss_steps(tmp_path)) >= 2, "two rows")
    proc.send_signal(signal.SIGSTOP)  # the signal then lands mid-run however fast the steps are
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["status"] == "preempted" and 2 <= stopped < 30
    assert C.load_latest(tmp_path)[1] == stopped
    (command,) = [ln.split("resume with: ")[1] for ln in out.splitlines() if "resume with: " in ln]
    res = subprocess.run(
        [sys.executable, *shlex.split(command)[1:]], cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "run.json").read_text())["attempts"][-1]["resumed_from_step"] == stopped
    assert loss_steps(tmp_path) == list(range(1, 31))  # continued: no row lost or repeated
