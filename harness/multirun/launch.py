"""Launch a named sweep: sweeps/NAME.yaml with its BF16 baselines, validated, launched, summarised, reported.

    python -m harness.sweep NAME [overrides...] [--dry-run] [--no-report]   (NAME or path/to/sweep.yaml)
    python -m harness.sweep NAME --resume SWEEP_DIR [hydra/launcher=...]
    python -m harness.sweep --list
    python -m harness.sweep status DIR | logs DIR JOB [-f] | cancel DIR      (harness.multirun.control)

Overrides apply to every job (baselines included) and win over the file's; `seed=0,1,2` replaces the
sweep's seeds; another comma list multiplies the sweep. `hydra/launcher=local_parallel|slurm|<site>`
and `hydra.*` overrides go to Hydra (default launcher: `serial`, one job at a time with live progress).
`--dry-run` prints each job with its validation verdict as it is composed and runs nothing. The sweep lands in
multirun/NAME/<date_time> (or hydra.sweep.dir=, a new or empty directory), which it owns: sweep.yaml
records the sweep's name, its file's sha256 and the extra overrides, jobs.yaml the job list; another
launch into it is refused. Its W&B group is NAME/<date_time> (WANDB_RUN_GROUP, where set, wins).
`status`, `logs` and `cancel` are reserved: no sweep file may take those names.

`--resume SWEEP_DIR` relaunches the jobs that did not finish (completed and diverged ones are skipped;
interrupted runs resume from their checkpoints) with the launch's overrides; it may change only the
launcher (`hydra/launcher=`, `hydra.launcher.*`), refuses a changed sweep file or a damaged jobs.yaml, and
is refused while another harness.sweep holds the directory. On Slurm, jobs still queued or running are
watched again, not resubmitted.

Ctrl-C, SIGTERM or SIGHUP stop the sweep with one line and the command that resumes it: local jobs
checkpoint and end, Slurm jobs go on (a second signal ends local jobs at once). Killing this process
ends its local jobs too. At the end: a summary table of every job's status, the report
(`python -m analysis.report SWEEP_DIR`, whatever the statuses, with `--wandb` when the runs logged to W&B,
in their mode; `--no-report` skips it) and an exit code
equal to the number of jobs that did not finish (failed, preempted, or no summary at all), capped at 100;
2 with nothing launched means a configuration error, named on stderr; 128 + the signal after a stop.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from harness.config.schema import Config
from harness.multirun import control
from harness.multirun import sweepdir as D
from harness.multirun.progress import FINISHED, fmt_duration, fmt_loss, read_summary
from harness.multirun.spec import (
    Job,
    SweepError,
    build_jobs,
    hydra_value,
    jobs_text,
    key_of,
    known_sweeps,
    read_jobs,
    spec_path,
    sweep_name,
)
from harness.multirun.stop import Interrupted, StopSignals

FLAGS = ("--dry-run", "--no-report", "--report")


def parse_args(argv: list[str]) -> dict:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        return {"help": True}
    if argv[0] in control.COMMANDS:
        return {"help": False, "command": argv[0], "rest": argv[1:]}
    if sweep_name(argv[0]) in control.COMMANDS:
        raise SweepError(
            f"{argv[0]}: a sweep may not be named {sweep_name(argv[0])!r} (reserved for "
            f"`python -m harness.sweep {control.USAGE}`); rename its file"
        )
    args = {"name": argv[0], "extra": [], "resume": None, "help": False, "command": None}
    args.update({f.lstrip("-").replace("-", "_"): False for f in FLAGS})
    it = iter(argv[1:])
    for a in it:
        if a in FLAGS:
            args[a.lstrip("-").replace("-", "_")] = True
        elif a == "--resume" or a.startswith("--resume="):
            args["resume"] = a.split("=", 1)[1] if "=" in a else next(it, None)
            if not args["resume"]:
                raise SweepError("--resume needs the sweep directory: --resume multirun/NAME/<date_time>")
        elif a.startswith("--"):
            raise SweepError(f"unknown option {a}; options: {', '.join((*FLAGS, '--resume DIR'))}")
        else:
            args["extra"].append(a)
    return args


@dataclass
class Sweep:
    """One launch: a new sweep (record None until its directory is claimed) or a resumed one."""

    name: str
    file: Path
    sweep_dir: Path
    stamp: str
    jobs: list[Job]
    hydra_args: list[str]  # to the Hydra process: launcher and hydra.* overrides
    extra: list[str]  # the command line's overrides, recorded at a launch
    record: dict | None = None
    resume: bool = False

    def resume_command(self) -> str:
        """The exact command that resumes this sweep (its file by name where it is a named sweep)."""
        return control.sweep_resume_command(self.name, str(self.file), self.sweep_dir)


def given_dir(value: str) -> Path:
    """hydra.sweep.dir=VALUE as a path: the text as given (it is never a sweep), or the string inside
    where the value is one quoted in Hydra's grammar ('/a,b')."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if value[:1] in "'\"" and value[-1:] == value[:1]:
        try:
            parsed = OverridesParser.create().parse_override(f"k={value}").value()
            if isinstance(parsed, str):
                return Path(parsed).absolute()
        except Exception:  # noqa: BLE001 - not Hydra's grammar: the text itself
            pass
    return Path(value).absolute()


