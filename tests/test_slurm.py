"""A sweep through a real single-node Slurm (tests/slurm/cluster.py), with two forced requeues.

Runs when CI=true or LOWP_TEST_SLURM=1 (it may apt-get slurm-wlm, munge, slurmdbd and mariadb-server
there, and starts daemons on free ports); skipped elsewhere. The 4-job sweep `tiny_matrix` goes through
hydra/launcher=slurm as shipped; one job is requeued with `scontrol requeue` (SIGTERM), another gets
submitit's USR2 (`scancel --signal=USR2`, what submitit sends before a time limit), both mid-run. Both
must resume from their checkpoints: every summary `completed`, exit code 0, the requeued runs' curves
equal step for step to uninterrupted runs of the same config, one W&B run per job. A stopped driver
(SIGHUP) leaves its Slurm job running, and `--resume` watches that job again instead of resubmitting it,
from a directory whose path has spaces, a comma, brackets, quotes, `=` and a non-ASCII character.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.lifecycle import metrics as M
from tests.helpers import REPO
from tests.slurm.cluster import Cluster, allowed_to_install, ensure_installed, missing_binaries

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TIMING = (M.STEP_MS, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_GPU, M.TFLOPS, M.MFU)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if not allowed_to_install():
        pytest.skip("real-Slurm test: set LOWP_TEST_SLURM=1 (or CI=true) to run it")
    ensure_installed()
    if missing_binaries():
        pytest.skip(f"Slurm binaries missing after install: {missing_binaries()}")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        t0 = time.monotonic()
        cluster.up()
        cluster.up_s = time.monotonic() - t0
        yield cluster
    finally:
        cluster.down()


def squeue(cluster: Cluster) -> dict[str, tuple[str, str]]:
    """job name -> (job id, state) of the jobs Slurm knows now."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T"], env=cluster.env, capture_output=True, text=True)
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 2]
    return {name: (jid, state) for jid, name, state in rows}


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def curve(run_dir: Path) -> list[tuple]:
    """(step, train loss, lr, grad norm) of every logged row, eval losses by step: the numbers, not timing."""
    out = []
    for r in rows(run_dir):
        out.append(tuple(sorted((k, v) for k, v in r.items() if k not in TIMING)))
    return out


def interrupt_when(cluster, sweep_dir: Path, job: str, after_step: int, cmd, deadline: float) -> str:
    """Wait until `job` runs and has logged `after_step` steps, then run cmd(job_id); returns the id."""
    while time.monotonic() < deadline:
        info = squeue(cluster).get(f"lowp:tiny_matrix:{job}")
        done = rows(sweep_dir / job)
        if info and info[1] == "RUNNING" and len(done) >= after_step:
            subprocess.run(cmd(info[0]), env=cluster.env, check=True, capture_output=True)
            return info[0]
        time.sleep(0.2)
    raise AssertionError(f"{job} never reached step {after_step} while running")


