"""A sweep owns its directory: the record, refused launches and resumes, jobs.yaml, the lock, malformed
sweep files, odd paths (in-process); stop signals and a killed driver (through the CLI, slow)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from harness.lifecycle import resume as R
from harness.multirun import launch as S
from harness.multirun import sweepdir as D
from harness.multirun.spec import hydra_value
from tests.faults import tmpfs
from tests.helpers import REPO

# a path with every character a shell or Hydra's grammar treats specially
ODD = "odd dir, [x] 'q' \"d\" a=b é"


class NoLauncher:
    """Stands for the Hydra launcher's process: starts nothing and ends at once (the sweep's jobs never
    start); records the command it was given."""

    commands: list[list[str]] = []

    def __init__(self, cmd, **kwargs):
        NoLauncher.commands.append(list(cmd))
        self.pid, self.returncode = 4194305, 0  # above Linux's largest pid: signals reach nothing

    def wait(self, timeout=None) -> int:
        return 0

    def poll(self) -> int:
        return 0

    def send_signal(self, sig) -> None:
        pass

    def __enter__(self) -> NoLauncher:
        return self

    def __exit__(self, *exc) -> None:
        pass


@pytest.fixture
def no_launch(monkeypatch):
    """main() as a user runs it, with a launcher that starts no job."""
    NoLauncher.commands.clear()
    monkeypatch.setattr(subprocess, "Popen", NoLauncher)


def launched(tmp_path: Path, name: str = "tiny_matrix", *extra: str) -> Path:
    sweep_dir = tmp_path / "sweep"
    S.main([name, *extra, f"hydra.sweep.dir={sweep_dir}", "--no-report"])
    assert (sweep_dir / "jobs.yaml").exists()
    return sweep_dir


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def snapshot(sweep_dir: Path) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sweep_dir.glob("*.yaml")}


def test_the_directory_records_the_sweep_and_refuses_a_new_launch(no_launch, capsys, tmp_path):
    sweep_dir = launched(tmp_path, "tiny_matrix", "steps=7")
    before = snapshot(sweep_dir)
    capsys.readouterr()
    assert S.main(["bf16_tiny_seeds", f"hydra.sweep.dir={sweep_dir}", "--no-report"]) == 2
    err = one_error(capsys)
    assert f"holds sweep tiny_matrix: resume it with --resume {sweep_dir}" in err
    assert snapshot(sweep_dir) == before, "jobs.yaml and sweep.yaml are never rewritten"
    record = OmegaConf.load(sweep_dir / "sweep.yaml")
    assert record.sweep == "tiny_matrix" and list(record.overrides) == ["steps=7"]
    assert record.file_sha256 == D.sha256((REPO / "sweeps" / "tiny_matrix.yaml").read_bytes())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert S.main(["tiny_matrix", f"hydra.sweep.dir={tmp_path / 'other'}", "--no-report"]) == 2
    assert "is not empty and holds no sweep" in one_error(capsys)


def test_resume_may_change_only_the_launcher(no_launch, capsys, tmp_path):
    sweep_dir = launched(tmp_path, "tiny_matrix", "steps=7", "hydra/launcher=local_parallel")
    capsys.readouterr()
    resume = ["tiny_matrix", "--resume", str(sweep_dir), "--no-report"]
    for arg, said in (
        ("steps=8", "steps=8 differs (the launch had steps=7)"),
        ("optimizer.lr=0.1", "optimizer.lr=0.1 differs (the launch did not set it)"),
        ("hydra.job.chdir=true", "hydra.job.chdir=true differs"),
    ):
        assert S.main([*resume, arg]) == 2
        assert said in one_error(capsys)
    # the launch's own overrides may be repeated; the launcher and its settings may change
    S.main([*resume, "steps=7", "hydra/launcher=slurm", "hydra.launcher.partition=p"])
    assert "error" not in capsys.readouterr().err
    assert NoLauncher.commands[-1][-2:] == ["hydra/launcher=slurm", "hydra.launcher.partition=p"]
    record = D.read_record(sweep_dir)
    assert D.resume_args(record, [], sweep_dir) == ["hydra/launcher=local_parallel"]
    assert D.resume_args(record, ["hydra.launcher.max_parallel=3"], sweep_dir) == [
        "hydra/launcher=local_parallel",
        "hydra.launcher.max_parallel=3",
    ]
    assert D.resume_args(record, ["hydra/launcher=slurm"], sweep_dir) == ["hydra/launcher=slurm"]
    assert S.main(["bf16_tiny_seeds", "--resume", str(sweep_dir)]) == 2
    assert "that is sweep tiny_matrix, not bf16_tiny_seeds" in one_error(capsys)


def test_resume_refuses_a_changed_sweep_file(no_launch, capsys, tmp_path):
    own = tmp_path / "own.yaml"
    own.write_text("overrides: [model=gpt_tiny, steps=4]\narms:\n  tw: [recipe=tensorwise]\n")
    sweep_dir = launched(tmp_path, str(own))
    own.write_text("overrides: [model=gpt_tiny, steps=5]\narms:\n  tw: [recipe=tensorwise]\n")
    capsys.readouterr()
    assert S.main([str(own), "--resume", str(sweep_dir)]) == 2
    assert f"{own} changed since this sweep was launched" in one_error(capsys)


@pytest.mark.parametrize("damage", ["truncated at a job", "cut mid-line", "emptied"])
def test_a_damaged_jobs_yaml_is_refused_never_shortened(no_launch, capsys, tmp_path, damage):
    sweep_dir = launched(tmp_path)
    jobs = sweep_dir / "jobs.yaml"
    text = jobs.read_text()
    lines = text.splitlines(keepends=True)
    second = next(i for i, line in enumerate(lines) if line.startswith("- name: 1_"))
    cut = {"truncated at a job": "".join(lines[:second]), "cut mid-line": text[:300], "emptied": ""}
    jobs.write_text(cut[damage])
    capsys.readouterr()
    assert S.main(["tiny_matrix", "--resume", str(sweep_dir), "--no-report"]) == 2
    assert f"{jobs} is not the job list written at the launch" in one_error(capsys)
    assert jobs.read_text() == cut[damage]


def test_resume_is_refused_while_another_driver_holds_the_sweep(no_launch, capsys, tmp_path):
    sweep_dir = launched(tmp_path)
    capsys.readouterr()
    with D.SweepLock(sweep_dir):  # another open file description: flock conflicts as across processes
        assert S.main(["tiny_matrix", "--resume", str(sweep_dir)]) == 2
        err = one_error(capsys)
    assert f"held by harness.sweep pid {os.getpid()} on host {socket.gethostname()}" in err


def test_a_sweep_from_before_records_resumes_if_its_job_list_is_whole(no_launch, capsys, tmp_path):
    sweep_dir = launched(tmp_path)
    (sweep_dir / "sweep.yaml").unlink(missing_ok=True)  # as an older lowp left it: jobs.yaml alone
    jobs = (sweep_dir / "jobs.yaml").read_bytes()
    (sweep_dir / "7_lost_s0").mkdir()
    (sweep_dir / "7_lost_s0" / "run.json").write_text("{}")
    capsys.readouterr()
    assert S.main(["tiny_matrix", "--resume", str(sweep_dir), "--no-report"]) == 2
    assert "jobs.yaml is damaged: it lacks the jobs of 7_lost_s0" in one_error(capsys)
    (sweep_dir / "7_lost_s0" / "run.json").unlink()
    S.main(["tiny_matrix", "--resume", str(sweep_dir), "--no-report"])
    assert "error" not in capsys.readouterr().err
    assert D.read_record(sweep_dir)["overrides"] is None and (sweep_dir / "jobs.yaml").read_bytes() == jobs


MALFORMED = {
    "not YAML": ("overrides: [model=gpt_tiny\narms: {tw: [recipe=tensorwise]}\n", "not valid YAML: expected"),
    "a list": ("- model=gpt_tiny\n", "expected a mapping with keys overrides, seeds"),
    "an unknown key": ("arm:\n  tw: [recipe=tensorwise]\n", "unknown key `arm`"),
    "arms not a mapping": ("arms: 5\n", "`arms` must be a mapping of arm name to a list of overrides"),
    "an arm not a list": ("arms:\n  tw: recipe=tensorwise\n", "arm `tw` must be a list of overrides"),
    "overrides not a list": ("overrides: 3\narms:\n  tw: [recipe=tensorwise]\n", "`overrides` must be"),
    "seeds not integers": ("seeds: [a]\narms:\n  tw: [recipe=tensorwise]\n", "`seeds` must be a list of int"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_sweep_file_is_one_line_exit_2(capsys, tmp_path, case):
    text, said = MALFORMED[case]
    own = tmp_path / "bad.yaml"
    own.write_text(text)
    assert S.main([str(own), "--dry-run"]) == 2
    err = one_error(capsys)
    assert f"error: sweep {own}: " in err and said in err


@pytest.mark.parametrize(
    "text", [ODD, "/a,b/c", "x\\", "it's\\'", "${oops}", "1e-3", "true", "[a]", "é", "0_bf16_s0"]
)
def test_hydra_value_parses_back_to_the_text(text):
    (ov,) = OverridesParser.create().parse_overrides([f"k={hydra_value(text)}"])
    assert not ov.is_sweep_override()
    assert OmegaConf.create({"k": ov.value()}).k == text


def test_odd_paths_reach_hydra_unchanged(no_launch, capsys, tmp_path):
    odd = tmp_path / ODD
    odd.mkdir()
    own, sweep_dir = odd / f"{ODD}.yaml", odd / "sweep"
    own.write_text("overrides: [model=gpt_tiny]\narms:\n  tw: [recipe=tensorwise]\n")
    S.main([str(own), f"hydra.sweep.dir={sweep_dir}", "--no-report"])
    out, err = capsys.readouterr()
    assert "error" not in err, err
    parser = OverridesParser.create()
    (cmd,) = NoLauncher.commands
    parsed = {o.key_or_group: o.value() for o in parser.parse_overrides(cmd[4:])}
    assert parsed["hydra.sweep.dir"] == str(sweep_dir)
    assert parsed["hydra.sweeper.jobs_file"] == str(sweep_dir / "jobs.yaml")
    for job in OmegaConf.load(sweep_dir / "jobs.yaml").jobs:
        values = {o.key_or_group: o.value() for o in parser.parse_overrides(list(job.overrides))}
        assert values["logger.wandb.group"].startswith(f"{ODD}/")
        assert values["hydra.sweep.subdir"] == job.name
    head = R.console_command("lowp-sweep", "harness.sweep")  # lowp-sweep, or python -m harness.sweep
    resume = shlex.join([*head, str(own), "--resume", str(sweep_dir)])
    assert f"resume: {resume}\n" in out  # its jobs did not run
    S.main(shlex.split(resume)[len(head) :])
    assert "error" not in capsys.readouterr().err and NoLauncher.commands[1] == cmd


# -- a full disk (a real one: a small tmpfs) ----------------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path):
    """A tmpfs of 4 KiB (one page), mounted in-process with mount(2)."""
    with tmpfs(tmp_path / "tiny", 4096) as mnt:
        yield mnt


def test_a_sweep_that_cannot_write_its_directory_leaves_nothing(full_disk, capsys):
    sweep_dir = full_disk / "sweep"
    # 8 jobs: a jobs.yaml larger than the disk
    assert S.main(["tiny_matrix", "seed=0,1,2,3", f"hydra.sweep.dir={sweep_dir}"]) == 1
    err = one_error(capsys)
    assert f"cannot write the sweep directory {sweep_dir}: No space left on device" in err
    assert list(full_disk.iterdir()) == []


# -- signals and kills, through the CLI ----------------------------------------------------------------------
# one job of gpt_tiny long enough to be stopped mid-run (it checkpoints at the step it is stopped at): the
# signal, sent at its first logged step, must find it still running (50 steps take 2 s, and once a loaded
# machine let them all finish first); the --resume that finishes it is what the length costs
LONG_STEPS = 400
LONG = f"""overrides: [model=gpt_tiny, backend=emulated, hardware=cpu, logger=none, steps={LONG_STEPS},
            log_interval=1, eval_interval=0, eval_tokens=512, micro_batch_size=2, global_batch_size=2,
            data.num_tokens=20000, checkpoint_interval=-1]
