"""Entry point: compose, validate, train one run, write its artifacts.

    python -m harness.train [group=preset ...] [key=value ...]        one run
    python -m harness.train -m recipe=bf16,tensorwise seed=0,1        a multirun (every job validated first)

`harness.training.job.run(cfg, run_dir) -> Summary` is the testable core (re-exported here with the
Trainer); `main` only adapts Hydra to it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from harness import recipes
from harness.config.paths import CONF_DIR
from harness.config.schema import Config
from harness.config.store import to_config
from harness.lifecycle import artifacts as A
from harness.lifecycle import resume as R
from harness.lifecycle.runlock import EXCL as RUN_LOCK_EXCL
from harness.lifecycle.runlock import NAME as RUN_LOCK
from harness.lifecycle.runlock import RunDirLocked, RunLock
from harness.lifecycle.signals import StopRequest, exit_after_preemption
from harness.multirun.callbacks import JobFailed
from harness.training.job import USER_ERRORS, run  # noqa: F401 - harness.train.run is the API
from harness.training.trainer import Trainer, backend_spec  # noqa: F401 - re-exported
from harness.validation.load import register
from harness.validation.rules import ConfigError, ConfigWarning, check_known_keys


def _concise_warnings() -> None:
    default = warnings.formatwarning
    warnings.formatwarning = lambda msg, cat, *a, **k: (
        f"warning: {msg}\n" if issubclass(cat, ConfigWarning) else default(msg, cat, *a, **k)
    )


register()


def main() -> float | None:
    """`python -m harness.train`: a removed recipe name is refused before Hydra looks for its preset."""
    removed = recipes.legacy_in(sys.argv[1:])
    if removed:
        print(f"error: {removed}", file=sys.stderr)
        sys.exit(2)
    return _main()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _main(dcfg: DictConfig) -> float | JobFailed | None:
    """Adapts Hydra to `run`: exit 2 for a config error, 1 for a runtime one (a multirun's job
    returns instead, so the launcher goes on; harness.multirun.callbacks sets the exit code at the
    end), 128+signal after a preemption, 0 otherwise. A run refused before it wrote anything leaves
    no run directory."""
    from hydra.core.hydra_config import HydraConfig

    _concise_warnings()
    hc = HydraConfig.get()
    multirun = hc.mode is not None and hc.mode.name == "MULTIRUN"
    run_dir = Path(hc.runtime.output_dir)
    stop = StopRequest().install()
    try:
        check_known_keys(dcfg)
        cfg: Config = to_config(dcfg)
        summary = run(cfg, run_dir, stop, R.resume_command(run_dir, list(hc.overrides.task)))
    except KeyboardInterrupt:
        print("error: interrupted twice; the last checkpoint is kept, restart to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - recorded in the run dir by run(); here the line and exit code
        code = 2 if isinstance(exc, ConfigError) else 1
        line = _error_line(exc, run_dir)
        _say(line)
        _remove_if_bare(run_dir, {hc.output_subdir, f"{hc.job.name}.log"})
        if multirun:
            return JobFailed(code, line)  # the launcher goes on with the next job
        sys.exit(code)
    finally:
        stop.restore()
    if summary.status == A.PREEMPTED:
        exit_after_preemption(stop.signum, stop.previous.get(stop.signum))
    loss = summary.final_eval_loss if summary.final_eval_loss is not None else summary.final_train_loss
    return loss if loss is not None and math.isfinite(loss) else None


def _error_line(exc: Exception, run_dir: Path) -> str:
    """The one `error:` line: a config error as its message; anything else with its type, a
    file-system error with its path, cause and fix, and where its traceback is when run() wrote one."""
    if isinstance(exc, ConfigError):
        return f"error: {exc}"
    text = A.os_error_text(exc, run_dir) if isinstance(exc, OSError) else str(exc)
    error_txt = run_dir / "error.txt"
    where = ""
    if not isinstance(exc, USER_ERRORS) and _written_for(error_txt, exc):
        where = f" (traceback in {error_txt})"
    return f"error: {type(exc).__name__}: {text}{where}"


def _written_for(error_txt: Path, exc: Exception) -> bool:
    """Whether error.txt records this failure (run() writes it unless the directory holds an earlier
    run that the failed attempt had not touched yet)."""
    try:
        return error_txt.read_text().startswith(f"{type(exc).__name__}: {exc}".strip())
    except OSError:
        return False


def _say(line: str) -> None:
    """The error line on stderr and in the job's log file (train.log), where a multirun's job keeps it."""
    print(line, file=sys.stderr)
    record = logging.LogRecord("lowp", logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _remove_if_bare(run_dir: Path, hydra_files: set[str | None]) -> None:
    """A run refused before it wrote anything leaves no run directory: what Hydra made for it (the
    job's .hydra/ and log) and an unheld run lock go, then the directory if that emptied it. Anything
    else there, or a lock that another process holds, keeps all of it."""
    try:
        names = {p.name for p in run_dir.iterdir()}
        hydra = set(os.listdir(run_dir / ".hydra")) if ".hydra" in names else set()
    except OSError:
        return
    locks = {RUN_LOCK, RUN_LOCK_EXCL}  # flock's file, and the fallback's where flock does not work
    if not names <= {*hydra_files, *locks} or not hydra <= {"config.yaml", "hydra.yaml", "overrides.yaml"}:
        return
    try:
        lock = RunLock(run_dir).acquire()
    except (RunDirLocked, OSError):
        return
    try:
        for name in names - locks:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    except OSError:
        return
    finally:
        lock.release()
    with contextlib.suppress(OSError):
        (run_dir / RUN_LOCK).unlink()
        run_dir.rmdir()


if __name__ == "__main__":
    main()