def test_sweep_on_real_slurm_survives_requeues(slurm, tmp_path):
    sweep_dir = tmp_path / "sweep"
    env = {**slurm.env, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    t0 = time.monotonic()
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.sweep",
            "tiny_matrix",
            f"hydra.sweep.dir={sweep_dir}",
            "hydra/launcher=slurm",
            "hydra.launcher.poll_s=1",
            "--no-report",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + float(os.environ.get("LOWP_SLURM_TEST_BUDGET_S", 420))
        # SIGTERM through Slurm's own requeue, then submitit's USR2, both mid-run
        term_id = interrupt_when(
            slurm, sweep_dir, "0_bf16_s0", 8, lambda j: ["scontrol", "requeue", j], deadline
        )
        usr2_id = interrupt_when(
            slurm, sweep_dir, "1_tensorwise_s0", 8, lambda j: ["scancel", "--signal=USR2", j], deadline
        )
        out, _ = driver.communicate(timeout=max(10, deadline - time.monotonic() + 60))
    except BaseException:
        driver.kill()
        print(driver.communicate()[0][-4000:])  # what the driver said, for the failure report
        raise
    wall = time.monotonic() - t0
    assert driver.returncode == 0, out[-4000:]

    jobs = ["0_bf16_s0", "1_tensorwise_s0", "2_bf16_s1", "3_tensorwise_s1"]
    summaries = {j: json.loads((sweep_dir / j / "summary.json").read_text()) for j in jobs}
    assert {j: s["status"] for j, s in summaries.items()} == dict.fromkeys(jobs, "completed"), out[-3000:]
    assert "4 jobs: 4 completed" in out and "[4/4]" in out

    runs = {j: json.loads((sweep_dir / j / "run.json").read_text()) for j in jobs}
    for job, jid in (("0_bf16_s0", term_id), ("1_tensorwise_s0", usr2_id)):
        slurm_info = runs[job]["provenance"]["slurm"]
        assert str(slurm_info["job_id"]) == jid and slurm_info["restart_count"] >= 1, slurm_info
        assert slurm_info["job_name"] == f"lowp:tiny_matrix:{job}" and slurm_info["node"]
        assert len(runs[job]["attempts"]) >= 2, runs[job]["attempts"]
    assert runs["2_bf16_s1"]["provenance"]["slurm"]["restart_count"] == 0

    # one W&B run per job: every attempt of a job logged to the same run id, and the ids differ
    ids = {}
    for job in jobs:
        offline = sorted((sweep_dir / job / "wandb").glob("offline-run-*"))
        run_ids = {p.name.rsplit("-", 1)[1] for p in offline}
        assert run_ids == {runs[job]["wandb"]["run_id"]}, (job, offline)
        ids[job] = run_ids.pop()
    assert len(set(ids.values())) == len(jobs)
    assert runs["0_bf16_s0"]["wandb"]["group"] == runs["3_tensorwise_s1"]["wandb"]["group"]
    assert runs["0_bf16_s0"]["wandb"]["group"].startswith("tiny_matrix/")

    # the requeued runs' curves equal uninterrupted runs of the same overrides, step for step
    spec = OmegaConf.to_container(OmegaConf.load(sweep_dir / "jobs.yaml"))
    by_name = {j["name"]: j["overrides"] for j in spec["jobs"]}
    refs = {}
    for job in ("0_bf16_s0", "1_tensorwise_s0"):  # both at once: the node's two jobs are done
        overrides = [o for o in by_name[job] if not o.startswith(("hydra.", "logger"))]
        cmd = [
            sys.executable,
            "-m",
            "harness.train",
            *overrides,
            "logger=none",
            f"hydra.run.dir={tmp_path / job}",
        ]
        refs[job] = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    for job, proc in refs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        got, want = curve(sweep_dir / job), curve(tmp_path / job)
        assert len(want) >= 40 and got == want, job
    print(f"\nslurm up {slurm.up_s:.1f}s; sweep of 4 jobs with 2 requeues {wall:.0f}s")


def test_two_task_job_on_real_slurm(slurm, tmp_path):
    """One job of 2 tasks (hydra.launcher.tasks_per_node=2): submitit starts the run in both, each
    builds the process group from Slurm's environment (SLURM_PROCID/SLURM_NTASKS, master = the
    node of the nodelist), and the DDP run equals one process on the same global batch."""
    sweep_dir = tmp_path / "sweep"
    env = {**slurm.env, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    common = [
        "model=gpt_tiny",
        "recipe=bf16",
        "backend=emulated",
        "logger=none",
        "steps=6",
        "log_interval=2",
        "eval_interval=0",
        "eval_tokens=1024",
        "data.num_tokens=100000",
        "micro_batch_size=2",
        "global_batch_size=4",
        "checkpoint_interval=-1",
    ]
    cmd = [
        sys.executable,
        "-m",
        "harness.train",
        "-m",
        *common,
        "parallel=ddp",
        "parallel.timeout_s=120",
        "hydra/launcher=slurm",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.poll_s=1",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (job_dir,) = [p for p in sweep_dir.iterdir() if (p / "summary.json").exists()]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2, summary
    run = json.loads((job_dir / "run.json").read_text())
    assert run["provenance"]["parallel"] == {
        "strategy": "ddp",
        "world_size": 2,
        "launcher": "slurm",
        "backend": "gloo",
        "sharded_optimizer_states": False,
        "amax_reduction": "data_parallel",
    }
    ref = tmp_path / "one"
    one = subprocess.run(
        [sys.executable, "-m", "harness.train", *common, f"hydra.run.dir={ref}"],
        cwd=REPO,
        env={k: v for k, v in env.items() if not k.startswith("SLURM_")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert curve(job_dir) == curve(ref)  # 2 ranks x 1 micro-batch == 1 process x 2, to the bit


# one job, held in its launcher `setup` until the test lets it go (no CPU spent waiting), then 2 steps
HELD = """overrides: [model=gpt_tiny, backend=emulated, hardware=cpu, logger=none, steps=2, log_interval=1,
            eval_interval=0, eval_tokens=512, micro_batch_size=2, global_batch_size=2, data.num_tokens=20000]
arms:
  bf16: [recipe=bf16]
"""


def read_until(stream, want: str, deadline: float) -> str:
    """Lines of `stream` until one contains `want` (the driver's stderr)."""
    seen = ""
    while time.monotonic() < deadline:
        line = stream.readline()
        seen += line
        if want in line or not line:
            return seen
    return seen


def test_a_stopped_driver_leaves_its_slurm_job_running_and_resume_watches_it(slurm, tmp_path):
    odd = tmp_path / "odd dir, [x] 'q' a=b é"
    odd.mkdir()
    own, sweep_dir, go = odd / "held sweep.yaml", odd / "sweep", tmp_path / "go"
    own.write_text(HELD)
    wait = f"while [ ! -e {go} ]; do sleep 0.2; done"
    env = {**slurm.env, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    launch = [
        *(sys.executable, "-m", "harness.sweep", str(own), f"hydra.sweep.dir={sweep_dir}", "--no-report"),
        *("hydra/launcher=slurm", "hydra.launcher.poll_s=1", "hydra.launcher.cpus_per_task=1"),
        f"hydra.launcher.setup=['export PYTHONUNBUFFERED=1','{wait}']",
    ]
    driver = subprocess.Popen(
        launch, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 180
    name = "lowp:held sweep:0_bf16_s0"
    while squeue(slurm).get(name, ("", ""))[1] != "RUNNING":
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
        time.sleep(0.2)
    job_id = squeue(slurm)[name][0]
    os.killpg(driver.pid, signal.SIGHUP)  # its terminal closed
    err = driver.communicate(timeout=60)[1]
    assert driver.returncode == 128 + signal.SIGHUP and "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert line.startswith(f"stopped by SIGHUP: 1 of 1 jobs not finished (Slurm jobs {job_id} go on)"), err
    assert squeue(slurm)[name] == (job_id, "RUNNING")
    assert json.loads((sweep_dir / "slurm_jobs.json").read_text()) == {"0_bf16_s0": job_id}

    resume = shlex.split(line.split("resume with: ", 1)[1])  # lowp-sweep or python -m harness.sweep, then
    args = resume[resume.index("--resume") - 1 :]  # the sweep, --resume and its directory
    again = subprocess.Popen(
        [sys.executable, "-m", "harness.sweep", *args, "--no-report"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = read_until(again.stderr, "running 1", deadline)  # watching the job, which still waits
    assert "running 1" in seen, seen
    go.touch()
    out, err = again.communicate(timeout=max(10, deadline - time.monotonic()))
    assert again.returncode == 0, seen + err
    run = json.loads((sweep_dir / "0_bf16_s0" / "run.json").read_text())
    assert str(run["provenance"]["slurm"]["job_id"]) == job_id
    assert run["provenance"]["slurm"]["restart_count"] == 0
    assert json.loads((sweep_dir / "0_bf16_s0" / "summary.json").read_text())["status"] == "completed"
    assert json.loads((sweep_dir / "slurm_jobs.json").read_text()) == {"0_bf16_s0": job_id}, "not resubmitted"
