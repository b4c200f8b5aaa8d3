"""Named sweeps: expansion with BF16 baselines, command-line rules, --dry-run, failures, --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.multirun import launch as S
from harness.multirun.spec import SweepError, build_jobs, key_of, known_sweeps, load_spec
from tests.helpers import run_cli

SHARED = ("model", "data", "steps", "global_batch_size", "eval_tokens", "hardware")


def values(job, key):
    return [o.split("=", 1)[1] for o in job.overrides if key_of(o) == key]


@pytest.mark.parametrize("name", known_sweeps())
def test_every_sweep_has_its_bf16_baseline_at_every_seed(name):
    spec = load_spec(name)
    jobs, _ = build_jobs(name, [])
    seeds = spec.get("seeds") or [0]
    assert sorted({j.seed for j in jobs}) == sorted(seeds)
    for seed in seeds:
        at_seed = [j for j in jobs if j.seed == seed]
        assert sum(values(j, "recipe") == ["bf16"] for j in at_seed) >= 1, (name, seed)
        if name != "bf16_tiny_seeds":  # BF16 alone by design: the tests' smallest sweep
            assert len(at_seed) >= 2, "a sweep compares something with BF16"
        for key in SHARED:  # same model, data and token budget as the baseline
            assert len({tuple(values(j, key)) for j in at_seed}) == 1, (name, key)
    names = [j.name for j in jobs]
    assert len(set(names)) == len(names)
    assert all(values(j, "hydra.sweep.subdir") == [j.name] for j in jobs)
    assert all(len(values(j, key_of(o))) == 1 for j in jobs for o in j.overrides), "one value per key"


def test_hopper_matrix_is_the_issue_matrix():
    jobs, _ = build_jobs("hopper_matrix", [])
    arms = {(values(j, "backend")[0], values(j, "recipe")[0]) for j in jobs}
    assert arms == {("te", r) for r in ("bf16", "delayed", "tensorwise", "blockwise")} | {
        ("emulated", "mxfp8"),
        ("emulated", "nvfp4"),
    }


def test_command_line_seeds_replace_a_comma_list_multiplies_and_a_value_wins():
    jobs, hydra_args = build_jobs(
        "tiny_matrix", ["seed=3,4,5", "hydra/launcher=slurm", "hydra.launcher.poll_s=2"]
    )
    assert sorted({j.seed for j in jobs}) == [3, 4, 5] and len(jobs) == 6
    assert hydra_args == ["hydra/launcher=slurm", "hydra.launcher.poll_s=2"]
    jobs, _ = build_jobs("tiny_matrix", ["optimizer.lr=1e-3,2e-3"])
    assert len(jobs) == 8 and len({j.name for j in jobs}) == 8
    assert {float(values(j, "optimizer.lr")[0]) for j in jobs} == {1e-3, 2e-3}
    jobs, _ = build_jobs("hopper_matrix", ["backend=emulated", "hardware=cpu"])
    assert {tuple(values(j, "backend")) for j in jobs} == {("emulated",)}


def test_an_arm_may_not_change_the_token_budget(tmp_path):
    own = tmp_path / "own.yaml"
    own.write_text("overrides: [model=gpt_tiny]\narms:\n  longer: [recipe=tensorwise, steps=500]\n")
    with pytest.raises(SweepError, match="arm longer sets steps"):
        build_jobs(str(own), [])


def test_unknown_sweep_and_bad_options_are_one_line_exit_2(capsys):
    assert S.main(["no_such_sweep"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose one of" in err and "hopper_matrix" in err
    assert S.main(["tiny_matrix", "--dryrun"]) == 2
    assert "unknown option --dryrun" in capsys.readouterr().err


def test_dry_run_lists_every_job_with_its_verdict(capsys, tmp_path):
    # a smaller markov stream than the file's (its data check builds the stream): same 18 verdicts
    small = ["data.num_tokens=400000", "eval_tokens=8192"]
    assert S.main(["hopper_matrix", "--dry-run", *small, f"hydra.sweep.dir={tmp_path / 's'}"]) == 0
    out = capsys.readouterr().out
    assert "18 jobs (0 finished, 18 to run, 0 invalid)" in out
    assert out.count(" ok") == 18 and "warning: recipe=nvfp4 without" in out
    assert not (tmp_path / "s").exists(), "a dry run writes nothing"


def test_an_invalid_job_stops_the_sweep_before_anything_runs(capsys, tmp_path):
    own = tmp_path / "bad.yaml"
    own.write_text("overrides: [model=gpt_tiny]\narms:\n  broken: [optimizer.eps=-1.0]\n")
    assert S.main([str(own), f"hydra.sweep.dir={tmp_path / 's'}"]) == 2
    captured = capsys.readouterr()
    assert "1_broken_s0" in captured.err and "optimizer.eps=-1.0: out of range" in captured.err
    assert "nothing launched" in captured.err and not (tmp_path / "s").exists()


FAILING = """overrides: [model=gpt_tiny, steps=3, log_interval=1, eval_interval=0, eval_tokens=512,
            micro_batch_size=4, global_batch_size=4, data.num_tokens=20000, logger=none]
seeds: [0]
arms:
  broken: [recipe=custom, backend=emulated, "recipe.quantizer_factory=os.path:join"]
"""


@pytest.mark.slow
def test_a_failed_job_never_stops_the_sweep_and_counts_in_the_exit_code(tmp_path):
    own = tmp_path / "failing.yaml"
    own.write_text(FAILING)
    sweep_dir = tmp_path / "sweep"
    # two at a time (local_parallel); the resume below goes through the default serial launcher
    res = run_cli(
        [
            "-m",
            "harness.sweep",
            str(own),
            f"hydra.sweep.dir={sweep_dir}",
            "hydra/launcher=local_parallel",
        ]
    )
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-3000:]
    ok = json.loads((sweep_dir / "0_bf16_s0" / "summary.json").read_text())
    assert ok["status"] == "completed"
    assert "1_broken_s0" in res.stderr and "0_bf16_s0" in res.stderr and "[2/2]" in res.stderr
    assert "2 jobs: 1 completed" in res.stdout and (sweep_dir / "report" / "report.html").exists()
    before = (sweep_dir / "0_bf16_s0" / "metrics.jsonl").stat().st_mtime_ns
    again = run_cli(["-m", "harness.sweep", "failing", "--resume", str(sweep_dir), "--no-report"])
    assert again.returncode == 1
    assert "[1/1] 1_broken_s0" in again.stderr and "0_bf16_s0" not in again.stderr
    assert (sweep_dir / "0_bf16_s0" / "metrics.jsonl").stat().st_mtime_ns == before
    assert Path(sweep_dir / "jobs.yaml").exists()


def test_dry_run_checks_each_jobs_data_too(capsys, tmp_path):
    own = tmp_path / "short_eval.yaml"
    own.write_text(
        "overrides: [model=gpt_tiny, data.num_tokens=20000, eval_tokens=4096, micro_batch_size=4]\n"
        "arms:\n  tensorwise: [recipe=tensorwise, backend=emulated]\n"
    )
    assert S.main([str(own), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert out.count("error: eval_tokens=4096") == 2 and "hold out more" in out
