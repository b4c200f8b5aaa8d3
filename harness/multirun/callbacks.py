"""Hydra callback: a multirun validates every job before the first one starts.

Expands the sweep the way Hydra's basic sweeper does (command-line sweeps and hydra.sweeper.params),
composes each job's config and runs lowp's checks on it: unknown keys, the validation rules, and the
data each job would read (paths, dtypes, token counts, vocabulary; each distinct data setup once).
The first bad job stops the whole sweep with exit code 2 and one line naming the job's overrides,
the options and the fix. Problems only a running job can meet are recorded in its run dir, and the
launcher goes on to the next job (harness.train.main).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness.config.schema import Config


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


class ValidateSweep(Callback):
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
        print(f"[lowp] validated {len(jobs)} jobs", file=sys.stderr)

    @staticmethod
    def _check_data(cfg: Config, seen: set[str]) -> None:
        from harness.data import check_data
        from harness.validation.rules import ConfigError

        m = cfg.model
        key = repr((cfg.data, m.vocab_size, m.seq_length, cfg.micro_batch_size, cfg.eval_tokens))
        if key in seen:
            return
        seen.add(key)
        try:
            check_data(
                cfg.data,
                vocab_size=m.vocab_size,
                seq_length=m.seq_length,
                micro_batch_size=cfg.micro_batch_size,
                eval_tokens=cfg.eval_tokens,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
