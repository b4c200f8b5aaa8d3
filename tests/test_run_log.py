"""A run's log as its user reads it: the run directory once at the start, step lines with loss, grad
norm, lr, tokens/s and memory, a closing line (status, final losses, throughput, where the files are);
defaults that fit a short run; wall_time_s over every attempt of a resumed run."""

import json
import logging
import signal
import time

from harness.config.schema import eval_budget
from harness.lifecycle.signals import StopRequest
from harness.train import run
from harness.training.trainer import checkpoint_interval
from tests.helpers import TINY, compose_cfg

SHORT = [*TINY, "backend=emulated", "steps=3", "log_interval=1", "eval_interval=0"]


def test_three_step_log_and_defaults(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lowp")
    summary = run(compose_cfg(*SHORT, "eval_tokens=16384"), tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "lowp"]
    steps = [x for x in lines if x.startswith("step ")]
    assert len(steps) == 3
    for line in steps:
        assert str(tmp_path) not in line
        for part in ("loss ", "grad ", "lr ", "tok/s", "rss ", "ETA "):
            assert part in line, line
    assert sum(str(tmp_path) in x for x in lines if not x.startswith("to resume")) == 2  # start, end
    assert lines[0].startswith(f"run dir {tmp_path}")
    assert lines[-1].startswith("completed: 3 steps, 768 tokens in ")
    assert f"loss/train {summary.final_train_loss:.4f}" in lines[-1]
    assert f"loss/eval {summary.final_eval_loss:.4f}" in lines[-1]
    assert lines[-1].endswith(
        f"; artifacts in {tmp_path} (summary.json, metrics.jsonl, run.json, checkpoints/)"
    )
    # a 3-step run checkpoints once, at its end, and evaluates no more tokens than it trains on
    assert [x for x in lines if x.startswith("checkpoint ")] == [lines[-2]]
    assert lines[-2].startswith("checkpoint checkpoints/step_00000003 ")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000003"]
    assert json.loads((tmp_path / "run.json").read_text())["provenance"]["eval_tokens"] == 768


def test_short_run_defaults():
    cfg = compose_cfg(*TINY, "steps=3")
    assert checkpoint_interval(cfg) == 10 and eval_budget(cfg) == 3 * 256
    cfg = compose_cfg(*TINY, "steps=500", "eval_tokens=4096")
    assert checkpoint_interval(cfg) == 50 and eval_budget(cfg) == 4096


def test_wall_time_sums_the_attempts(tmp_path):
    stop = StopRequest()
    stop.signum = signal.SIGTERM  # what the handler sets: checkpoint after the first step and stop
    first = run(compose_cfg(*SHORT), tmp_path, stop)
    assert first.status == "preempted" and first.wall_time_s > 0
    t0 = time.perf_counter()
    second = run(compose_cfg(*SHORT), tmp_path)
    took = time.perf_counter() - t0
    assert second.status == "completed"
    assert first.wall_time_s < second.wall_time_s <= first.wall_time_s + took
