"""benchmarks.rerun_check: the same run twice, compared step by step to the bit."""

from __future__ import annotations

import json

import pytest

from benchmarks import rerun_check


def rows(losses, norms=None, eval_at=None):
    out = [
        {"step": i + 1, "loss/train": v, "optim/grad_norm": (norms or [1.0] * len(losses))[i]}
        for i, v in enumerate(losses)
    ]
    if eval_at:  # a step logged again in its own row, without the train keys
        out.append({"step": eval_at, "loss/eval": 3.0})
    return out


def test_identical_runs_are_identical_at_every_step_and_an_eval_row_does_not_hide_a_loss():
    a = rows([5.0, 4.0, 3.5], eval_at=3)
    assert rerun_check.compare(a, rows([5.0, 4.0, 3.5])) == {"identical_steps": 3, "first_difference": None}
    got = rerun_check.compare(a, rows([5.0, 4.0, 3.25], eval_at=3))
    assert got["identical_steps"] == 2 and got["first_difference"]["step"] == 3
    assert got["first_difference"]["abs_diff"] == 0.25


def test_the_first_difference_is_named_by_step_and_key():
    got = rerun_check.compare(rows([5.0, 4.0, 3.5]), rows([5.0, 4.0, 3.5], norms=[1.0, 1.5, 1.0]))
    assert got["identical_steps"] == 1
    assert got["first_difference"] == {
        "step": 2,
        "key": "optim/grad_norm",
        "a": 1.0,
        "b": 1.5,
        "abs_diff": 0.5,
    }
    short = rerun_check.compare(rows([5.0, 4.0]), rows([5.0]))
    assert short == {"identical_steps": 1, "first_difference": {"step": 2, "key": "missing in one run"}}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "3", "--", "steps=5"], "steps=5: rerun_check sets steps, log_interval, hydra.run.dir"),
        (["--", "hydra.run.dir=/x"], "use --steps"),
        (["--steps", "0"], "--steps 0: give at least 1 step"),
    ],
)
def test_options_it_owns_are_refused_in_one_line(tmp_path, capsys, argv, message):
    assert rerun_check.main(["--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "rerun_check.json").exists()


@pytest.mark.slow
def test_a_cpu_run_is_reproducible_to_the_bit_and_the_determinism_env_is_recorded(tmp_path, monkeypatch):
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # a value the caller set is kept, and recorded as kept
    argv = [
        "--out",
        str(tmp_path),
        "--steps",
        "2",
        "--deterministic-env",
        "--",
        "model=gpt_tiny",
        "data=markov",
    ]
    assert rerun_check.main(argv) == 0
    result = json.loads((tmp_path / "rerun_check.json").read_text())
    assert result["identical_steps"] == 2 and result["first_difference"] is None
    assert result["env_added"]["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert result["env_kept"] == {"NCCL_ALGO": "Tree"} and "NCCL_ALGO" not in result["env_added"]
    assert [v[0] for v in result["runs"]["a"]["values"]] == [1, 2] and result["device"] == "cpu"
