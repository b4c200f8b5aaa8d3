"""hydra/sweeper=lowp: launch an explicit list of jobs (not a cartesian product) in one batch.

`harness.sweep` writes the list (sweeps/NAME.yaml expanded, with its BF16 baselines) to
`<sweep dir>/jobs.yaml` once; each job is its own override list, including its run directory name.
A job whose run directory beside jobs.yaml says it finished (completed, diverged) is not launched
again, which is how `harness.sweep --resume` skips them without rewriting the list.
"""

# no `from __future__ import annotations`: Hydra imports plugin modules outside sys.modules (dataclasses)

from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


def load_jobs(path: str) -> list[list[str]]:
    """The override lists of the jobs still to run, in launch order."""
    from harness.multirun.progress import FINISHED, read_summary

    spec = OmegaConf.to_container(OmegaConf.load(path))
    sweep_dir = Path(path).parent
    return [
        list(job["overrides"])
        for job in spec["jobs"]
        if (read_summary(sweep_dir / job["name"]) or {}).get("status") not in FINISHED
    ]


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
