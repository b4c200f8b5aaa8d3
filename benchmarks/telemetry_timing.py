"""Timing one Trainer's `train_step` with numerics telemetry off, then on at an interval, for the
telemetry cost benchmarks (te_telemetry_cost: the run's own rows on TE; counterfactual_cost: the
candidates' rows too).

`telemetry_phases` times `warmup` steps (left out), `steps` with telemetry off, then `telemetry_steps`
intervals of `interval` steps from a telemetry step on, split into the telemetry steps (hooks
installed, rows computed and synced) and the steps between them, which must cost what "off" costs;
then one more telemetry pass counts the rows a telemetry step writes. Every step runs between CUDA
syncs and is recorded as (step, wall ms, this process's CPU ms): on a shared CPU the CPU time is the
robust figure.
"""

from __future__ import annotations

import time


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(tr, first: int, count: int) -> list[tuple[int, float, float]]:
    """Steps first..first+count-1 of `tr`: (step, wall ms, CPU ms) each."""
    out = []
    for step in range(first, first + count):
        _sync()
        t0, c0 = time.perf_counter(), time.process_time()
        tr.train_step(step)
        _sync()
        out.append((step, (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3))
    return out


def telemetry_phases(tr, warmup: int, steps: int, interval: int, telemetry_steps: int) -> dict:
    """{"off", "telemetry", "between"}: the timed steps of each phase; "rows": rows per telemetry step.
    `tr` is built with telemetry_interval=0; it is left at `interval`."""
    timed_steps(tr, 0, warmup)
    off = timed_steps(tr, warmup, steps)
    tr.cfg.telemetry_interval = interval
    first = warmup + steps
    first += -first % interval  # start on a telemetry step
    on = timed_steps(tr, first, interval * telemetry_steps)
    with tr.backend.collect_telemetry() as rows:  # one more telemetry pass, to count its rows
        x, y = tr._next_batch()
        with tr.backend.autocast():
            loss = tr.model.loss(x, y)
        loss.backward()
    tr.optimizer.zero_grad()
    return {
        "off": off,
        "telemetry": [t for t in on if t[0] % interval == 0],
        "between": [t for t in on if t[0] % interval != 0],
        "rows": len(rows),
    }
