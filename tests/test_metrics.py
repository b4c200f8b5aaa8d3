"""The step timer: steady-state median, steps after a host sync left out."""

from __future__ import annotations

import torch

from harness.lifecycle.metrics import StepTimer


def test_median_leaves_out_warmup_and_steps_after_a_sync():
    t = StepTimer(torch.device("cpu"))
    t.times_ms = {0: 900.0, 1: 500.0, 2: 100.0, 3: 101.0, 4: 140.0, 5: 102.0, 6: 99.0}
    t.cold = {1, 4}  # 4 began right after a logging step's sync
    assert t.median_ms(after_step=2) == 100.5  # median of 100, 101, 102, 99
    t.cold = {2, 3, 4, 5, 6}  # nothing else left: the cold steps count
    assert t.median_ms(after_step=2) == 101.0


def test_trainer_marks_steps_after_logging_as_cold(tmp_path, monkeypatch):
    from harness.lifecycle import metrics
    from harness.train import run
    from tests.helpers import compose_cfg

    timers = []
    init = metrics.StepTimer.__init__
    monkeypatch.setattr(
        metrics.StepTimer, "__init__", lambda self, d: (timers.append(self), init(self, d))[1]
    )
    overrides = ("model=gpt_tiny", "logger=none", "steps=7", "log_interval=3", "eval_interval=0")
    assert run(compose_cfg(*overrides, "checkpoint_interval=-1"), tmp_path).status == "completed"
    assert timers[-1].cold == {1, 3, 6, 7}  # after steps 0 (first), 2 and 5 (every 3rd), 6 (last)


def test_grad_norm_is_computed_only_when_clipping_or_logging(tmp_path, monkeypatch):
    import json

    from harness import optim
    from harness.train import run
    from harness.training import trainer
    from tests.helpers import compose_cfg

    steps = []
    orig = optim.clip_grad
    monkeypatch.setattr(trainer, "clip_grad", lambda o, m: (steps.append(m), orig(o, m))[1])
    cfg = compose_cfg("model=gpt_tiny", "logger=none", "steps=6", "log_interval=3", "optimizer.clip_grad=0")
    assert run(cfg, tmp_path).status == "completed"
    assert len(steps) == 3  # steps 1, 3 and 6 log; no clipping asked
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["optim/grad_norm"] > 0 for r in rows if "loss/train" in r)
    steps.clear()
    assert run(
        compose_cfg("model=gpt_tiny", "logger=none", "steps=6", "log_interval=3"), tmp_path / "c"
    ).status
    assert len(steps) == 6  # clipping needs the norm every step
