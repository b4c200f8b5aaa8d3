"""lowp's Hydra launchers on submitit: hydra/launcher=lowp_local (N at a time here) and lowp_slurm.

What the stock hydra-submitit-launcher does not: every job is submitted on its own, named
`lowp:<sweep>:<run>` (the run directory's name), so `squeue` says what runs; the driver polls all jobs
at once and shows live progress instead of waiting on them in order; a failed, diverged or killed job
never stops the sweep, and each job's outcome is read from its run directory (summary.json), since a
job killed by Slurm leaves no result behind. Each job's own log stays in its run directory and in the
submitit folder; the terminal gets one status line and one line per finished job.

Requeue protocol on Slurm (submitit's): the job is started with `--signal=USR2@signal_delay_s`. The
training loop (harness.lifecycle.signals) turns SIGUSR2/SIGTERM into a checkpoint at the next step
boundary and `status: preempted`, then hands the signal to submitit's handler: after USR2 submitit asks this
launcher's `checkpoint()` for the same job, requeues it (time-limit stops count against
`max_num_timeout`, preemptions do not) and exits; after SIGTERM (`scontrol requeue`, preemption,
scancel) Slurm decides. Either way the job exits without a result, so the driver keeps waiting while
the job is requeued (or sees it cancelled). A requeued job runs the same overrides in the same run
directory and resumes from its checkpoint, with the same W&B run.

Stopping: SIGINT, SIGTERM or SIGHUP to this process (`harness.sweep` relays a stop this way), or the death
of the `harness.sweep` that started it (its pid is in LOWP_SWEEP_DRIVER_PID), stops the sweep quietly:
no job is started any more; local jobs get SIGTERM (they checkpoint and end) and are waited for; Slurm
jobs go on. Every Slurm job id is recorded in `<sweep dir>/slurm_jobs.json` when it is submitted, and a
relaunch (`harness.sweep --resume`) watches the recorded jobs that still wait or run instead of
submitting them again.
"""

# no `from __future__ import annotations`: Hydra imports plugin modules outside sys.modules (dataclasses)

import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict

from harness.multirun.stop import CaughtSignals

log = logging.getLogger(__name__)

LOWP_KEYS = ("sweep_name", "max_parallel", "poll_s", "progress_s")
INIT_KEYS = ("submitit_folder", "max_num_timeout")
SHARED_KEYS = (
    "timeout_min",
    "cpus_per_task",
    "gpus_per_node",
    "tasks_per_node",
    "mem_gb",
    "nodes",
    "stderr_to_stdout",
    "name",
)
ALIVE = {"PENDING", "REQUEUED", "CONFIGURING", "READY", "SUSPENDED", "RUNNING", "COMPLETING", "PREEMPTED"}
QUEUED = {
    "PENDING",
    "REQUEUED",
    "CONFIGURING",
    "UNKNOWN",
    "READY",
    "SUSPENDED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
}


@dataclass
class Planned:
    num: int
    overrides: list[str]
    run_dir: Path
    name: str
    job: Any = None
    finished: bool = False


