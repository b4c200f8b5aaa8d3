"""Megatron's fp32 main-grad buffer (--main-grads-dtype fp32 with TE's fused wgrad accumulation)."""

from __future__ import annotations

import torch
import torch.nn as nn


class MainGrads:
    """Megatron's fp32 gradient buffer, one persistent fp32 `main_grad` per parameter. TE layers built
    with fuse_wgrad_accumulation write their weight grads into it inside the wgrad GEMM (their `.grad`
    stays None, so no hook fires); every other parameter's bf16 grad is added by a hook and freed."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        for p in params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.register_post_accumulate_grad_hook(self._accumulate)

    @staticmethod
    def _accumulate(p: nn.Parameter) -> None:
        if p.grad is not None:  # None where TE's wgrad GEMM already wrote into main_grad
            p.main_grad.add_(p.grad)
            p.grad = None

    def grads(self) -> list[torch.Tensor]:
        return [p.main_grad for p in self.params]

    def zero(self) -> None:
        torch._foreach_zero_(self.grads())

    def nbytes(self) -> int:
        return sum(g.numel() * 4 for g in self.grads())
