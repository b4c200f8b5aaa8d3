"""ZeRO-1 for data parallel runs (--use-distributed-optimizer with DDP): each rank keeps the optimizer
state of its share of the parameters and updates only those; the updated values are then broadcast
from their owner, so every rank again holds the whole model.

AdamW is elementwise, so the numbers are those of the unsharded optimizer (the gradient norm and its
clipping use the whole, already summed gradients on every rank). The precision-aware optimizer's
low-precision states (fp8 moments with their per-tensor scales, fp16 masters) are per parameter
and live whole on the owner: sharding by parameter never splits a scale's tensor. TE's quantized
parameters (fp8_param) are broadcast as their quantized storage (data and scale_inv), the FP8
parameter gather of Megatron's distributed optimizer.
"""

from __future__ import annotations

import torch

from harness.optim.optimizer import Optimizer, quantized_parts


def owners(params: list, world: int) -> list[int]:
    """Greedy by size, largest first, ties by position: a balanced, deterministic assignment."""
    load = [0] * world
    out = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += params[i].numel()
    return out


class ShardedOptimizer(Optimizer):
    """Wraps a built `Optimizer`: its inner optimizer keeps only this rank's parameters."""

    def __init__(self, base: Optimizer, dist):
        super().__init__(base.inner, base.params, base.main_grads, base.decoupled)
        self.dist = dist
        self.owner = owners(self.params, dist.world)
        mine = {id(p) for p, r in zip(self.params, self.owner) if r == dist.rank}
        index = {id(p): i for i, p in enumerate(self.params)}
        self._groups_global = []  # each group's parameters as indices into self.params
        for g in self.inner.param_groups:
            self._groups_global.append([index[id(p)] for p in g["params"]])
            g["params"] = [p for p in g["params"] if id(p) in mine]
        self._local = [index[id(p)] for g in self.inner.param_groups for p in g["params"]]

    def step(self) -> None:
        super().step()
        self._broadcast()

    @torch.no_grad()
    def _broadcast(self) -> None:
        """Every parameter from its owner (its quantized storage for TE's FP8 parameters)."""
        for src in range(self.dist.world):
            parts = []
            for p, r in zip(self.params, self.owner):
                if r == src:
                    parts.extend(quantized_parts(p) or [p.data])
            by_kind: dict[tuple, list[torch.Tensor]] = {}
            for t in parts:
                by_kind.setdefault((t.dtype, t.device), []).append(t)
            for group in by_kind.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                torch.distributed.broadcast(flat, src=src, group=self.dist.group)
                if src != self.dist.rank:
                    offset = 0
                    for t in group:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()

    def zero_grad(self) -> None:
        for p in self.params:  # the inner optimizer only knows this rank's parameters
            p.grad = None
        super().zero_grad()

    def state_dict(self) -> dict:
        """The whole optimizer's state (gathered from the owners), indexed as the unsharded one."""
        local = self.inner.state_dict()
        mine = {
            self._local[i]: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for i, st in local["state"].items()
        }
        gathered: list = [None] * self.dist.world
        torch.distributed.all_gather_object(gathered, mine, group=self.dist.group)
        state = {}
        for part in gathered:
            state.update(part)
        groups = [{**g, "params": idx} for g, idx in zip(local["param_groups"], self._groups_global)]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state: dict) -> None:
        """The whole optimizer's state: this rank keeps its parameters' entries."""
        position = {g: i for i, g in enumerate(self._local)}
        own = {position[g]: st for g, st in state["state"].items() if g in position}
        groups, offset = [], 0
        for saved, g in zip(state["param_groups"], self.inner.param_groups):
            n = len(g["params"])
            groups.append({**saved, "params": list(range(offset, offset + n))})
            offset += n
        self.inner.load_state_dict({"state": own, "param_groups": groups})