class LowpLauncher(Launcher):
    _EXECUTOR = "abstract"

    def __init__(self, **params: Any) -> None:
        params = {
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in params.items()
        }
        self.lowp = {k: params.pop(k) for k in LOWP_KEYS if k in params}
        self.params = params
        self.config: DictConfig | None = None
        self.hydra_context = None
        self.task_function = None
        self.driver: int | None = None  # the pid of the harness.sweep that started this process

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        from harness.multirun.sweepdir import DRIVER_ENV

        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function
        driver = os.environ.pop(DRIVER_ENV, None)  # for this process only: its jobs start no sweep
        self.driver = int(driver) if driver else None

    # -- in the job (on the node) ------------------------------------------------------------------
    def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state) -> JobReturn:
        import submitit

        Singleton.set_state(singleton_state)
        setup_globals()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(sweep_overrides))
        with open_dict(sweep_config.hydra.job) as job:
            job.id = submitit.JobEnvironment().job_id
            job.num = job_num
        run_dir = _run_dir(sweep_config)
        stopped: BaseException | None = None
        ret = None
        try:
            ret = run_job(
                hydra_context=self.hydra_context,
                task_function=self.task_function,
                config=sweep_config,
                job_dir_key=job_dir_key,
                job_subdir_key="hydra.sweep.subdir",
            )
        except (SystemExit, KeyboardInterrupt) as exc:  # a preempted run exits so that it can be requeued
            stopped = exc
        self._after_run(run_dir, stopped)
        return ret

    def _after_run(self, run_dir: Path, stopped: BaseException | None) -> None:
        """A preempted run leaves no result behind, so the driver keeps waiting while it is requeued."""
        from harness.multirun.progress import read_summary

        if stopped is not None:
            raise stopped
        if (read_summary(run_dir) or {}).get("status") == "preempted":
            raise SystemExit(128 + signal.SIGTERM)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's requeue hook: resubmit the same job (its run resumes from its own checkpoint)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    # -- in the driver -----------------------------------------------------------------------------
    def _executor(self):
        import submitit

        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        params = {
            k if k in SHARED_KEYS else f"{self._EXECUTOR}_{k}": v
            for k, v in self.params.items()
            if k not in INIT_KEYS and v is not None
        }
        executor.update_parameters(**params)
        return executor

    def _plan(self, job_overrides) -> list[Planned]:
        saved = HydraConfig.instance().cfg
        plans = []
        try:
            for num, overrides in enumerate(job_overrides):
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(cfg.hydra.job):
                    cfg.hydra.job.num = num
                run_dir = _run_dir(cfg)
                plans.append(Planned(num, list(overrides), run_dir, run_dir.name))
        finally:
            HydraConfig.instance().cfg = saved
        return plans

    def sweep_name(self) -> str:
        """The launcher's sweep_name, else the name harness.sweep wrote in jobs.yaml, else the dir's name."""
        if self.lowp.get("sweep_name"):
            return self.lowp["sweep_name"]
        jobs_file = OmegaConf.select(self.config, "hydra.sweeper.jobs_file")
        if jobs_file and Path(jobs_file).exists():
            return str(OmegaConf.load(jobs_file).get("sweep") or Path(jobs_file).parent.name)
        return Path(str(self.config.hydra.sweep.dir)).name

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        from harness.multirun.progress import SweepProgress

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        plans = self._plan(job_overrides)
        for p in plans:
            p.num += initial_job_idx
        executor = self._executor()
        active = self._reattach(plans, sweep_dir)
        pending = deque(p for p in plans if p.job is None)
        limit = int(self.lowp.get("max_parallel") or 0)
        poll = float(self.lowp.get("poll_s") or 1.0)
        every = float(self.lowp.get("progress_s") or 30.0)
        progress = SweepProgress(self.sweep_name(), len(plans), plain_every_s=every)
        with _Stop(self.driver) as stop, progress:
            while pending or active:
                if stop.requested:
                    progress.quiet()
                    pending.clear()
                    if not self._stop_jobs(active):
                        break
                while pending and (limit <= 0 or len(active) < limit):
                    active.append(self._submit(executor, pending.popleft(), sweep_dir))
                self._refresh(active)
                for p in [p for p in active if self._done(p)]:
                    active.remove(p)
                    p.finished = True
                    progress.finished(p.name, _summary(p), "" if stop.requested else _job_error(p))
                running = {p.name: p.run_dir for p in active if self._state(p) not in QUEUED}
                queued = len(pending) + len(active) - len(running)
                progress.update(running=len(running), queued=queued, run_dirs=running)
                if pending or active:
                    stop.sleep(poll)
        returns = [self._job_return(p) for p in plans]
        self._tell_driver(plans, returns)
        return returns

    def _tell_driver(self, plans: list[Planned], returns: list[JobReturn]) -> None:
        """The jobs ran in processes of their own, so their callbacks ran there: the driver's
        multirun callback hears each outcome here, and a multirun with a failed job exits non-zero."""
        from harness.multirun.callbacks import ValidateSweep

        for callback in getattr(getattr(self.hydra_context, "callbacks", None), "callbacks", ()):
            if isinstance(callback, ValidateSweep):
                for p, ret in zip(plans, returns):
                    callback.ran_elsewhere(p.name, ret.return_value)

    def _stop_jobs(self, active: list[Planned]) -> bool:
        """Local jobs get SIGTERM (the run checkpoints and ends), again at every poll, since a job still
        starting has submitit's handler, which ignores it: this process's whole group where it leads one
        (harness.sweep starts it so; a job's controller may sit under a `setup` shell), else each job's
        controller, which passes it on. Returns whether to wait for them. Slurm jobs go on: a relaunch
        watches them again."""
        if self._EXECUTOR == "slurm":
            return False
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpgrp(), signal.SIGTERM)  # this process's own handler only notes it
        else:
            for p in active:
                _kill(int(p.job.job_id))
        return True

    def _reattach(self, plans: list[Planned], sweep_dir: Path) -> list[Planned]:
        """The plans whose recorded Slurm job still waits or runs, each given that job to watch."""
        from harness.multirun.sweepdir import slurm_jobs

        ids = slurm_jobs(sweep_dir) if self._EXECUTOR == "slurm" else {}
        known = [p for p in plans if p.name in ids]
        if not known:
            return []
        import submitit

        tasks = tuple(range(int(self.params.get("nodes") or 1) * int(self.params.get("tasks_per_node") or 1)))
        jobs = {p.name: submitit.SlurmJob(self.params["submitit_folder"], ids[p.name], tasks) for p in known}
        submitit.SlurmJob.watcher.update()  # one sacct call for all of them
        attached = []
        for p in known:
            job = jobs[p.name]
            if job.watcher.get_state(job.job_id, mode="cache").upper().split(" ")[0] in ALIVE:
                p.job = job
                attached.append(p)
                log.info("%s: Slurm job %s still waits or runs; watching it again", p.name, job.job_id)
        return attached

    def _submit(self, executor, p: Planned, sweep_dir: Path) -> Planned:
        from harness.multirun.sweepdir import note_slurm_job

        executor.update_parameters(name=f"lowp:{self.sweep_name()}:{p.name}")
        p.job = executor.submit(
            self, p.overrides, "hydra.sweep.dir", p.num, f"job_id_for_{p.num}", Singleton.get_state()
        )
        log.debug("submitted %s as %s", p.name, p.job.job_id)
        if self._EXECUTOR == "slurm":
            note_slurm_job(sweep_dir, p.name, p.job.job_id)
        return p

    def _refresh(self, active: list[Planned]) -> None:
        if active and self._EXECUTOR == "slurm":
            active[0].job.watcher.update()  # one sacct call for every job of the sweep

    def _state(self, p: Planned) -> str:
        if self._EXECUTOR != "slurm":
            return p.job.state.upper()  # a local process: running from its start
        return p.job.watcher.get_state(p.job.job_id, mode="cache").upper().split(" ")[0]

    def _done(self, p: Planned) -> bool:
        if self._EXECUTOR == "slurm":
            # Slurm's state, not the result file: a job requeued after writing one runs again
            return p.job.watcher.is_done(p.job.job_id, mode="cache")
        return p.job.paths.result_pickle.exists() or p.job.done()

    def _job_return(self, p: Planned) -> JobReturn:
        summary = _summary(p) or {}
        # every job counts as launched: its outcome is in its run directory, the sweep goes on
        return JobReturn(
            overrides=p.overrides,
            working_dir=str(p.run_dir),
            task_name=p.name,
            status=JobStatus.COMPLETED,
            _return_value=summary.get("status", "missing"),
        )


