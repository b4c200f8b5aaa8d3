"""How the model and optimizer are spread over the ranks: one process or DDP (`Replicated`), FSDP2
(`FullyShard`); each built from the `parallel` slice of the config (docs/distributed.md)."""

from __future__ import annotations

import torch

from harness.backends.base import Backend
from harness.config.schema import ParallelConfig
from harness.parallel.process import Dist


def parallelize(model: torch.nn.Module, backend: Backend, p: ParallelConfig, dist: Dist) -> Replicated:
    """Apply `p.strategy` to a freshly built model (before its optimizer exists) and connect delayed
    scaling's amax reduction; returns the strategy's hooks for the training loop."""
    group, reducer = None, None
    if dist.active and not p.tp_only_amax_red:
        group, reducer = (dist.group or torch.distributed.group.WORLD), dist.max_
    elif dist.active:
        # tp_only_amax_red without tensor parallelism: a group of this rank alone (TE reduces over
        # the default group when it is handed none)
        group = torch.distributed.new_subgroups(group_size=1)[0]
    backend.set_amax_reduction(group, reducer)
    strategy = FullyShard if dist.fsdp else Replicated
    out = strategy(model, backend, p, dist)
    out.amax_reduced = reducer is not None
    return out


class Replicated:
    """One process, or DDP: every rank holds the whole model and its gradients, summed over the
    ranks once per step after the accumulation window (Megatron's DDP; not torch's DDP wrapper,
    because TE's fused wgrad accumulation writes into main_grad buffers that wrapper never sees).
    `optimizer.use_distributed_optimizer` shards the optimizer state (ZeRO-1, `ShardedOptimizer`)."""

    def __init__(self, model, backend: Backend, p: ParallelConfig, dist: Dist):
        self.model, self.backend, self.dist = model, backend, dist
        self.sharded_states = False
        self.amax_reduced = False

    def build_optimizer(self, model, ocfg):
        opt = self.backend.build_optimizer(model, ocfg)
        if self.dist.active and ocfg.use_distributed_optimizer and not ocfg.optimizer_cpu_offload:
            from harness.optim.sharded import ShardedOptimizer

            opt = ShardedOptimizer(opt, self.dist)
            self.sharded_states = True
        return opt

    def loss_divisor(self, accum: int) -> int:
        """What each micro-batch's loss is divided by: its share of the global batch, so that summing
        over the micro-batches and the ranks gives the global batch's mean."""
        return accum * self.dist.world

    def before_backward(self, micro: int, accum: int) -> None:
        pass

    def reduce_gradients(self, optimizer) -> None:
        self.dist.sum_(optimizer.grads())

    def localize_model(self, state: dict) -> dict:
        """A checkpoint's whole model tensors as this rank holds them (whole, here)."""
        return state

    def localize_optimizer(self, state: dict, params: list) -> dict:
        return state

    def describe(self) -> dict:
        out = self.dist.describe()
        out["sharded_optimizer_states"] = self.sharded_states
        out["amax_reduction"] = "data_parallel" if self.amax_reduced else "local"
        return out


class FullyShard(Replicated):
    """FSDP2: `fully_shard` on every transformer block, then on the whole model; parameters,
    gradients and optimizer states are DTensors sharded over the ranks. Gradients accumulate whole
    over the window and are reduce-scattered (averaged over the ranks) once per step."""

    def __init__(self, model, backend: Backend, p: ParallelConfig, dist: Dist):
        super().__init__(model, backend, p, dist)
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        reshard = p.reshard_after_forward
        self.units = []
        for block in model.blocks:
            self.units.append(fully_shard(block, reshard_after_forward=reshard))
        self.units.append(fully_shard(model, reshard_after_forward=reshard))
        register_fsdp_forward_method(model, "loss")  # the training loop calls model.loss, not forward
        self.sharded_states = True

    def loss_divisor(self, accum: int) -> int:
        return accum  # FSDP2's reduce-scatter averages over the ranks itself

    def build_optimizer(self, model, ocfg):
        return self.backend.build_optimizer(model, ocfg)

    def before_backward(self, micro: int, accum: int) -> None:
        # accumulate whole gradients locally; reduce-scatter after the window's last backward
        self.model.set_requires_gradient_sync(micro == accum - 1)

    def reduce_gradients(self, optimizer) -> None:
        pass

    def localize_model(self, state: dict) -> dict:
        own = {self.backend.canonical_name(k): v for k, v in self.model.state_dict().items()}
        return {k: _like(v, own.get(k)) for k, v in state.items()}

    def localize_optimizer(self, state: dict, params: list) -> dict:
        """Per-parameter states shaped like their parameter become its shard (any saved world size)."""
        out = {}
        for i, st in state["state"].items():
            p = params[i]
            out[i] = {
                k: _like(v, p) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                for k, v in st.items()
            }
        return {**state, "state": out}


def _like(value, ref):
    """`value` (a whole tensor) laid out as `ref`: its DTensor shard where ref is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(ref, DTensor) or isinstance(value, DTensor):
        return value
    whole = value.to(device=ref.device)  # its own dtype: fp8 moment codes stay codes
    return distribute_tensor(whole, ref.device_mesh, ref.placements, src_data_rank=None)
