"""hydra/sweeper=lowp: launch an explicit list of jobs (not a cartesian product) in one batch.

`harness.sweep` writes the list (sweeps/NAME.yaml expanded, with its BF16 baselines) to
`<sweep dir>/jobs.yaml`; each job is its own override list, including its run directory name.
"""

# no `from __future__ import annotations`: Hydra imports plugin modules outside sys.modules (dataclasses)

from typing import Any

from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


def load_jobs(path: str) -> list[list[str]]:
    spec = OmegaConf.to_container(OmegaConf.load(path))
    return [list(job["overrides"]) for job in spec["jobs"] if not job.get("skip")]


class LowpSweeper(Sweeper):
    def __init__(self, jobs_file: str | None = None):
        self.jobs_file = jobs_file
        self.launcher = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        if not self.jobs_file:
            raise ValueError("hydra/sweeper=lowp needs hydra.sweeper.jobs_file=<sweep dir>/jobs.yaml")
        jobs = [[*job, *arguments] for job in load_jobs(self.jobs_file)]
        if not jobs:
            return []
        return self.launcher.launch(jobs, initial_job_idx=0)