class LowpLocalLauncher(LowpLauncher):
    _EXECUTOR = "local"


class LowpSlurmLauncher(LowpLauncher):
    _EXECUTOR = "slurm"


class _Stop(CaughtSignals):
    """Why the sweep stops early: SIGINT, SIGTERM or SIGHUP to this process, or the harness.sweep that
    started it gone (killed; this process's parent is no longer the pid it was given)."""

    def __init__(self, driver: int | None):
        super().__init__()
        self.driver = driver

    @property
    def requested(self) -> bool:
        return self.signum is not None or (self.driver is not None and os.getppid() != self.driver)

    def sleep(self, seconds: float) -> None:
        """Up to `seconds`, cut short when a stop is first requested."""
        stopping = self.requested
        end = time.monotonic() + seconds
        while time.monotonic() < end and (stopping or not self.requested):
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _run_dir(cfg: DictConfig) -> Path:
    """The job's run directory, resolved the way Hydra's run_job will (hydra:job.num etc.)."""
    HydraConfig.instance().set_config(cfg)
    return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)


def _summary(p: Planned) -> dict | None:
    from harness.multirun.progress import read_summary

    return read_summary(p.run_dir)


def _job_error(p: Planned) -> str:
    """One line on why a job has no summary (killed before writing one, stopped by a config error)."""
    try:
        p.job.result()
    except Exception as exc:  # noqa: BLE001 - reported, never raised: other jobs go on
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    if _summary(p) is None:
        log_lines = _tail(p.job.paths.stdout)
        said = [ln for ln in log_lines if ln.startswith("error:")]
        return f"{said[-1] if said else 'ended without summary.json'} (output: {p.job.paths.stdout})"
    return ""


def _tail(path: Path, nbytes: int = 20000) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
