"""A sweep seen and steered from another shell, read from its directory alone (NeMo-Run's status/logs/cancel):

    python -m harness.sweep status DIR           every job's state, step, losses and tokens/s; the driver
    python -m harness.sweep logs DIR JOB [-f]    the job's train.log (JOB: its name, number or a prefix;
                                                 a Slurm job's submitit output before it has one);
                                                 -f follows it until the job ends
    python -m harness.sweep cancel DIR           stop the sweep: the driver (its process group: local jobs
                                                 checkpoint and end) and, on Slurm, scancel of its jobs

What a sweep directory records is enough (harness.multirun.sweepdir): jobs.yaml the jobs, .lock the driver
that holds it (flock(2): held only while the driver or its launcher lives), slurm_jobs.json the Slurm job
ids, and each run directory its own state (summary.json, metrics.jsonl, train.log). `status` asks Slurm
(`squeue`) for the recorded jobs where it can. These words are reserved: no sweep may be named so.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness.multirun import sweepdir as D
from harness.multirun.progress import (
    FINISHED,
    fmt_loss,
    fmt_rate,
    last_train_row,
    planned_steps,
    read_summary,
)
from harness.multirun.spec import Job, SweepError, read_jobs

COMMANDS = ("status", "logs", "cancel")
USAGE = "status DIR | logs DIR JOB [-f] | cancel DIR"


def main(command: str, args: list[str]) -> int:
    flags = [a for a in args if a.startswith("-")]
    args = [a for a in args if not a.startswith("-")]
    wanted = {"status": 1, "logs": 2, "cancel": 1}[command]
    allowed = {"logs": ("-f", "--follow")}.get(command, ())
    if len(args) != wanted or any(f not in allowed for f in flags):
        raise SweepError(
            f"usage: python -m harness.sweep {USAGE} (got: {command} {shlex.join(args + flags)})"
        )
    sweep_dir = Path(args[0]).absolute()
    if not (sweep_dir / D.JOBS).exists():
        raise SweepError(
            f"{command} {args[0]}: no {D.JOBS} there (not a sweep directory made by harness.sweep)"
        )
    _, _, jobs = read_jobs(sweep_dir / D.JOBS)
    if command == "status":
        return status(sweep_dir, jobs)
    if command == "logs":
        return logs(sweep_dir, find_job(jobs, args[1], sweep_dir), follow=bool(flags))
    return cancel(sweep_dir, jobs)


# -- who holds the sweep ----------------------------------------------------------------------------------
def driver(sweep_dir: Path) -> dict | None:
    """The driver holding the directory ({pid, host, since, launcher}), or None where none does (the
    kernel dropped the flock when it and its launcher ended, however they ended)."""
    try:
        fd = os.open(sweep_dir / D.LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return D._read_json(fd) or {"pid": "?", "host": "?"}
    finally:
        os.close(fd)


def slurm_states(ids: list[str]) -> dict[str, str]:
    """Slurm job id -> state of those Slurm still lists (empty without squeue, or when it fails)."""
    if not ids:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split("|", 1) for line in out.stdout.splitlines() if line.count("|") == 1)


# -- status -----------------------------------------------------------------------------------------------
def job_state(run_dir: Path, held: bool, slurm_state: str | None) -> str:
    """completed/diverged/failed/preempted from summary.json, unless Slurm or the driver says it runs
    again (a requeued job); else running, queued, stopped (no driver) or not started."""
    summary = read_summary(run_dir) or {}
    if slurm_state in ("RUNNING", "COMPLETING"):
        return "running"
    if slurm_state:
        return slurm_state.lower()
    if summary.get("status") and (summary["status"] in FINISHED or not held):
        return summary["status"]
    if (run_dir / "run.json").exists() or (run_dir / "metrics.jsonl").exists():
        return "running" if held else "stopped"
    return "queued" if held else "not started"


def status(sweep_dir: Path, jobs: list[Job]) -> int:
    holder = driver(sweep_dir)
    ids = D.slurm_jobs(sweep_dir)
    states = slurm_states(list(ids.values()))
    rows = [("job", "status", "step", "train loss", "eval loss", "tok/s", "slurm")]
    for job in jobs:
        run_dir = sweep_dir / job.name
        summary, row = read_summary(run_dir) or {}, last_train_row(run_dir) or {}
        steps = planned_steps(run_dir)
        step = f"{row['step']}/{steps or '?'}" if row else "-"
        slurm = ids.get(job.name)
        rows.append(
            (
                job.name,
                job_state(run_dir, holder is not None, states.get(slurm) if slurm else None),
                step,
                fmt_loss(row.get("loss/train", summary.get("final_train_loss"))),
                fmt_loss(summary.get("final_eval_loss")),
                fmt_rate(row.get("throughput/tokens_per_s") or summary.get("tokens_per_s")),
                slurm or "-",
            )
        )
    if holder:
        who = f"driver pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since', '?')}"
    else:
        who = "no driver (ended or stopped)"
    print(f"sweep {sweep_dir}: {len(jobs)} jobs; {who}")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


# -- logs -------------------------------------------------------------------------------------------------
def find_job(jobs: list[Job], given: str, sweep_dir: Path) -> Job:
    """JOB as its run directory's name, its number in the sweep, or a prefix naming one job."""
    by_name = {j.name: j for j in jobs}
    if given in by_name:
        return by_name[given]
    if given.isdigit() and int(given) < len(jobs):
        return jobs[int(given)]
    matches = [j for j in jobs if j.name.startswith(given)]
    if len(matches) == 1:
        return matches[0]
    named = ", ".join(j.name for j in (matches or jobs)[:8])
    raise SweepError(f"logs {sweep_dir} {given}: no single job of that name; jobs: {named}")


