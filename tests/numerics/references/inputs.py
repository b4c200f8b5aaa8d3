"""The golden README's four input kinds at any shape: what every quantizer is checked on."""

from __future__ import annotations

import torch

KINDS = ("normal", "outliers", "tiny", "decades")


def make_input(kind: str, shape, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """normal: randn; outliers: every 97th column x300 and one all-zero row; tiny: x1e-6 (near and
    below the formats' smallest normals); decades: columns spread over 11 decades."""
    if kind not in KINDS:
        raise ValueError(f"input kind {kind!r}: choose one of {KINDS}")
    x = torch.randn(shape, generator=gen)
    k = shape[-1]
    if kind == "outliers":
        x[..., ::97] *= 300.0
        x.view(-1, k)[min(7, x.numel() // k - 1)] = 0.0
    elif kind == "tiny":
        x = x * 1e-6
    elif kind == "decades":
        x = x * torch.logspace(-8, 3, k)
    return x.to(dtype)