def plan(args: dict) -> Sweep:
    """The launch asked for, checked against its directory: a new sweep or a resumed one."""
    name, file = sweep_name(args["name"]), spec_path(args["name"])
    if args["resume"]:
        return plan_resume(name, file, Path(args["resume"]).absolute(), args["extra"])
    jobs, hydra_args = build_jobs(args["name"], args["extra"])
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    given = [given_dir(a.split("=", 1)[1]) for a in hydra_args if key_of(a) == "hydra.sweep.dir"]
    sweep_dir = given[-1] if given else Path(f"multirun/{name}/{stamp}").absolute()
    D.check_free(sweep_dir)
    group = hydra_value(f"{name}/{stamp}")
    for job in jobs:
        if not os.environ.get("WANDB_RUN_GROUP") and not any(
            key_of(o) == "logger.wandb.group" for o in job.overrides
        ):
            job.overrides.insert(-2, f"logger.wandb.group={group}")
    hydra_args = [a for a in hydra_args if key_of(a) != "hydra.sweep.dir"]
    extra = [a for a in args["extra"] if key_of(a) != "hydra.sweep.dir"]  # the directory is where it is
    return Sweep(name, file, sweep_dir, stamp, jobs, hydra_args, extra)


def plan_resume(name: str, file: Path, sweep_dir: Path, given: list[str]) -> Sweep:
    if (sweep_dir / D.RECORD).exists():
        record = D.read_record(sweep_dir)
    elif (sweep_dir / D.JOBS).exists():
        record = adopt(sweep_dir, file)
    else:
        raise SweepError(f"--resume {sweep_dir}: no {D.RECORD} there (not a sweep made by harness.sweep)")
    if record["sweep"] != name:
        raise SweepError(f"--resume {sweep_dir}: that is sweep {record['sweep']}, not {name}")
    D.check_file(record, file)
    D.check_jobs(record, sweep_dir / D.JOBS)
    _, stamp, jobs = read_jobs(sweep_dir / D.JOBS)
    hydra_args = D.resume_args(record, given, sweep_dir)
    file = Path(record["file"]) if record.get("file") and not file.exists() else file
    return Sweep(name, file, sweep_dir, stamp, jobs, hydra_args, [], record, resume=True)


def adopt(sweep_dir: Path, file: Path) -> dict:
    """The record of a sweep launched before sweeps had one (jobs.yaml alone): its job list must be
    whole (every run directory there is one of its jobs); its overrides are unknown."""
    sweep, stamp, jobs = read_jobs(sweep_dir / D.JOBS)
    names = {j.name for j in jobs}
    lost = sorted(p.name for p in sweep_dir.iterdir() if (p / "run.json").exists() and p.name not in names)
    if lost:
        raise SweepError(f"{sweep_dir / D.JOBS} is damaged: it lacks the jobs of {', '.join(lost)}; not used")
    data = (sweep_dir / D.JOBS).read_bytes()
    record = {
        "sweep": sweep,
        "stamp": stamp,
        "overrides": None,
        "jobs": len(jobs),
        "jobs_sha256": D.sha256(data),
    }
    if file.exists():
        record.update(file=str(file.absolute()), file_sha256=D.sha256(file.read_bytes()))
    return record


