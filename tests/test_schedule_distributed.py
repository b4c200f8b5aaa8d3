"""A precision schedule under data parallelism (gloo, 2 real ranks): the switch happens on every rank at
the same step and DDP's run equals one process's to the bit (2 ranks x 1 micro-batch against 1 process
x 2 micro-batches, as tests/test_distributed.py explains for recipes whose casts do not depend on the
micro-batch's place in the window); ZeRO-1's sharded optimizer states carry over the switch."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from harness.validation import load
from tests.helpers import free_port, serve_cases

pytestmark = pytest.mark.slow  # spawned ranks

BASE = ["model=gpt_tiny", "backend=emulated", "logger=none", "log_interval=1", "eval_interval=0"]
BASE += ["eval_tokens=1024", "data.num_tokens=100000", "checkpoint_interval=-1"]
BASE += ["micro_batch_size=2", "global_batch_size=4", "steps=4"]
SCHEDULE = [
    "recipe=nvfp4",
    "recipe.disable_stochastic_rounding=true",
    "schedule.phases=[{at_step: 2, recipe: bf16}]",
]
ZERO = ["optimizer=bf16_states", "recipe=blockwise", "schedule.phases=[{at_step: 2, recipe: bf16}]"]


def _case_run(overrides, run_dir):
    from harness.train import run

    summary = run(load(BASE + overrides), run_dir)
    return {"status": summary.status, "error": summary.error}


def _worker(rank: int, world: int, port: int, cases: list, report: str) -> None:
    serve_cases(rank, world, port, cases, report, {"run": _case_run}, "gloo")


def _rows(run_dir: Path, key: str) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r.get(key) for r in rows if "loss/train" in r]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sched2")
    cases = [("ddp", "run", ["parallel=ddp", *SCHEDULE], str(tmp / "ddp"))]
    cases.append(
        (
            "zero",
            "run",
            ["parallel=ddp", "optimizer.use_distributed_optimizer=true", *ZERO],
            str(tmp / "zero"),
        )
    )
    report = str(tmp / "report")
    multiprocessing.set_forkserver_preload([__name__])
    ctx = torch.multiprocessing.start_processes(
        _worker, args=(2, free_port(), cases, report), nprocs=2, join=True, start_method="forkserver"
    )
    assert ctx is None or ctx.join()
    results = json.loads(Path(f"{report}.0").read_text())
    for name, out in results.items():
        assert out.get("error") is None and out["status"] == "completed", (name, out)
    return tmp


def test_ddp_switches_with_one_process(two_ranks, tmp_path):
    from harness.train import run

    run(load(BASE + SCHEDULE), tmp_path / "one")
    for key in ("loss/train", "optim/grad_norm", "schedule/phase"):
        assert _rows(two_ranks / "ddp", key) == _rows(tmp_path / "one", key), key
    assert _rows(two_ranks / "ddp", "schedule/phase") == [0, 0, 1, 1]


def test_zero1_sharded_states_carry_over_the_switch(two_ranks, tmp_path):
    from harness.train import run

    run(load(BASE + ZERO), tmp_path / "one")
    sharded = json.loads((two_ranks / "zero" / "run.json").read_text())["provenance"]["parallel"]
    assert sharded["sharded_optimizer_states"] is True
    assert _rows(two_ranks / "zero", "loss/train") == pytest.approx(
        _rows(tmp_path / "one", "loss/train"), rel=1e-5
    )
