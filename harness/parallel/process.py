"""Data-parallel process groups: where this process sits in the job, and the few collectives lowp makes.

One entry point, three ways to start it (docs/distributed.md):

    python -m harness.train ...                                 world size 1, no process group
    torchrun --nproc_per_node 2 -m harness.train parallel=ddp   RANK, WORLD_SIZE, MASTER_ADDR from torchrun
    srun --ntasks 2 python -m harness.train parallel=ddp        SLURM_PROCID, SLURM_NTASKS; master: 1st node

`launch_env()` reads the environment (torchrun's variables win: `srun torchrun` sets both), `setup()`
starts the process group (gloo on CPU, NCCL on CUDA) with a collective timeout, so a dead or stuck
rank makes the others fail instead of hanging, and `Dist` is the run's view of it: rank, world size,
and the collectives of the training loop (gradients summed once per step, delayed scaling's amaxes
MAX-reduced as TE's `reduce_amax` does, metrics reduced for rank 0's row).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger("lowp")


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, as its launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "python"
    """python (one process), torchrun, or slurm (tasks started by srun / submitit)."""


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed hostlist ('gpu[01-03,07],login1') as host names, in order."""
    hosts, depth, item = [], 0, ""
    for ch in nodelist + ",":
        if ch == "," and depth == 0:
            if item:
                hosts.extend(_expand_one(item))
            item = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        item += ch
    return hosts


def _expand_one(item: str) -> list[str]:
    m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            num = str(i).zfill(len(lo))
            out.extend(_expand_one(f"{prefix}{num}{rest}"))
    return out


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(
            f"environment {key}={env[key]!r}: not an integer; fix the launcher's setting"
        ) from None


def launch_env(environ: Mapping[str, str] | None = None) -> Launch:
    """Rank and world size from torchrun's variables, else from a Slurm step's, else one process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            launcher="torchrun",
        )
    ntasks_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if "SLURM_PROCID" in env and ntasks_key in env and _int(env, ntasks_key) > 1:
        nodelist = (
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        )
        hosts = expand_nodelist(nodelist) if nodelist else []
        job = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
        return Launch(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, ntasks_key),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
            # one port per job, so two jobs sharing a node do not collide
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 20000 + job % 20000,
            launcher="slurm",
        )
    return Launch()


def world_size(environ: Mapping[str, str] | None = None) -> int:
    return launch_env(environ).world_size


def backend_for(name: str, device: torch.device) -> str:
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name not in ("gloo", "nccl"):
        raise ValueError(f"parallel.backend={name}: unknown; use auto, gloo or nccl")
    if name == "nccl" and device.type != "cuda":
        raise ValueError(
            "parallel.backend=nccl needs CUDA devices; use parallel.backend=gloo (or auto) on a CPU"
        )
    return name


class Dist:
    """The run's data-parallel group (world size 1: no group, every collective a no-op)."""

    def __init__(
        self, launch: Launch = Launch(), strategy: str = "none", group=None, backend: str | None = None
    ):
        self.launch, self.strategy, self.group, self.backend = launch, strategy, group, backend
        self.owned = False  # setup() started the process group (teardown destroys only that one)

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world(self) -> int:
        return self.launch.world_size

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take their tensors (NCCL: this rank's GPU)."""
        if self.backend == "nccl":
            return torch.device("cuda", self.launch.local_rank)
        return torch.device("cpu")

    @property
    def fsdp(self) -> bool:
        return self.active and self.strategy == "fsdp2"

    def describe(self) -> dict:
        return {
            "strategy": self.strategy if self.active else "none",
            "world_size": self.world,
            "launcher": self.launch.launcher,
            "backend": self.backend,
        }

    # -- collectives ------------------------------------------------------------------------------
    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """In-place SUM over the group, one flat buffer per dtype (Megatron's grad buckets)."""
        self._flat(tensors, torch.distributed.ReduceOp.SUM)

    def max_(self, tensors: Sequence[torch.Tensor]) -> None:
        """In-place MAX over the group: TE's reduce_tensor_across_group_op_max on the amaxes."""
        self._flat(tensors, torch.distributed.ReduceOp.MAX)

    def _flat(self, tensors: Sequence[torch.Tensor], op) -> None:
        if not self.active or not tensors:
            return
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            torch.distributed.all_reduce(flat, op=op, group=self.group)
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n

    def max_scalar(self, value: float, device: torch.device | None = None) -> float:
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device or self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def any(self, flag: bool, device: torch.device | None = None) -> bool:
        """True on every rank when it is true on one (a stop request, a divergence)."""
        return bool(self.max_scalar(float(flag), device)) if self.active else flag

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier(group=self.group)

    def broadcast_object(self, obj):
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


SINGLE = Dist()


def setup(
    strategy: str, backend: str, timeout_s: float, device: torch.device, launch: Launch | None = None
) -> Dist:
    """Start the process group this run needs (none at world size 1) and return its view."""
    launch = launch or launch_env()
    if launch.world_size <= 1:
        return Dist(launch, strategy)
    if torch.distributed.is_initialized():  # started by the caller (a test, a notebook): use it
        return Dist(launch, strategy, None, torch.distributed.get_backend())
    pg_backend = backend_for(backend, device)
    os.environ.setdefault("MASTER_ADDR", launch.master_addr or "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(launch.master_port or 29500))
    if pg_backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
        os.environ.setdefault(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"
        )  # a timed-out collective ends the process
    kwargs = {"device_id": torch.device("cuda", launch.local_rank)} if pg_backend == "nccl" else {}
    torch.distributed.init_process_group(
        pg_backend,
        init_method="env://",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    log.info("rank %d/%d (%s, %s) joined", launch.rank, launch.world_size, launch.launcher, pg_backend)
    dist = Dist(launch, strategy, None, pg_backend)
    dist.owned = True
    return dist


def teardown(dist: Dist) -> None:
    """Destroy the process group setup() started (after a failure too, so the process can exit)."""
    if dist.owned and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - a peer already gone: nothing left to tear down
            log.debug("destroy_process_group: %s", exc)
