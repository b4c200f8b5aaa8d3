"""Launch a named sweep: sweeps/NAME.yaml with its BF16 baselines, validated, launched, summarised, reported.

    python -m harness.sweep NAME [overrides...] [--dry-run] [--no-report]   (NAME or path/to/sweep.yaml)
    python -m harness.sweep NAME --resume SWEEP_DIR [hydra/launcher=...]
    python -m harness.sweep --list

Overrides apply to every job (baselines included) and win over the file's; `seed=0,1,2` replaces the
sweep's seeds; another comma list multiplies the sweep. `hydra/launcher=local_parallel|slurm|<site>`
and `hydra.*` overrides go to Hydra (default launcher: `serial`, one job at a time with live progress).
`--dry-run` prints every job with its validation verdict and runs nothing. The sweep lands in
multirun/NAME/<date_time> (or hydra.sweep.dir=), with jobs.yaml (the job list) beside the runs; its W&B
group is NAME/<date_time>. `--resume` relaunches the jobs of an existing sweep directory, skipping the
completed and diverged ones; interrupted runs resume from their checkpoints.

At the end: a summary table of every job's status, the report (`python -m analysis.report SWEEP_DIR`,
whatever the statuses; `--no-report` skips it) and an exit code equal to the number of jobs that did
not finish (failed, preempted, or no summary at all), capped at 100; 2 with nothing launched means a
configuration error, named on stderr.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

from harness.config.schema import Config
from harness.multirun.progress import fmt_duration, fmt_loss, read_summary
from harness.multirun.spec import (
    Job,
    SweepError,
    build_jobs,
    key_of,
    known_sweeps,
    read_jobs,
    sweep_name,
    write_jobs,
)

FINISHED = ("completed", "diverged")
FLAGS = ("--dry-run", "--no-report", "--report")


def parse_args(argv: list[str]) -> dict:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        return {"help": True}
    args = {"name": argv[0], "extra": [], "resume": None, "help": False}
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


def plan(args: dict) -> tuple[list[Job], list[str], Path, str]:
    """(jobs, Hydra overrides, sweep dir, stamp) for a new sweep or a resumed one."""
    name = sweep_name(args["name"])
    if args["resume"]:
        sweep_dir = Path(args["resume"]).absolute()
        if not (sweep_dir / "jobs.yaml").exists():
            raise SweepError(f"--resume {sweep_dir}: no jobs.yaml there (not a sweep made by harness.sweep)")
        sweep, stamp, jobs = read_jobs(sweep_dir / "jobs.yaml")
        if sweep != name:
            raise SweepError(f"--resume {sweep_dir}: that is sweep {sweep}, not {name}")
        job_args = [a for a in args["extra"] if not a.startswith(("hydra.", "hydra/"))]
        if job_args:
            raise SweepError(
                f"--resume relaunches the jobs of {sweep_dir / 'jobs.yaml'} unchanged: drop {job_args} "
                "(only hydra/launcher= and hydra.* overrides), or start a new sweep"
            )
        return jobs, args["extra"], sweep_dir, stamp
    jobs, hydra_args = build_jobs(args["name"], args["extra"])
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    given = [a.split("=", 1)[1] for a in hydra_args if a.startswith("hydra.sweep.dir=")]
    sweep_dir = Path(given[-1] if given else f"multirun/{name}/{stamp}").absolute()
    for job in jobs:
        if not any(key_of(o) == "logger.wandb.group" for o in job.overrides):
            job.overrides.insert(-2, f"logger.wandb.group={name}/{stamp}")
    return jobs, hydra_args, sweep_dir, stamp


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


def validate_jobs(jobs: list[Job]) -> int:
    with Validator() as v:
        for job in jobs:
            job.verdict = v.verdict(job)
    return sum(j.verdict.startswith("error") for j in jobs)


def print_jobs(jobs: list[Job], sweep_dir: Path, stream=sys.stdout) -> None:
    for job in jobs:
        own = [o for o in job.overrides if not key_of(o).startswith(("hydra.", "name", "logger.wandb.group"))]
        state = "skip (finished)" if job.skip else job.verdict
        print(f"{job.name:<34} {state}\n    {' '.join(own)}", file=stream)
    n_skip = sum(j.skip for j in jobs)
    bad = sum(j.verdict.startswith("error") for j in jobs)
    print(
        f"{len(jobs)} jobs ({n_skip} finished, {len(jobs) - n_skip} to run, {bad} invalid) -> {sweep_dir}",
        file=stream,
    )


def mark_finished(jobs: list[Job], sweep_dir: Path) -> None:
    for job in jobs:
        job.skip = (read_summary(sweep_dir / job.name) or {}).get("status") in FINISHED


def launch(jobs: list[Job], name: str, stamp: str, sweep_dir: Path, hydra_args: list[str]) -> int:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_jobs(sweep_dir / "jobs.yaml", name, stamp, jobs)
    if not any(a.startswith("hydra/launcher=") for a in hydra_args):
        import importlib.util

        # serial runs each job in its own process through submitit; without submitit, Hydra's basic
        # launcher runs them in this one (a failed job still returns, so the sweep goes on)
        default = "serial" if importlib.util.find_spec("submitit") else "basic"
        if default == "basic":
            print(
                "note: submitit is not installed: jobs run in-process (hydra/launcher=basic)", file=sys.stderr
            )
        hydra_args = [f"hydra/launcher={default}", *hydra_args]
    hydra_args = [a for a in hydra_args if not a.startswith("hydra.sweep.dir=")]
    cmd = [
        sys.executable,
        "-m",
        "harness.train",
        "-m",
        "hydra/sweeper=lowp",
        f"hydra.sweeper.jobs_file={sweep_dir / 'jobs.yaml'}",
        f"hydra.sweep.dir={sweep_dir}",
        *hydra_args,
    ]
    return subprocess.call(cmd)


COLUMNS = ("job", "recipe", "seed", "status", "eval loss", "steps", "wall")


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


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
        if args["help"]:
            print(__doc__.strip())
            print("sweeps:", ", ".join(known_sweeps()))
            return 0
        jobs, hydra_args, sweep_dir, stamp = plan(args)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = sweep_name(args["name"])
    if args["resume"]:
        mark_finished(jobs, sweep_dir)
    bad = validate_jobs([j for j in jobs if not j.skip])
    if args["dry_run"] or bad:
        print_jobs(jobs, sweep_dir, sys.stdout if args["dry_run"] else sys.stderr)
        if bad:
            print(f"error: {bad} invalid jobs in sweep {name}; nothing launched", file=sys.stderr)
        return 2 if bad else 0
    rc = launch(jobs, name, stamp, sweep_dir, hydra_args)
    not_finished = summary_table(jobs, sweep_dir)
    if not args["no_report"]:
        print(f"report: python -m analysis.report {sweep_dir}")
        subprocess.call([sys.executable, "-m", "analysis.report", str(sweep_dir)])
    if rc and not_finished == len(jobs):  # nothing ran: Hydra's own error (composition, launcher)
        return rc
    return min(not_finished, 100)


if __name__ == "__main__":
    sys.exit(main())
