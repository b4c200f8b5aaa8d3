"""Precision schedules (docs/schedules.md), in process on gpt_tiny: a schedule run equals its
reference to the bit (the first recipe's run checkpointed at the switch step k, then the second recipe
warm-started from that checkpoint); the switch follows the written definition (what carries over, how
the new recipe's scale state starts, fresh quantizers); its position survives a preemption and shows
in the metrics and run.json; bad schedules are one `error:` line with exit code 2."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from harness import train as T
from harness.config.errors import ConfigError
from harness.lifecycle import checkpoint as C
from harness.lifecycle import metrics as M
from harness.lifecycle.artifacts import rng_state
from harness.lifecycle.signals import StopRequest
from harness.numerics import QuantizedLinear
from harness.training.trainer import Trainer
from harness.validation.load import load
from tests.helpers import compose_cfg, run_main, tiny_cpu_run

STEPS, K = 4, 2  # the switch before 0-based step K: K steps of the first recipe, then the second
RUN = tiny_cpu_run(STEPS, 2, 2, log_interval=1, eval_interval=0, eval_tokens=256)
TIMING = {M.STEP_MS, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_GPU, M.TFLOPS, M.MFU}
# first recipe; second recipe as a phase's keys (recipe, fields); second recipe as plain overrides
CASES = {
    # NVFP4 (stochastic rounding on: its generator carries over) to BF16
    "nvfp4-bf16": (["recipe=nvfp4"], "recipe: bf16", ["recipe=bf16"]),
    # one TE recipe class, a field changed (TE 2.20.2 would keep the module's quantizers)
    "tensorwise-hp_backward": (
        ["recipe=tensorwise"],
        "fields: {backward_override: high_precision}",
        ["recipe=tensorwise", "recipe.backward_override=high_precision"],
    ),
    # delayed (its preset: hybrid, E5M2 gradients) to delayed E4M3: the amax histories and scales
    # carry over (the warm start keeps them too)
    "delayed-e4m3": (
        ["recipe=delayed"],
        "fields: {fp8: e4m3}",
        ["recipe=delayed", "recipe.fp8=e4m3"],
    ),
    # a BF16 forward with an MXFP8 backward (TE's hybrid factory) after tensorwise
    "tensorwise-hp_fwd_mxfp8_bwd": (
        ["recipe=tensorwise"],
        "recipe: custom, fields: {quantizer_factory: high_precision_fwd_mxfp8_bwd_factory}",
        ["recipe=custom", "recipe.quantizer_factory=high_precision_fwd_mxfp8_bwd_factory"],
    ),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """gpt_tiny's GEMMs are too small for a second thread to pay for itself: half the CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rows(run_dir: Path) -> list[dict]:
    out = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in out]


def final_state(run_dir: Path) -> dict:
    _, step, state = C.load_latest(run_dir)
    assert step == STEPS
    return state


