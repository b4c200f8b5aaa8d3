"""Exact resume under faults: a run killed (SIGKILL) or preempted (SIGTERM) at seeded random points
between checkpoints and restarted each time ends bit for bit where an uninterrupted run ends.

Each attempt is a forked child of this process (the imports are already paid for, so an attempt costs
only its steps); the fault is a real signal delivered to the child at the chosen step.
"""

from __future__ import annotations

import json
import os
import random
import signal
import traceback
from pathlib import Path

import pytest
import torch

from harness import train as T  # imported here once: every forked attempt inherits it
from harness.lifecycle import checkpoint as C
from harness.lifecycle import metrics as M
from harness.lifecycle.signals import StopRequest
from tests.helpers import compose_cfg, tiny_cpu_run

pytestmark = pytest.mark.slow  # forked children killed by real signals (the fast lane starts none)

STEPS, EVERY = 14, 3  # checkpoints at 3, 6, 9, 12 and the end; faults never land on those
RUN = tiny_cpu_run(  # global batch 4 of micro-batches of 2: accumulation on
    STEPS,
    2,
    4,
    checkpoint_interval=EVERY,
    checkpoint_keep=2,
    log_interval=2,  # not a divisor of EVERY: a checkpoint falls inside a logging window
    eval_interval=5,
    eval_tokens=512,
)
RECIPES = {
    "bf16": ["recipe=bf16"],
    "delayed": ["recipe=delayed"],
    "blockwise": ["recipe=blockwise"],
    "nvfp4": ["recipe=nvfp4"],  # stochastic rounding is on by default
    # masked diffusion: the masks and variable lengths come from the objective's position in the
    # checkpoint (a third of the micro-batches cut short)
    "dlm_tensorwise": [
        "recipe=tensorwise",
        "objective=masked_diffusion",
        "data.vocab_size=255",
        "objective.difflm_varilen_prob=0.3",
    ],
    # an MoE whose state crosses steps beyond the weights: the router's expert bias and each
    # expert's own delayed-scaling histories
    "moe_delayed": [
        "model=qwen3_moe_tiny",
        "recipe=delayed",
        "model.moe_router_score_function=sigmoid",
        "model.moe_router_enable_expert_bias=true",
    ],
}
DENSE = [r for r in RECIPES if not r.startswith("moe")]
TIMING = (M.STEP_MS, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_GPU, M.TFLOPS, M.MFU)


def attempt(run_dir: Path, overrides: list[str], fault_step: int | None = None, sig=signal.SIGKILL) -> int:
    """One attempt in a forked child; `sig` is sent to it at the start of 0-based step `fault_step`.
    Returns the child's wait status."""
    cfg = compose_cfg(*overrides)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            torch.set_num_threads(1)
            if fault_step is not None:
                step_fn = T.Trainer.train_step

                def faulty(self, step):
                    if step == fault_step:
                        os.kill(os.getpid(), sig)
                    return step_fn(self, step)

                T.Trainer.train_step = faulty
            with StopRequest() as stop:
                T.run(cfg, run_dir, stop)
            code = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def fault_points(seed: int, n: int = 5) -> list[int]:
    """n distinct 0-based steps between checkpoints (none right at one, none the last step)."""
    between = [s for s in range(1, STEPS - 1) if s % EVERY]
    return sorted(random.Random(seed).sample(between, n))


def outcome(run_dir: Path) -> tuple[list[dict], dict, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    _, step, state = C.load_latest(run_dir)
    assert step == STEPS
    return rows, state["model"], state["optimizer"]


def assert_same(a: Path, b: Path) -> None:
    rows_a, model_a, opt_a = outcome(a)
    rows_b, model_b, opt_b = outcome(b)
    assert rows_a == rows_b  # train losses, lr, grad norms and eval losses, value by value
    assert any(M.LOSS_EVAL in r for r in rows_a) and len(rows_a) == len({json.dumps(r) for r in rows_a})
    assert model_a.keys() == model_b.keys()
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    for name, st in opt_a["state"].items():
        for key, t in st.items():
            assert torch.equal(t, opt_b["state"][name][key]), (name, key)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["status"] == sb["status"] == "completed"
    assert (sa["final_train_loss"], sa["final_eval_loss"]) == (sb["final_train_loss"], sb["final_eval_loss"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of each recipe (made once per module)."""
    done = {}

    def get(recipe: str) -> Path:
        if recipe not in done:
            d = tmp_path_factory.mktemp(f"ref_{recipe}")
            assert attempt(d, RUN + RECIPES[recipe]) == 0
            done[recipe] = d
        return done[recipe]

    return get


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_sigkill_five_times_then_identical(recipe, reference, tmp_path):
    points = fault_points(seed=sum(map(ord, recipe)))
    for step in points:
        status = attempt(tmp_path, RUN + RECIPES[recipe], fault_step=step, sig=signal.SIGKILL)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (step, status)
    assert attempt(tmp_path, RUN + RECIPES[recipe]) == 0
    assert_same(reference(recipe), tmp_path)
    attempts = json.loads((tmp_path / "run.json").read_text())["attempts"]
    # the first attempt starts fresh; each later one resumes from the last checkpoint before its fault
    resumed = [a["resumed_from_step"] for a in attempts]
    assert resumed == [None] + [(s // EVERY) * EVERY or None for s in points]


@pytest.mark.parametrize("recipe", DENSE)
def test_sigterm_five_times_then_identical(recipe, reference, tmp_path):
    points = fault_points(seed=7 + sum(map(ord, recipe)))
    for step in points:
        assert attempt(tmp_path, RUN + RECIPES[recipe], fault_step=step, sig=signal.SIGTERM) == 0
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["status"] == "preempted" and summary["steps"] == step + 1
        assert C.load_latest(tmp_path)[1] == step + 1  # checkpointed at the step boundary
    assert attempt(tmp_path, RUN + RECIPES[recipe]) == 0
    assert_same(reference(recipe), tmp_path)
