# ruff: noqa: UP006, UP035, UP045 - typing.Optional/List: see the import note below
"""Hydra config nodes of lowp's launchers (hydra/launcher=lowp_local|lowp_slurm) and sweeper (lowp).

The launcher fields are hydra-submitit-launcher's (so its documentation applies) plus lowp's own:
`sweep_name` (jobs are named `lowp:<sweep_name>:<run>`), `max_parallel` (jobs submitted at once; 0 = all)
`poll_s` (how often the scheduler is asked for job states) and `progress_s` (where the output is no
terminal, how often the status line and one line per running job are printed).
"""

# no `from __future__ import annotations`: Hydra's plugin scan imports this module outside sys.modules,
# where dataclasses cannot resolve string annotations
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class LowpQueueConf:
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"
    timeout_min: int = 60
    cpus_per_task: Optional[int] = None
    gpus_per_node: Optional[int] = None
    tasks_per_node: int = 1
    mem_gb: Optional[int] = None
    nodes: int = 1
    stderr_to_stdout: bool = True
    sweep_name: Optional[str] = None
    max_parallel: int = 0
    poll_s: float = 1.0
    progress_s: float = 30.0


@dataclass
class LowpLocalConf(LowpQueueConf):
    _target_: str = "hydra_plugins.lowp_launcher.launcher.LowpLocalLauncher"
    max_parallel: int = 1


@dataclass
class LowpSlurmConf(LowpQueueConf):
    _target_: str = "hydra_plugins.lowp_launcher.launcher.LowpSlurmLauncher"
    partition: Optional[str] = None
    qos: Optional[str] = None
    comment: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    gres: Optional[str] = None
    cpus_per_gpu: Optional[int] = None
    gpus_per_task: Optional[int] = None
    mem_per_gpu: Optional[str] = None
    mem_per_cpu: Optional[str] = None
    account: Optional[str] = None
    # submitit sends USR2 this many seconds before the time limit; the run checkpoints and is requeued
    signal_delay_s: int = 120
    # requeues after a time limit (preemptions do not count)
    max_num_timeout: int = 3
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    setup: Optional[List[str]] = None
    poll_s: float = 10.0


@dataclass
class LowpSweeperConf:
    """Runs an explicit job list (each job its own override list) written by `harness.sweep`."""

    _target_: str = "hydra_plugins.lowp_launcher.sweeper.LowpSweeper"
    jobs_file: Optional[str] = None


cs = ConfigStore.instance()
cs.store(group="hydra/launcher", name="lowp_local", node=LowpLocalConf, provider="lowp")
cs.store(group="hydra/launcher", name="lowp_slurm", node=LowpSlurmConf, provider="lowp")
cs.store(group="hydra/sweeper", name="lowp", node=LowpSweeperConf, provider="lowp")