arms:
  bf16: [recipe=bf16]
"""


def start_sweep(args: list[str], err: Path, cwd: Path = REPO) -> subprocess.Popen:
    """The sweep's driver as a terminal's foreground job (a process group of its own: Ctrl-C signals
    the group), its stderr to `err` (a file: its launcher may outlive it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(err, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "harness.sweep", *args, "--no-report"],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=f,
            start_new_session=True,
        )


def when_running(driver: subprocess.Popen, run_dirs: str, where: Path, err: Path, timeout: float = 120):
    """Wait for the first logged step of the job whose run directory matches `where.glob(run_dirs)`;
    returns that directory and the pids of the launcher (the driver's child) and of the job (its run
    lock's holder)."""
    deadline = time.monotonic() + timeout
    while not [p for p in where.glob(f"{run_dirs}/metrics.jsonl") if p.read_text()]:
        assert driver.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.1)
    (run_dir,) = [p.parent for p in where.glob(f"{run_dirs}/metrics.jsonl")]
    (launcher,) = Path(f"/proc/{driver.pid}/task/{driver.pid}/children").read_text().split()
    return run_dir, {"launcher": int(launcher), "job": json.loads((run_dir / ".lock").read_text())["pid"]}


def gone(pid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_whose_resume_command_finishes_the_sweep(tmp_path):
    odd = tmp_path / ODD  # the sweep is launched from there, into its default multirun/NAME/<date_time>
    odd.mkdir()
    own = odd / f"{ODD}.yaml"
    own.write_text(LONG)
    driver = start_sweep([str(own)], tmp_path / "err", cwd=odd)
    run_dir, pids = when_running(driver, "multirun/*/*/0_bf16_s0", odd, tmp_path / "err")
    sweep_dir = run_dir.parent
    jobs_before = snapshot(sweep_dir)
    os.killpg(driver.pid, signal.SIGINT)  # Ctrl-C
    driver.wait(timeout=120)
    err = (tmp_path / "err").read_text()
    assert driver.returncode == 130 and "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("stopped by SIGINT: 1 of 1 jobs not finished; resume with: "), err
    assert gone(pids["launcher"]) and gone(pids["job"])
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "preempted"
    cmd = shlex.split(last.split("resume with: ", 1)[1])
    head = R.console_command("lowp-sweep", "harness.sweep")  # lowp-sweep, or python -m harness.sweep
    assert cmd == [*head, str(own), "--resume", str(sweep_dir)]
    again = [sys.executable, "-m", "harness.sweep", *cmd[len(head) :], "--no-report"]
    again = subprocess.run(again, cwd=odd, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == LONG_STEPS
    assert snapshot(sweep_dir) == jobs_before, "--resume rewrites neither jobs.yaml nor sweep.yaml"


@pytest.mark.slow
def test_sigterm_ends_with_one_line(tmp_path):
    own, sweep_dir = tmp_path / "long.yaml", tmp_path / "sweep"
    own.write_text(LONG)
    driver = start_sweep([str(own), f"hydra.sweep.dir={sweep_dir}"], tmp_path / "err")
    _, pids = when_running(driver, "sweep/0_bf16_s0", tmp_path, tmp_path / "err")
    driver.send_signal(signal.SIGTERM)  # as `timeout` or `kill` sends it (SIGHUP: tests/test_slurm.py)
    driver.wait(timeout=120)
    err = (tmp_path / "err").read_text()
    assert driver.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    head = R.console_command("lowp-sweep", "harness.sweep")
    resume = shlex.join([*head, str(own), "--resume", str(sweep_dir)])
    assert err.splitlines()[-1] == f"stopped by SIGTERM: 1 of 1 jobs not finished; resume with: {resume}"
    assert gone(pids["launcher"]) and gone(pids["job"])


@pytest.mark.slow
def test_killing_the_driver_ends_its_local_launcher_and_jobs(tmp_path):
    own, sweep_dir = tmp_path / "long.yaml", tmp_path / "sweep"
    own.write_text(LONG)
    driver = start_sweep([str(own), f"hydra.sweep.dir={sweep_dir}"], tmp_path / "err")
    run_dir, pids = when_running(driver, "sweep/0_bf16_s0", tmp_path, tmp_path / "err")
    driver.kill()
    driver.wait()
    assert gone(pids["launcher"]) and gone(pids["job"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted", "the job went on after its driver was killed"
    D.SweepLock(sweep_dir).acquire().release()  # free: a --resume would not collide with anything
