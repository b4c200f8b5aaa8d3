"""The masked-diffusion sweeps: dlm_matrix's --dry-run lists its jobs with verdicts, and the CPU sweep
runs end to end with its report (slow); a mask token the data could produce is refused in one line."""

from __future__ import annotations

import json

import pytest

from harness.multirun import launch as S
from harness.multirun.spec import build_jobs, key_of
from tests.helpers import TINY, run_cli, run_main


def _values(job, key):
    return [o.split("=", 1)[1] for o in job.overrides if key_of(o) == key]


def test_dlm_matrix_dry_run_lists_its_jobs_with_verdicts(capsys, tmp_path):
    jobs, _ = build_jobs("dlm_matrix", [])
    assert {_values(j, "objective")[0] for j in jobs} == {"masked_diffusion"} and len(jobs) == 18
    small = ["seed=0", "data.num_tokens=400000", "eval_tokens=8192", f"hydra.sweep.dir={tmp_path / 's'}"]
    code = S.main(["dlm_matrix", "--dry-run", *small])
    text = "".join(capsys.readouterr())
    assert code == 0 and "6 jobs (0 finished, 6 to run, 0 invalid)" in text


def test_a_mask_token_the_data_produces_is_refused_in_one_line(capsys, tmp_path):
    from harness import train as T

    args = [*TINY, "objective=masked_diffusion", "steps=1", f"hydra.run.dir={tmp_path / 'r'}"]
    code, err = run_main(capsys, T.main, "harness.train", *args)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(
        "error: objective.mask_token=None (= data vocabulary 256): outside model.vocab_size=256"
    )
    assert "data.vocab_size<=255" in lines[0]


def test_analysis_never_groups_masked_diffusion_with_autoregressive_runs(tmp_path):
    from analysis.pairing import group_key
    from analysis.run import Run

    def run(objective):
        config = {"objective": {"name": objective}} if objective else {}
        return Run(tmp_path, "r", config, {}, None, {"data": "markov", "model": "gpt_tiny"}, {}, {})

    assert run(None).data == run("autoregressive").data == "markov"  # a run from before the objective
    assert run("masked_diffusion").data == "markov+masked_diffusion"
    assert group_key(run("masked_diffusion")) != group_key(run("autoregressive"))


@pytest.mark.slow
def test_the_cpu_dlm_sweep_runs_end_to_end_with_its_report(tmp_path):
    """dlm_matrix_cpu cut to one seed and two steps (every arm, with telemetry): 6 jobs in one process."""
    out = tmp_path / "sweep"
    small = ["seed=0", "steps=2", "log_interval=1", "telemetry_interval=1", "eval_interval=0",
             "eval_tokens=512", "data.num_tokens=20000", "logger=none", "hydra/launcher=basic",
             f"hydra.sweep.dir={out}"]  # fmt: skip
    proc = run_cli(
        ["-m", "harness.sweep", "dlm_matrix_cpu", *small], timeout=600, env={"OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summaries = [json.loads((d / "summary.json").read_text()) for d in out.glob("*_s0")]
    assert [s["status"] for s in summaries] == ["completed"] * 6
    assert all(s["final_eval_loss"] > s["loss_floor"] > 0 for s in summaries)
    md = (out / "report" / "report.md").read_text()
    assert "tensorwise" in md and "nvfp4" in md and "markov+masked_diffusion" in md
