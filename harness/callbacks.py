"""Hydra callback: a multirun validates every job before the first one starts.

Expands the sweep the way Hydra's basic sweeper does (command-line sweeps and hydra.sweeper.params),
composes each job's config and runs lowp's validation on it; the first bad job stops the whole sweep
with exit code 2 and one line naming the job's overrides, the options and the fix.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def job_overrides(config: DictConfig) -> list[list[str]]:
    """The override list of every job of this multirun, in launch order."""
    jobs_file = OmegaConf.select(config, "hydra.sweeper.jobs_file")
    if jobs_file:  # hydra/sweeper=lowp (harness.sweep): an explicit job list
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


class ValidateSweep(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.types import RunMode

        from harness.config.schema import Config
        from harness.config.validate import ConfigError, validate
        from harness.hardware import resolve_hardware

        loader = GlobalHydra.instance().config_loader()
        jobs = job_overrides(config)
        for i, overrides in enumerate(jobs):
            job_cfg = loader.load_configuration(
                config_name=config.hydra.job.config_name, overrides=overrides, run_mode=RunMode.MULTIRUN
            )
            plain = {k: job_cfg[k] for k in job_cfg if k != "hydra"}
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), plain))
            cfg.hardware = resolve_hardware(cfg.hardware)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # each job prints its own warnings when it runs
                    validate(cfg)
            except ConfigError as exc:
                print(f"error: job {i} ({' '.join(overrides)}): {exc}", file=sys.stderr)
                sys.exit(2)
        print(f"[lowp] validated {len(jobs)} jobs", file=sys.stderr)
