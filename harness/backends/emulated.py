"""The emulated backend: the GPT in pure PyTorch, each GEMM operand quantized as TE would.

BF16 semantics without torch.autocast: GEMM operands are rounded to bf16, products accumulate in
fp32 and the output is rounded to bf16 -- what a bf16 tensor-core GEMM does. On a CPU without bf16
units the GEMM itself runs in fp32 (about 7x faster there than torch's bf16 matmul, same numbers up
to accumulation order); on CUDA it is a native bf16 GEMM.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.backends.base import Backend
from harness.model import GPT

BF16 = torch.bfloat16


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ W.T (+ b) with bf16 operands, fp32 accumulation and a bf16 result (autograd-aware)."""
    b = bias.to(BF16) if bias is not None else None
    if x.is_cuda:
        return F.linear(x.to(BF16), weight.to(BF16), b)
    y = F.linear(x.to(BF16).float(), weight.to(BF16).float(), b.float() if b is not None else None)
    return y.to(BF16)


class EmulatedLinear(nn.Module):
    """nn.Linear-compatible; `quant` (None = BF16) implements the recipe's quantized GEMMs."""

    def __init__(self, name: str, in_features: int, out_features: int, bias: bool, quant=None):
        super().__init__()
        self.name = name
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.quant = quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return bf16_linear(x, self.weight, self.bias)
        return self.quant.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        q = "bf16" if self.quant is None else repr(self.quant)
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, numerics={q}"


class Activation(nn.Module):
    """GELU (tanh approximation, as TE's) or SwiGLU on the fused fc1 output."""

    def __init__(self, name: str, kind: str):
        super().__init__()
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"model.activation={kind}: use gelu or swiglu")
        self.name, self.kind = name, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            return F.gelu(x, approximate="tanh")
        gate, value = x.chunk(2, dim=-1)
        return F.silu(gate) * value

    def extra_repr(self) -> str:
        return self.kind


class EmulatedOps:
    def __init__(self, backend: EmulatedBackend):
        self.backend = backend

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        recipe = self.backend.plan.recipe_for(name)
        if recipe is not None:
            raise ValueError(
                f"recipe={recipe.name} with backend=emulated: not supported yet "
                "(the emulated quantizers land with the emulator issue); use recipe=bf16"
            )
        return EmulatedLinear(name, in_features, out_features, bias)

    def activation(self, name: str, kind: str) -> nn.Module:
        return Activation(name, kind)


class EmulatedBackend(Backend):
    name = "emulated"

    def build_model(self) -> nn.Module:
        return GPT(self.cfg.model, EmulatedOps(self)).to(self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        # bf16 rounding lives in the GEMMs themselves (bf16_linear), so no torch.autocast is needed
        return contextlib.nullcontext()
