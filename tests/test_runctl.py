"""The pieces a run survives with: the run-dir lock, the stop request, divergence, resume bookkeeping."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys

import pytest

from harness.config.schema import DivergenceConfig
from harness.lifecycle import resume as R
from harness.lifecycle.divergence import DivergenceMonitor
from harness.lifecycle.runlock import RunDirLocked, RunLock
from harness.lifecycle.signals import StopRequest, exit_after_preemption


def test_lock_refuses_a_live_holder_and_frees_on_release(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunDirLocked, match=rf"pid {os.getpid()} on host .*hydra.run.dir"):
            RunLock(tmp_path).acquire()  # another open file description: flock refuses it
    RunLock(tmp_path).acquire().release()  # free again


@pytest.mark.slow  # a forked holder, SIGKILLed
def test_lock_is_freed_by_the_kernel_when_its_holder_is_killed(tmp_path):
    pid = os.fork()
    if pid == 0:
        RunLock(tmp_path).acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == pid  # left behind...
    with RunLock(tmp_path):  # ...and taken over
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()


def test_stop_request_sets_a_flag_and_chains_to_the_launchers_handler():
    calls = []
    prior = signal.signal(signal.SIGUSR2, lambda s, f: calls.append(s))
    try:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.requested and stop.signum == signal.SIGUSR2 and not calls
        # after the checkpoint, the launcher's own handler (submitit's requeue) gets the signal
        with pytest.raises(SystemExit) as exc:
            exit_after_preemption(stop.signum, stop.previous[signal.SIGUSR2])
        assert calls == [signal.SIGUSR2] and exc.value.code == 128 + signal.SIGUSR2
    finally:
        signal.signal(signal.SIGUSR2, prior)


def test_second_sigint_stops_at_once():
    with StopRequest():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_divergence_nonfinite_spike_with_patience_and_state():
    mon = DivergenceMonitor(DivergenceConfig(loss_spike_factor=2.0, patience=2))
    assert mon.check({"loss/train": 5.0}) is None and mon.check({"loss/train": 3.0}) is None
    assert mon.check({"loss/train": 7.0}) is None  # one row above 2x the minimum: a strike, not the end
    assert mon.check({"loss/train": 4.0}) is None  # back under: strikes reset
    assert mon.check({"loss/train": 6.5}) is None
    again = DivergenceMonitor(DivergenceConfig(loss_spike_factor=2.0, patience=2))
    again.load_state_dict(json.loads(json.dumps(mon.state_dict())))  # the state survives a checkpoint
    assert "loss spike: 6.1 > 2 x the running minimum 3" in again.check({"loss/train": 6.1})
    assert "non-finite train loss" in DivergenceMonitor(DivergenceConfig()).check(
        {"loss/train": float("nan")}
    )
    gn = {"loss/train": 1.0, "optim/grad_norm": float("inf")}
    assert "non-finite gradient norm" in DivergenceMonitor(DivergenceConfig()).check(gn)
    off = DivergenceMonitor(DivergenceConfig(loss_spike_factor=0, patience=1))
    assert off.check({"loss/train": 1.0}) is None and off.check({"loss/train": 100.0}) is None


def test_config_diff_ignores_only_result_neutral_keys():
    a = {"seed": 0, "optimizer": {"lr": 1e-3}, "logger": {"name": "wandb"}, "log_interval": 10, "extras": {}}
    b = {
        "seed": 0,
        "optimizer": {"lr": 2e-3},
        "logger": {"name": "none"},
        "log_interval": 1,
        "extras": {"x": 1},
    }
    assert R.config_diff(a, b) == ["optimizer.lr"]
    assert "optimizer.lr: 0.001 -> 0.002" in R.describe_diff(a, b, ["optimizer.lr"], "d")


def test_truncate_rows_keeps_up_to_the_step_and_drops_a_torn_line(tmp_path):
    rows = [{"step": s, "loss/train": 1.0 / s} for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')
    (tmp_path / "numerics.jsonl").write_text(json.dumps({"step": 2}) + "\n" + json.dumps({"step": 5}) + "\n")
    assert R.truncate_rows(tmp_path, 4) == {"metrics.jsonl": 3, "numerics.jsonl": 1}
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:4]


def test_resume_command_replaces_run_dir_and_resume_mode(tmp_path):
    cmd = R.resume_command(tmp_path, ["recipe=delayed", "resume=never", "hydra.run.dir=old", "seed=1"])
    assert cmd == f"{shlex.join(R.train_command())} recipe=delayed seed=1 hydra.run.dir={tmp_path.resolve()}"


def test_resume_command_leads_with_the_console_script(tmp_path, monkeypatch):
    """`lowp-train` where it is on PATH, the script as it was called where it is not (a venv not
    activated), `python -m harness.train` when started that way and none is installed."""
    script = tmp_path / "bin" / "lowp-train"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(sys, "argv", [str(script), "recipe=delayed"])
    assert R.train_command() == [str(script)]
    monkeypatch.setenv("PATH", str(script.parent))
    assert R.train_command() == ["lowp-train"]
    monkeypatch.setattr(sys, "argv", ["/checkout/harness/train.py"])  # python -m harness.train
    assert R.train_command() == ["lowp-train"]
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    assert R.train_command() == ["python", "-m", "harness.train"]


@pytest.mark.slow  # the W&B client starts its own service process
def test_wandb_offline_resume_continues_the_same_run(tmp_path):
    """The real W&B client (offline): the resumed attempt logs into the run id kept in run.json."""
    from harness import train as T
    from tests.helpers import TINY, compose_cfg

    overrides = [*TINY, "logger=wandb", "logger.wandb.mode=offline", "steps=6", "checkpoint_interval=2"]
    stop = StopRequest()
    step_fn = T.Trainer.train_step

    def stop_at_3(self, step):
        if step == 3:
            stop.signum = signal.SIGTERM  # what the handler sets
        return step_fn(self, step)

    T.Trainer.train_step = stop_at_3
    try:
        assert T.run(compose_cfg(*overrides), tmp_path, stop).status == "preempted"
    finally:
        T.Trainer.train_step = step_fn
    first = json.loads((tmp_path / "run.json").read_text())["wandb"]["run_id"]
    assert T.run(compose_cfg(*overrides), tmp_path).status == "completed"
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert run_json["wandb"]["run_id"] == first
    assert [a["resumed_from_step"] for a in run_json["attempts"]] == [None, 4]