def schedule_run(first: list[str], phase: str) -> list[str]:
    return [*RUN, *first, f"schedule.phases=[{{at_step: {K}, {phase}}}]", "schedule.name=switch"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per case: (the first recipe's plain run, checkpointed at K; the second recipe warm-started
    from that checkpoint; the schedule run), made once."""
    done = {}

    def get(case: str) -> tuple[Path, Path, Path]:
        if case not in done:
            first, phase, second = CASES[case]
            root = tmp_path_factory.mktemp(case)
            a, b, s = root / "first", root / "warm", root / "schedule"
            T.run(compose_cfg(*RUN, *first, f"checkpoint_interval={K}", "checkpoint_keep=5"), a)
            T.run(compose_cfg(*RUN, *second, f"warm_start={a / 'checkpoints' / C.name_of(K)}"), b)
            T.run(compose_cfg(*schedule_run(first, phase)), s)
            done[case] = (a, b, s)
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_a_schedule_equals_its_two_plain_runs_to_the_bit(case, runs):
    first, warm, sched = runs(case)
    got = rows(sched)
    assert [r[M.SCHEDULE_PHASE] for r in got if M.LOSS_TRAIN in r] == [0] * K + [1] * (STEPS - K)
    got = [{k: v for k, v in r.items() if k != M.SCHEDULE_PHASE} for r in got]
    assert got[:K] == rows(first)[:K]  # the first recipe's steps
    assert got[K:] == rows(warm)  # then the warm-started run's, value by value (eval included)
    assert got[K:STEPS] != rows(first)[K:STEPS]  # the switch changed the numerics
    a, b = final_state(sched), final_state(warm)
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for name, st in a["optimizer"]["state"].items():
        for key, t in st.items():
            assert torch.equal(t, b["optimizer"]["state"][name][key]), (name, key)
    assert a["schedule"]["phase"] == 1 and a["schedule"]["recipe"] == b["schedule"]["recipe"]
    run = json.loads((sched / "run.json").read_text())
    assert [p["start_step"] for p in run["provenance"]["schedule"]] == [0, K]
    assert json.loads((sched / "summary.json").read_text())["variant"].endswith("+switch")


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    return Trainer(load([*RUN, *overrides]), tmp_path)


def _states(tr: Trainer) -> dict:
    return {
        "model": {k: v.clone() for k, v in tr.backend.model_state_dict(tr.model).items()},
        "optimizer": {k: v.clone() for k, v in tr.optimizer.state_dict()["state"][0].items()},
        "delayed": {n: s.state_dict() for n, s in tr.backend.numerics.forward_states.items()},
    }


@pytest.mark.parametrize(
    "first,phase,carries",
    [
        ("tensorwise", "recipe: delayed", False),  # a recipe TE has not run: scale 1, empty histories
        ("delayed", "fields: {fp8_amax_compute_algo: most_recent}", True),  # delayed to delayed
    ],
)
def test_the_switch_carries_what_the_definition_says(tmp_path, first, phase, carries):
    tr = _trainer(tmp_path, f"recipe={first}", f"schedule.phases=[{{at_step: 1, {phase}}}]")
    tr.train_step(0)
    tr.backend.after_optimizer_step(tr.model)
    before, rng = _states(tr), rng_state()
    old_quants = {id(q) for q in tr.backend.modules.values()}
    old_model = tr.model
    tr.enter_phase(1)
    after = _states(tr)
    assert tr.model is not old_model and not old_quants & {id(q) for q in tr.backend.modules.values()}
    assert all(
        isinstance(q, QuantizedLinear) and not q.__dict__.get("_weight_cache")
        for q in tr.backend.modules.values()
    )
    for key in ("model", "optimizer"):  # weights and optimizer state carry over exactly
        assert before[key].keys() == after[key].keys()
        assert all(torch.equal(before[key][k], after[key][k]) for k in before[key]), key
    assert torch.equal(rng_state()["torch"], rng["torch"])  # every RNG goes on where it was
    assert after["delayed"]  # the new recipe keeps delayed-scaling state
    for name, state in after["delayed"].items():
        if carries:
            assert all(torch.equal(state[k], before["delayed"][name][k]) for k in state), name
            assert bool((state["scale"] != 1).any()), name
        else:  # as TE starts a recipe it has not run: scale 1, an empty (zero) amax history
            assert bool((state["scale"] == 1).all()) and not bool(state["amax_history"].any()), name
    assert tr.train_step(1)[0].isfinite()


def test_the_schedule_position_survives_a_preemption_in_each_phase(runs, tmp_path, monkeypatch):
    *_, reference = runs("nvfp4-bf16")
    overrides = schedule_run(*CASES["nvfp4-bf16"][:2])
    step_fn = Trainer.train_step

    def preempted_at(step_to_stop):
        def step(self, step):
            if step == step_to_stop:
                signal.raise_signal(signal.SIGTERM)  # the real handler: checkpoint, then stop
            return step_fn(self, step)

        return step

    for stop_at in (K - 1, K):  # checkpointed at the switch step (still phase 0), then in phase 1
        monkeypatch.setattr(Trainer, "train_step", preempted_at(stop_at))
        with StopRequest() as stop:
            summary = T.run(compose_cfg(*overrides), tmp_path, stop)
        assert summary.status == "preempted" and C.load_latest(tmp_path)[2]["schedule"]["phase"] == int(
            stop_at >= K
        )
    monkeypatch.setattr(Trainer, "train_step", step_fn)
    T.run(compose_cfg(*overrides), tmp_path)
    assert rows(tmp_path) == rows(reference)
    a, b = final_state(tmp_path), final_state(reference)
    assert all(torch.equal(t, b["model"][k]) for k, t in a["model"].items())


@pytest.mark.parametrize(
    "phases,message",
    [
        ("[{at_step: 9, recipe: bf16}]", "schedule.phases.0 (phase 1) starts at step 9: must be in 1..3"),
        ("[{at_fraction: 0.5, at_step: 1}]", "set exactly one of at_step and at_fraction"),
        ("[{at_fraction: 1.5}]", "at_fraction=1.5: must be in (0, 1)"),
        ("[{at_step: 2}, {at_step: 1, recipe: bf16}]", "not after the phase before it (step 2)"),
        ("[{at_step: 1, recipe: fp3}]", "recipe=fp3: unknown"),
        ("[{at_step: 1, fields: {no_such: 1}}]", "fields.no_such: no such recipe field"),
        (
            "[{at_step: 1, recipe: delayed, fields: {backward_override: high_precision}}]",
            "schedule.phases.0 (phase 1): recipe.backward_override=high_precision with recipe=delayed",
        ),
        ("[{at_step: 1, recipe: delayed, fields: {fp8_amax_history_len: 16}}]", "must stay 1024, not 16"),
    ],
)
def test_a_bad_schedule_is_one_line(phases, message):
    recipe = "recipe=delayed" if "history" in phases else "recipe=tensorwise"
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        load([*RUN, recipe, f"schedule.phases={phases}"])


def test_a_phase_the_backend_cannot_run_is_refused_at_the_entry_point(capsys, tmp_path):
    code, err = run_main(
        capsys,
        T.main,
        "harness.train",
        *RUN,
        "hardware=h200",
        "backend=te",
        "recipe=tensorwise",
        "schedule.phases=[{at_step: 1, recipe: mxfp8}]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: schedule.phases.0 (phase 1): "), err
    assert "mxfp8" in lines[0] and not (tmp_path / "run" / "run.json").exists()


def test_a_warm_start_of_another_stream_is_refused(runs, tmp_path):
    first, *_ = runs("nvfp4-bf16")
    cfg = compose_cfg(*RUN, "recipe=bf16", "seed=1", f"warm_start={first}")
    with pytest.raises(ConfigError, match=r"warm_start=.*seed: 0 -> 1"):
        T.run(cfg, tmp_path / "b")
    assert not (tmp_path / "b" / "run.json").exists()


def test_the_report_marks_where_a_schedule_switches(runs, tmp_path):
    from analysis import plots
    from analysis.pairing import compare
    from analysis.reader import load_runs

    *_, sched = runs("nvfp4-bf16")
    T.run(compose_cfg(*RUN, "recipe=bf16"), tmp_path / "bf16")  # the group's BF16 baseline
    (group,) = compare(load_runs([sched, tmp_path / "bf16"])).groups
    fig = plots.loss_curves(group)
    per_step = json.loads((sched / "run.json").read_text())["provenance"]["tokens_per_step"]
    marks = [ln for ln in fig.axes[0].lines if str(ln.get_label()).endswith("bf16 from here")]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [K * per_step] * 2


@pytest.mark.slow
def test_sigkill_in_each_phase_then_identical(tmp_path):
    """Two SIGKILLs of a forked run (tests/test_resume.py's harness: 14 steps, checkpoints every 3),
    one in each phase of nvfp4 then BF16 from step 7; the resumed run equals the uninterrupted one."""
    from tests.test_resume import RUN as KILLED_RUN
    from tests.test_resume import assert_same, attempt

    overrides = [*KILLED_RUN, "recipe=nvfp4", "schedule.phases=[{at_step: 7, recipe: bf16}]"]
    assert attempt(tmp_path / "reference", overrides) == 0
    for step in (5, 10):  # after the checkpoints at 3 (phase 0) and 9 (phase 1)
        status = attempt(tmp_path / "killed", overrides, fault_step=step, sig=signal.SIGKILL)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (step, status)
    assert attempt(tmp_path / "killed", overrides) == 0
    assert_same(tmp_path / "reference", tmp_path / "killed")
    resumed = [
        a["resumed_from_step"] for a in json.loads((tmp_path / "killed" / "run.json").read_text())["attempts"]
    ]
    assert resumed == [None, 3, 9]


def test_a_schedule_is_a_sweep_axis():
    from harness.multirun.spec import build_jobs

    jobs, _ = build_jobs("schedule_cpu", [])  # arms of a named sweep
    arms = {j.arm: j.overrides for j in jobs}
    assert "schedule=bf16_last10pct" in arms["nvfp4-bare-bf16-last10pct"]
    assert "schedule=hp_backward_last10pct" in arms["tensorwise-hp-backward-last10pct"]
    assert not any(o.startswith("schedule=") for o in arms["nvfp4-bare"])
    jobs, _ = build_jobs("cpu_compare", ["schedule=none,bf16_last10pct"])  # a command-line axis
    swept = {o for j in jobs for o in j.overrides if o.startswith("schedule=")}
    assert swept == {"schedule=none", "schedule=bf16_last10pct"}


def test_a_warm_start_without_a_checkpoint_is_one_line(capsys, tmp_path):
    run_dir = tmp_path / "run"
    code, err = run_main(
        capsys,
        T.main,
        "harness.train",
        *RUN,
        f"warm_start={tmp_path / 'nothing'}",
        f"hydra.run.dir={run_dir}",
    )
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert (
        code == 2 and len(lines) == 1 and "warm_start=" in lines[0] and "no usable checkpoint" in lines[0]
    ), err
    assert not (run_dir / "run.json").exists()
