"""Watching and steering a sweep, in process: the live lines read from run directories, the ETA from
step rates, `status`/`logs`/`cancel` on a sweep directory, the reserved names, the dry run's verdicts
streamed as each job is composed, and the report's W&B flag (the real sweeps: test_sweep_live.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from harness.multirun import launch as L
from harness.multirun import progress as P
from harness.multirun.spec import Job, jobs_text


def write_run(run_dir: Path, steps: int, rows: list[dict], summary: dict | None = None, wandb=None) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"config": {"steps": steps}, "wandb": wandb}))
    lines = [json.dumps(r) for r in rows]
    (run_dir / "metrics.jsonl").write_text(
        "\n".join(lines) + "\n" + '{"step": 9, "loss/tr'
    )  # a row being written
    (run_dir / "train.log").write_text("step 1/40 ...\nstep 2/40 ...\n")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def row(step: int, loss: float, tok_s: float = 2500.0, step_ms: float = 100.0) -> dict:
    return {"step": step, "tokens": step * 256, "loss/train": loss, "throughput/tokens_per_s": tok_s,
            "time/step_ms": step_ms}  # fmt: skip


def test_running_jobs_show_step_loss_tokens_and_an_eta_before_any_job_ends(tmp_path):
    a, b = tmp_path / "0_bf16_s0", tmp_path / "1_mxfp8_s0"
    write_run(a, 40, [row(1, 5.5), row(2, 5.25), {"step": 2, "tokens": 512, "loss/eval": 5.4}])
    write_run(b, 40, [row(10, 4.75, tok_s=1.5e6, step_ms=50.0)])
    out = io.StringIO()
    with P.SweepProgress("m", 3, stream=out, plain_every_s=0) as progress:
        progress.update(running=2, queued=1, run_dirs={a.name: a, b.name: b})
        text = out.getvalue()
        # a's 38 steps at 0.1 s + b's 30 at 0.05 s + the queued job at the mean length (4 s and 2 s)
        assert progress.eta_s() == (3.8 + 1.5 + 3.0) / 2
        # a finished job's length is the time it was seen running (start-up included), not its wall_time_s
        progress.running[b.name].since -= 7.0
        progress.finished(b.name, {"status": "completed", "wall_time_s": 2.0})
        assert 7.0 <= progress.lengths[0] < 8.0
    assert "ETA 0m04s" in text, text
    assert "  0_bf16_s0                        step 2/40  loss 5.2500  2.5k tok/s  left 0m03s" in text
    assert "  1_mxfp8_s0                       step 10/40  loss 4.7500  1.50M tok/s  left 0m01s" in text


def test_a_pipe_gets_the_lines_every_n_seconds_and_only_when_something_moved(tmp_path):
    a = tmp_path / "0_bf16_s0"
    write_run(a, 40, [row(1, 5.5)])
    out = io.StringIO()
    progress = P.SweepProgress("m", 1, stream=out, plain_every_s=3600)
    progress.update(running=1, queued=0, run_dirs={a.name: a})
    progress.update(running=1, queued=0, run_dirs={a.name: a})  # within the interval: nothing
    assert out.getvalue().count("step 1/40") == 1
    progress.plain_every_s = 0
    progress.update(running=1, queued=0, run_dirs={a.name: a})  # nothing moved: nothing
    assert out.getvalue().count("step 1/40") == 1
    (a / "metrics.jsonl").write_text(json.dumps(row(2, 5.0)) + "\n")
    progress.update(running=1, queued=0, run_dirs={a.name: a})
    assert "step 2/40  loss 5.0000" in out.getvalue()


def fixture_sweep(tmp_path: Path) -> Path:
    sweep_dir = tmp_path / "sweep"
    arms = ("bf16", "mxfp8", "nvfp4")
    jobs = [Job(f"{i}_{arm}_s0", [f"recipe={arm}", "seed=0"], arm, 0) for i, arm in enumerate(arms)]
    sweep_dir.mkdir()
    (sweep_dir / "jobs.yaml").write_text(jobs_text("m", "2026-01-01_00-00-00", jobs))
    done = {"status": "completed", "final_train_loss": 4.5, "final_eval_loss": 4.625, "tokens_per_s": 3000.0}
    write_run(sweep_dir / jobs[0].name, 40, [row(40, 4.5)], done)
    write_run(sweep_dir / jobs[1].name, 40, [row(12, 5.0)])
    return sweep_dir


def test_status_reads_every_jobs_state_from_the_sweep_directory(capsys, tmp_path):
    sweep_dir = fixture_sweep(tmp_path)
    assert L.main(["status", str(sweep_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"sweep {sweep_dir}: 3 jobs; no driver (ended or stopped)"
    assert out[2].split() == ["0_bf16_s0", "completed", "40/40", "4.5000", "4.6250", "2.5k", "-"]
    assert out[3].split() == ["1_mxfp8_s0", "stopped", "12/40", "5.0000", "-", "2.5k", "-"]
    assert out[4].split() == ["2_nvfp4_s0", "not", "started", "-", "-", "-", "-", "-"]


def test_logs_prints_a_jobs_log_by_name_number_or_prefix(capsys, tmp_path):
    sweep_dir = fixture_sweep(tmp_path)
    for given in ("1_mxfp8_s0", "1", "1_mx"):
        assert L.main(["logs", str(sweep_dir), given]) == 0
        assert capsys.readouterr().out == "step 1/40 ...\nstep 2/40 ...\n"
    assert L.main(["logs", str(sweep_dir), "0", "-f"]) == 0  # followed until its run ended: at once here
    assert capsys.readouterr().out == "step 1/40 ...\nstep 2/40 ...\n"
    assert L.main(["logs", str(sweep_dir), "2"]) == 1
    assert "2_nvfp4_s0 has no log yet" in capsys.readouterr().err
    # a Slurm job that failed before its run logged anything: its submitit output
    (sweep_dir / "slurm_jobs.json").write_text('{"2_nvfp4_s0": "77"}')
    (sweep_dir / ".submitit" / "77").mkdir(parents=True)
    (sweep_dir / ".submitit" / "77" / "77_0_log.out").write_text("setup: module: command not found\n")
    assert L.main(["logs", str(sweep_dir), "2"]) == 0
    assert capsys.readouterr().out == "setup: module: command not found\n"
    assert L.main(["logs", str(sweep_dir), "x"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: logs {sweep_dir} x: no single job of that name; jobs: 0_bf16_s0"
    )


def test_cancel_without_a_driver_or_slurm_jobs_says_so(capsys, tmp_path):
    sweep_dir = fixture_sweep(tmp_path)
    assert L.main(["cancel", str(sweep_dir)]) == 0
    assert capsys.readouterr().out.startswith("nothing to cancel: no driver holds")


def test_bad_commands_and_reserved_sweep_names_are_one_line_exit_2(capsys, tmp_path):
    own = tmp_path / "cancel.yaml"
    own.write_text("overrides: [model=gpt_tiny]\n")
    assert L.main([str(own)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a sweep may not be named 'cancel'" in err and "rename its file" in err
    assert L.main(["status", str(tmp_path)]) == 2
    assert "no jobs.yaml there" in capsys.readouterr().err
    assert L.main(["logs", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: usage: python -m harness.sweep status DIR | logs")


def test_dry_run_prints_each_verdict_as_its_job_is_composed(capsys, monkeypatch, tmp_path):
    printed_before = []  # stdout so far, each time a job is composed
    verdict = L.Validator.verdict

    def spy(self, job):
        printed_before.append(capsys.readouterr().out)
        return verdict(self, job)

    monkeypatch.setattr(L.Validator, "verdict", spy)
    small = ["data.num_tokens=20000", "steps=2", f"hydra.sweep.dir={tmp_path / 's'}"]
    assert L.main(["tiny_matrix", "--dry-run", *small]) == 0
    assert printed_before[0] == "" and printed_before[1].startswith("0_bf16_s0                          ok\n")
    assert printed_before[3].startswith("2_bf16_s1 ") and "3_tensorwise_s1 " in capsys.readouterr().out


def test_the_report_goes_to_wandb_in_the_runs_mode_when_they_logged_there(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sweep = L.Sweep("m", Path("m.yaml"), tmp_path, "s", [Job("0_bf16_s0", [], "bf16", 0)], [], [])
    write_run(tmp_path / "0_bf16_s0", 4, [row(1, 5.0)])
    cmd, env = L.report_command(sweep)
    assert cmd[-2:] == ["analysis.report", str(tmp_path)] and "WANDB_MODE" not in env
    (tmp_path / "0_bf16_s0" / "run.json").write_text(json.dumps({"wandb": {"mode": "online", "run_id": "x"}}))
    cmd, env = L.report_command(sweep)
    assert cmd[-1] == "--wandb" and env["WANDB_MODE"] == "online"
