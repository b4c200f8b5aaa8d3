"""Uniform random numbers for NVFP4's stochastic rounding on CUDA: Triton's Philox.

One seed per quantized tensor is drawn from the run's stochastic-rounding generator (a one-element
int64 tensor on the device: no host sync), and element i of the padded (Mp, Kp) matrix gets
`tl.rand(seed, i)`. The reference path on CUDA materializes these uniforms (`uniforms`); the fused
NVFP4 kernel computes the same ones in registers from the same seed (harness.numerics.triton_cast),
so both round the same elements the same way, and the kernel saves a full-size torch.rand pass and
its read (23 ms and about as much again of the emulated NVFP4 step at 1.4B). TE itself feeds the
hardware's stochastic cvt with Philox bits of its own stream: no emulator reproduces those bits
(docs/numerics.md section 6), only the rounding's distribution. Where triton is absent: torch.rand.
"""

from __future__ import annotations

import torch

try:  # optional: only the CUDA fast path needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI's CPU machine)
    triton = None

BLOCK = 4096


if triton is not None:

    @triton.jit
    def _uniforms(seed_ptr, out_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.rand(tl.load(seed_ptr), offs), mask=offs < N)


def draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """A one-element int64 seed on `device`, drawn from `generator` (advancing it)."""
    return torch.randint(0, 2**62, (1,), generator=generator, device=device, dtype=torch.int64)


def from_seed(shape, seed: torch.Tensor) -> torch.Tensor:
    """U[0, 1) fp32 of `shape` on seed's device: element i (row-major) is Philox's tl.rand(seed, i)."""
    out = torch.empty(shape, dtype=torch.float32, device=seed.device)
    n = out.numel()
    _uniforms[(-(-n // BLOCK),)](seed, out, n, BLOCK=BLOCK)
    return out


def uniforms(shape, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """U[0, 1) fp32 of `shape` for stochastic rounding on a GPU: `from_seed(draw_seed(...))` where
    triton is installed (what the fused kernel draws), else torch.rand."""
    device = torch.device(device)
    if triton is not None and device.type == "cuda":
        return from_seed(shape, draw_seed(generator, device))
    return torch.rand(shape, generator=generator, device=device)