class Validator:
    """Composes each job's config (one Hydra initialisation) and runs lowp's validation on it."""

    def __enter__(self) -> Validator:
        from hydra import initialize_config_dir

        from harness.config.store import CONF_DIR
        from harness.validation.load import register

        register()
        self.data_errors: dict[str, Exception | None] = {}
        self._ctx = initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    def _check_data(self, cfg: Config, check) -> None:
        """The data checks once per distinct data setup; every job sharing a bad one gets its error."""
        m = cfg.model
        key = repr((cfg.data, m.vocab_size, m.seq_length, cfg.micro_batch_size, cfg.eval_tokens))
        if key not in self.data_errors:
            try:
                check(cfg, set())
                self.data_errors[key] = None
            except Exception as exc:  # noqa: BLE001 - re-raised for every job with this data
                self.data_errors[key] = exc
        if self.data_errors[key] is not None:
            raise self.data_errors[key]

    def verdict(self, job: Job) -> str:
        """What the job's own start will say: the config rules and its data checks (as a multirun does)."""
        from hydra import compose
        from omegaconf import OmegaConf

        from harness.config.schema import Config
        from harness.multirun.callbacks import ValidateSweep
        from harness.validation import prepare
        from harness.validation.rules import ConfigError, ConfigWarning, check_known_keys

        overrides = [o for o in job.overrides if not key_of(o).startswith("hydra.")]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dcfg = compose(config_name="config", overrides=overrides)
                check_known_keys(dcfg)
                cfg = prepare(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), dcfg)))
                self._check_data(cfg, ValidateSweep._check_data)
        except ConfigError as exc:
            return f"error: {exc}"
        except Exception as exc:  # noqa: BLE001 - Hydra composition errors (unknown preset): one line
            return f"error: {str(exc).splitlines()[0]}"
        notes = sorted(
            {str(w.message).splitlines()[0] for w in caught if isinstance(w.message, ConfigWarning)}
        )
        return "ok" + "".join(f"; warning: {n}" for n in notes)


def validate_jobs(jobs: list[Job], each=None) -> int:
    """Every job's verdict (finished ones skipped); `each(job)` is called as each one is known."""
    with Validator() as v:
        for job in jobs:
            if not job.skip:
                job.verdict = v.verdict(job)
            if each is not None:
                each(job)
    return sum(j.verdict.startswith("error") for j in jobs)


def print_job(job: Job, stream=None) -> None:
    own = [o for o in job.overrides if not key_of(o).startswith(("hydra.", "name", "logger.wandb.group"))]
    state = "skip (finished)" if job.skip else job.verdict
    print(f"{job.name:<34} {state}\n    {' '.join(own)}", file=stream or sys.stdout, flush=True)


def print_jobs(jobs: list[Job], sweep_dir: Path, stream=sys.stdout, each: bool = True) -> None:
    for job in jobs if each else ():
        print_job(job, stream)
    n_skip = sum(j.skip for j in jobs)
    bad = sum(j.verdict.startswith("error") for j in jobs)
    to_run = len(jobs) - n_skip
    print(f"{len(jobs)} jobs ({n_skip} finished, {to_run} to run, {bad} invalid) -> {sweep_dir}", file=stream)


def mark_finished(jobs: list[Job], sweep_dir: Path) -> None:
    for job in jobs:
        job.skip = (read_summary(sweep_dir / job.name) or {}).get("status") in FINISHED


