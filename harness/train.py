"""Entry point: compose, validate, train one run, write its artifacts.

    python -m harness.train [group=preset ...] [key=value ...]        one run
    python -m harness.train -m recipe=bf16,tensorwise seed=0,1        a multirun (every job validated first)

`harness.training.job.run(cfg, run_dir) -> Summary` is the testable core (re-exported here with the
Trainer); `main` only adapts Hydra to it.
"""

from __future__ import annotations

import math
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
from harness.lifecycle.signals import StopRequest, exit_after_preemption
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
def _main(dcfg: DictConfig) -> float | None:
    """Adapts Hydra to `run`: exit 2 for a config error, 1 for a runtime one (a multirun's job
    returns instead, so the launcher goes on), 128+signal after a preemption, 0 otherwise."""
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
    except Exception as exc:  # noqa: BLE001 - recorded in the run dir by run(); here only the exit code
        code = 2 if isinstance(exc, ConfigError) else 1
        where = "" if isinstance(exc, USER_ERRORS) else f" (traceback in {run_dir / 'error.txt'})"
        print(
            f"error: {exc}{where}" if code == 2 else f"error: {type(exc).__name__}: {exc}{where}",
            file=sys.stderr,
        )
        if multirun:
            return None  # the basic launcher goes on with the next job
        sys.exit(code)
    finally:
        stop.restore()
    if summary.status == A.PREEMPTED:
        exit_after_preemption(stop.signum, stop.previous.get(stop.signum))
    loss = summary.final_eval_loss if summary.final_eval_loss is not None else summary.final_train_loss
    return loss if loss is not None and math.isfinite(loss) else None


if __name__ == "__main__":
    main()
