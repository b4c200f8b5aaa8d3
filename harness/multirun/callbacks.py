"""Hydra callback: a multirun validates every job before the first one starts, and exits non-zero
after its last job when one failed.

Expands the sweep the way Hydra's basic sweeper does (command-line sweeps and hydra.sweeper.params),
composes each job's config and runs lowp's checks on it: unknown keys, the validation rules, and the
data each job would read (paths, dtypes, token counts, vocabulary; each distinct data setup once).
The first bad job stops the whole sweep with exit code 2 and one line naming the job's overrides,
the options and the fix. Problems only a running job can meet are recorded in its run dir, and the
launcher goes on to the next job (harness.train returns a `JobFailed`); when the jobs ran in this
process (Hydra's basic launcher, the default of `python -m harness.train -m`), or in processes of their
own under lowp's launchers (which hand each job's status to `ran_elsewhere`), the multirun then ends
with one line naming the failed jobs and exit code 1 (2 when each failed on its configuration).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness.config.schema import Config, eval_budget


def job_overrides(config: DictConfig) -> list[list[str]]:
    """The override list of every job of this multirun, in launch order."""
    jobs_file = OmegaConf.select(config, "hydra.sweeper.jobs_file")
    if jobs_file:  # hydra/sweeper=lowp (harness.multirun.launch): an explicit job list
        from hydra_plugins.lowp_launcher.sweeper import load_jobs

        return load_jobs(jobs_file)
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = list(config.hydra.overrides.task)
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    args += [f"{k}={v}" for k, v in params.items()]
    parsed = OverridesParser.create().parse_overrides(args)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


@dataclass
class JobFailed:
    """What a multirun's failed job returns to its launcher: its exit code as a single run and its
    `error:` line."""

    code: int
    error: str


class ValidateSweep(Callback):
    def __init__(self) -> None:
        self.jobs = 0
        self.failed: list[tuple[str, JobFailed]] = []  # (run dir name, outcome) of the jobs that failed

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        failed = job_return._return_value  # its property raises a failed job's exception instead
        if job_return.status == JobStatus.FAILED:
            failed = JobFailed(1, f"error: {type(failed).__name__}: {failed}")
        if isinstance(failed, JobFailed):
            self.failed.append((Path(str(config.hydra.runtime.output_dir)).name, failed))

    def ran_elsewhere(self, name: str, status: str) -> None:
        """A job that ran in a process of its own (lowp's serial, local_parallel and slurm launchers
        tell the driver): a status other than completed or diverged counts as failed."""
        if status not in ("completed", "diverged"):
            self.failed.append((name, JobFailed(1, f"status {status}")))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.failed:
            return
        names = ", ".join(name for name, _ in self.failed)
        print(
            f"error: {len(self.failed)} of {self.jobs} jobs failed ({names}); each one's error is above "
            "and in its run dir (train.log, error.txt)",
            file=sys.stderr,
        )
        sys.exit(2 if all(f.code == 2 for _, f in self.failed) else 1)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.types import RunMode

        from harness.config.schema import Config
        from harness.config.store import to_config
        from harness.validation import prepare
        from harness.validation.rules import ConfigError, check_known_keys

        loader = GlobalHydra.instance().config_loader()
        jobs = job_overrides(config)
        seen_data: set[str] = set()
        for i, overrides in enumerate(jobs):
            job_cfg = loader.load_configuration(
                config_name=config.hydra.job.config_name, overrides=overrides, run_mode=RunMode.MULTIRUN
            )
            plain = OmegaConf.create({k: job_cfg[k] for k in job_cfg if k != "hydra"})
            try:
                check_known_keys(plain)
                cfg = to_config(OmegaConf.merge(OmegaConf.structured(Config), plain))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # each job prints its own warnings when it runs
                    prepare(cfg)
                self._check_data(cfg, seen_data)
            except ConfigError as exc:
                print(f"error: job {i} ({' '.join(overrides)}): {exc}", file=sys.stderr)
                sys.exit(2)
        self.jobs = len(jobs)
        _check_writable(config.hydra.sweep.dir, "hydra.sweep.dir")
        print(f"[lowp] validated {len(jobs)} jobs", file=sys.stderr)

    @staticmethod
    def _check_data(cfg: Config, seen: set[str]) -> None:
        from harness.data import check_data
        from harness.validation.rules import ConfigError

        m = cfg.model
        budget = eval_budget(cfg)  # what the trainer evaluates: eval_tokens, at most the training tokens
        key = repr((cfg.data, m.vocab_size, m.seq_length, cfg.micro_batch_size, budget))
        if key in seen:
            return
        seen.add(key)
        try:
            check_data(
                cfg.data,
                vocab_size=m.vocab_size,
                seq_length=m.seq_length,
                micro_batch_size=cfg.micro_batch_size,
                eval_tokens=budget,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def _check_writable(directory: str, option: str) -> None:
    """Exit 1 with one line when `directory` cannot be made where it would be: Hydra writes there
    before the job starts and would end in a traceback. Nothing is created here (the directory's
    name may hold the time)."""
    import os

    path = Path(str(directory)).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing.is_dir() and os.access(existing, os.W_OK):
        return
    if not existing.is_dir():
        cause, fix = "is a file, not a directory", f"move it away or use another {option}"
    elif os.statvfs(existing).f_flag & os.ST_RDONLY:
        cause, fix = "is on a read-only file system", f"use another {option}"
    else:
        cause, fix = "is not writable for this user", f"make it writable or use another {option}"
    print(f"error: cannot make {option}={path}: {existing} {cause}; {fix}", file=sys.stderr)
    sys.exit(1)