def take(sweep: Sweep) -> D.SweepLock:
    """Hold the sweep directory; a new sweep's job list and record are written first (one from before
    records gets its record)."""
    files = {}
    if not sweep.resume:
        text = jobs_text(sweep.name, sweep.stamp, sweep.jobs)
        sweep.record = D.make_record(sweep.name, sweep.file, sweep.extra, sweep.stamp, text, len(sweep.jobs))
        files[D.JOBS] = text
    files[D.RECORD] = OmegaConf.to_yaml(OmegaConf.create(sweep.record))
    return D.claim(sweep.sweep_dir, files, new=not sweep.resume)


def hydra_command(sweep: Sweep) -> list[str]:
    """The Hydra multirun of the sweep's jobs (hydra/sweeper=lowp reads jobs.yaml; paths quoted)."""
    hydra_args = list(sweep.hydra_args)
    if not any(a.startswith("hydra/launcher=") for a in hydra_args):
        import importlib.util

        # serial runs each job in its own process through submitit; without submitit, Hydra's basic
        # launcher runs them in this one (a failed job still returns, so the sweep goes on)
        default = "serial" if importlib.util.find_spec("submitit") else "basic"
        if default == "basic":
            say("note: submitit is not installed: jobs run in-process (hydra/launcher=basic)")
        hydra_args = [f"hydra/launcher={default}", *hydra_args]
    return [
        sys.executable,
        "-m",
        "harness.train",
        "-m",
        "hydra/sweeper=lowp",
        f"hydra.sweeper.jobs_file={hydra_value(str(sweep.sweep_dir / D.JOBS))}",
        f"hydra.sweep.dir={hydra_value(str(sweep.sweep_dir))}",
        *hydra_args,
    ]