def log_path(sweep_dir: Path, job: Job) -> Path:
    """The job's train.log; before there is one, its Slurm job's submitit output where that exists (a
    job that failed before its run started logging, e.g. in a site preset's `setup` lines)."""
    own = sweep_dir / job.name / "train.log"
    slurm_id = D.slurm_jobs(sweep_dir).get(job.name)
    submitit = sweep_dir / ".submitit" / str(slurm_id) / f"{slurm_id}_0_log.out"
    return submitit if not own.exists() and slurm_id and submitit.exists() else own


def logs(sweep_dir: Path, job: Job, follow: bool) -> int:
    """Print the job's log (log_path); with `follow`, new lines as they come until its run ends."""
    path = log_path(sweep_dir, job)
    if not follow and not path.exists():
        print(f"error: {job.name} has no log yet ({path}); it has not started", file=sys.stderr)
        return 1
    pos = 0
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except OSError:
            chunk = b""
        if chunk:
            end = chunk.rfind(b"\n") + 1 if follow else len(chunk)  # whole lines while following
            sys.stdout.write(chunk[:end].decode(errors="replace"))
            sys.stdout.flush()
            pos += end
        if not follow or _ended(sweep_dir, job) and not chunk:
            return 0
        time.sleep(1.0)


def _ended(sweep_dir: Path, job: Job) -> bool:
    """A followed job has ended: its summary is written and no driver will start it again."""
    status = (read_summary(sweep_dir / job.name) or {}).get("status")
    return status in FINISHED or (status is not None and driver(sweep_dir) is None)


# -- cancel -----------------------------------------------------------------------------------------------
def cancel(sweep_dir: Path, jobs: list[Job], wait_s: float = 120.0) -> int:
    """SIGTERM to the driver's process group where it leads one, else to the driver (it relays the
    stop to its launcher, whose local jobs checkpoint and end; it submits no more Slurm jobs), waiting up
    to `wait_s` for it to let go of the directory; then scancel of the recorded Slurm jobs that did not
    finish (read once the driver is gone, so none it submitted is missed)."""
    said = []
    holder = driver(sweep_dir)
    if holder is not None:
        pid, host = holder.get("pid"), holder.get("host")
        if host != socket.gethostname() or not isinstance(pid, int):
            print(
                f"error: sweep {sweep_dir} is driven by pid {pid} on host {host}: cancel it there",
                file=sys.stderr,
            )
            return 1
        try:
            os.killpg(pid, signal.SIGTERM) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGTERM)
            said.append(f"driver pid {pid} stopped (SIGTERM; local jobs checkpoint and end)")
        except ProcessLookupError:
            pass
        end = time.monotonic() + wait_s
        while driver(sweep_dir) is not None and time.monotonic() < end:
            time.sleep(0.5)
        if driver(sweep_dir) is not None:
            said.append(f"the driver still holds the directory after {wait_s:.0f}s")
    ids = D.slurm_jobs(sweep_dir)
    left = [
        ids[j.name]
        for j in jobs
        if j.name in ids and (read_summary(sweep_dir / j.name) or {}).get("status") not in FINISHED
    ]
    if left:
        try:
            out = subprocess.run(["scancel", *left], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(
                f"error: scancel {' '.join(left)} failed ({exc}); cancel those Slurm jobs by hand",
                file=sys.stderr,
            )
            return 1
        if out.returncode:
            why = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
            print(f"error: scancel {' '.join(left)}: {why}; cancel those Slurm jobs by hand", file=sys.stderr)
            return 1
        said.append(f"Slurm jobs {' '.join(left)} cancelled (scancel)")
    if not said:
        print(f"nothing to cancel: no driver holds {sweep_dir} and no Slurm job of it is unfinished")
        return 0
    print("; ".join(said))
    print(f"resume with: {resume_command(sweep_dir)}")
    return 0


def resume_command(sweep_dir: Path) -> str:
    """The command that resumes the sweep in `sweep_dir`, from its record (sweep.yaml)."""
    record = D.read_record(sweep_dir) if (sweep_dir / D.RECORD).exists() else {}
    return sweep_resume_command(record.get("sweep", "NAME"), record.get("file"), sweep_dir)


def sweep_resume_command(name: str, file: str | None, sweep_dir: Path) -> str:
    """`lowp-sweep NAME --resume DIR` (harness.lifecycle.resume.console_command's head): the sweep by
    name where its file is the named sweep's, else by its file's absolute path."""
    from harness.config.paths import SWEEPS_DIR
    from harness.lifecycle.resume import console_command

    named = not file or Path(file).absolute() == (SWEEPS_DIR / f"{name}.yaml").absolute()
    args = [*console_command("lowp-sweep", "harness.sweep"), name if named else str(Path(file).absolute())]
    return shlex.join([*args, "--resume", str(sweep_dir)])
