"""Optimizer CPU offload (--optimizer-cpu-offload): master weights, states and the step on the host."""

from __future__ import annotations

import torch

from harness.config.schema import OptimizerConfig


class CpuOffloadAdamW:
    """Optimizer CPU offload: fp32 master weights and AdamW states in host memory, step on the CPU."""

    def __init__(self, groups: list[dict], cfg: OptimizerConfig):
        self.params = [p for g in groups for p in g["params"]]
        pin = (lambda t: t.pin_memory()) if torch.cuda.is_available() else (lambda t: t)  # noqa: E731
        self.master = [pin(p.detach().float().cpu()) for p in self.params]
        self.host_grads = [pin(torch.zeros_like(m)) for m in self.master]
        it = iter(self.master)
        host_groups = [{**g, "params": [next(it) for _ in g["params"]]} for g in groups]
        self.inner = torch.optim.AdamW(host_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def step(self) -> None:
        for p, m, h in zip(self.params, self.master, self.host_grads):
            h.copy_(p.main_grad if hasattr(p, "main_grad") else p.grad, non_blocking=True)
            m.grad = h
        if self.params and self.params[0].is_cuda:
            torch.cuda.synchronize()  # the host step needs the grads
        self.inner.step()
        for p, m in zip(self.params, self.master):
            p.data.copy_(m, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "master": self.master}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        for m, saved in zip(self.master, state["master"]):
            m.copy_(saved)

    def memory_bytes(self) -> dict:
        # everything lives in host memory: nothing of it counts against the GPU
        return {
            "master_weights": 0,
            "optimizer_states": 0,
            "main_grads": 0,
            "host_bytes": sum(m.numel() * 4 * 3 for m in self.master),
        }