def launch(sweep: Sweep, lock: D.SweepLock, stop: StopSignals) -> int:
    """Run hydra_command in a process of its own session (terminal signals reach only this driver,
    which relays them) that inherits the directory's lock and stops its jobs if this process dies."""
    import importlib

    # Hydra finds plugins by listing the folders of `hydra_plugins`, and an editable install's import
    # hook lists none: the folder that holds lowp's goes on the path, whatever the working directory
    plugins = str(Path(importlib.import_module("hydra_plugins.lowp_launcher").__file__).parents[2])
    path = os.pathsep.join(p for p in (plugins, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, D.DRIVER_ENV: str(os.getpid())}
    return stop.run(hydra_command(sweep), env=env, pass_fds=(lock.fd,), started=lock.note_launcher)


COLUMNS = ("job", "recipe", "seed", "status", "eval loss", "steps", "wall")


def not_finished(jobs: list[Job], sweep_dir: Path) -> list[Job]:
    return [j for j in jobs if (read_summary(sweep_dir / j.name) or {}).get("status") not in FINISHED]


def summary_table(jobs: list[Job], sweep_dir: Path) -> int:
    """Print every job's outcome from its run directory; returns how many did not finish."""
    rows, counts = [], {}
    for job in jobs:
        s = read_summary(sweep_dir / job.name) or {}
        status = s.get("status") or ("not started" if not (sweep_dir / job.name).exists() else "no summary")
        counts[status] = counts.get(status, 0) + 1
        rows.append(
            (
                job.name,
                str(s.get("recipe_label") or s.get("recipe") or "-"),
                str(job.seed),
                status,
                fmt_loss(s.get("final_eval_loss")),
                str(s.get("steps", "-")),
                fmt_duration(s.get("wall_time_s")),
            )
        )
    print_table(f"sweep {sweep_dir}", rows)
    print(f"{len(jobs)} jobs: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return sum(n for k, n in counts.items() if k not in FINISHED)


def print_table(title: str, rows: list[tuple]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain columns where rich is not installed
        widths = [max(len(str(r[i])) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
        print(title)
        for r in [COLUMNS, *rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="right" if col in ("seed", "eval loss", "steps", "wall") else "left")
    for r in rows:
        table.add_row(*r)
    Console(width=max(100, Console().width)).print(table)


def wandb_modes(sweep: Sweep) -> set[str]:
    """The W&B modes the sweep's runs logged in (run.json `wandb`; empty where none used W&B)."""
    modes = set()
    for job in sweep.jobs:
        try:
            logged = json.loads((sweep.sweep_dir / job.name / "run.json").read_text()).get("wandb")
        except (OSError, ValueError):
            continue
        if isinstance(logged, dict) and logged.get("mode"):
            modes.add(str(logged["mode"]))
    return modes


def report_command(sweep: Sweep) -> tuple[list[str], dict]:
    """analysis.report of the sweep, logged to W&B (`--wandb`) when its runs logged there, in their
    mode (online only where every run was online) unless WANDB_MODE says otherwise."""
    cmd = [sys.executable, "-m", "analysis.report", str(sweep.sweep_dir)]
    modes, env = wandb_modes(sweep), dict(os.environ)
    if modes:
        cmd.append("--wandb")
        env.setdefault("WANDB_MODE", "online" if modes == {"online"} else "offline")
    return cmd, env


def say(line: str) -> None:
    """One line on stderr, where there still is one (SIGHUP: the terminal may be gone)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def stopped(sweep: Sweep | None, signum: int) -> int:
    name = signal.Signals(signum).name
    if sweep is None or sweep.record is None:
        say(f"stopped by {name} before the sweep was launched; nothing was written")
        return 128 + signum
    left = not_finished(sweep.jobs, sweep.sweep_dir)
    on_slurm = [D.slurm_jobs(sweep.sweep_dir).get(j.name) for j in left]
    going = f" (Slurm jobs {', '.join(i for i in on_slurm if i)} go on)" if any(on_slurm) else ""
    say(
        f"stopped by {name}: {len(left)} of {len(sweep.jobs)} jobs not finished{going}; "
        f"resume with: {sweep.resume_command()}"
    )
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep = None
    with StopSignals() as stop:
        try:
            args = parse_args(argv)
            if args["help"]:
                print(__doc__.strip())
                print("sweeps:", ", ".join(known_sweeps()))
                return 0
            if args["command"]:
                return control.main(args["command"], args["rest"])
            sweep = plan(args)
            return run(sweep, args, stop)
        except SweepError as exc:
            say(f"error: {exc}")
            return 2
        except D.DirError as exc:
            say(f"error: {exc}")
            return 1
        except Interrupted as exc:
            return stopped(sweep, exc.signum)


def run(sweep: Sweep, args: dict, stop: StopSignals) -> int:
    # a resume holds its directory from the start (refused at once while another driver does); a new
    # sweep makes its directory only once every job is valid
    lock = take(sweep) if sweep.resume and not args["dry_run"] else None
    try:
        if sweep.resume:
            mark_finished(sweep.jobs, sweep.sweep_dir)
        # a dry run prints each job's verdict as it is composed; a launch lists them only when one is bad
        bad = validate_jobs(sweep.jobs, print_job if args["dry_run"] else None)
        if args["dry_run"] or bad:
            stream = sys.stdout if args["dry_run"] else sys.stderr
            print_jobs(sweep.jobs, sweep.sweep_dir, stream, each=not args["dry_run"])
            if bad:
                say(f"error: {bad} invalid jobs in sweep {sweep.name}; nothing launched")
            return 2 if bad else 0
        lock = lock or take(sweep)
        rc = launch(sweep, lock, stop) if any(not j.skip for j in sweep.jobs) else 0
        if stop.signum:
            return stopped(sweep, stop.signum)
        left = summary_table(sweep.jobs, sweep.sweep_dir)
        if left:
            print(f"resume: {sweep.resume_command()}")
        if not args["no_report"]:
            report, env = report_command(sweep)
            print(f"report: {shlex.join(['python', *report[1:]])}")
            stop.run(report, env=env)
            if stop.signum:
                return stopped(sweep, stop.signum)
    finally:
        if lock is not None:
            lock.release()
    if rc and not any((sweep.sweep_dir / j.name).exists() for j in sweep.jobs):  # nothing ran: Hydra's error
        return rc
    return min(left, 100)


if __name__ == "__main__":
    sys.exit(main())
