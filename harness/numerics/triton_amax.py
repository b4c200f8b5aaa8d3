"""Block amaxes (blockwise, MXFP8, NVFP4) and whole-tensor amaxes in one Triton pass on CUDA.

`scaling.amax(blocks, dim=(1, 3))` of a (Mr, br, Kc, bc) block view of a contiguous (M, K) matrix:
max |x| per block with NaN ignored (TE's fmaxf from 0). As in `scaling.amax_nosync`, the maximum is
taken over the |x| bit patterns with NaN patterns (above Inf's) zeroed, an integer max: exact in
any order, so any tiling gives the reference's values to the bit. torch.compile's dynamic-shape
reduction for it took 0.55 ms a call at the 1.4B shape (265 ms of the emulated NVFP4 step); this
kernel reads each element once. The whole-tensor amax (tensorwise, delayed, NVFP4's global one)
is one pass of per-program maxima and a max over those: torch.compile's reduction for it took
0.46 ms a call (133 ms of the emulated NVFP4 step at 1.4B).
"""

from __future__ import annotations

import torch

from harness.numerics.formats import ABS_BITS

try:  # optional: only the CUDA fast path needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI's CPU machine)
    triton = None

ROWS, COLS = 64, 128  # input elements a program reads: about this many rows and columns


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def abs_bits(bits, MASK: tl.constexpr, INF: tl.constexpr):
        """|x| bit patterns of x's bits with NaN patterns (above Inf's) zeroed: their integer max is
        max |x| with NaN ignored, like fmaxf (formats.ABS_BITS gives MASK and INF per dtype)."""
        bits = bits & MASK
        return tl.where(bits > INF, 0, bits)

    @triton.jit
    def _block_amax(
        x_ptr,
        out_ptr,
        M,
        K,
        MASK: tl.constexpr,
        INF: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
        OM: tl.constexpr,
        OK: tl.constexpr,
    ):
        # a tile of OM x OK blocks: input rows [OM * BR], columns [OK * BC]
        rows = tl.program_id(0) * OM * BR + tl.arange(0, OM * BR)
        cols = tl.program_id(1) * OK * BC + tl.arange(0, OK * BC)
        m = (rows < M)[:, None] & (cols < K)[None, :]
        bits = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=m, other=0)
        bits = abs_bits(bits, MASK, INF)
        blk = tl.reshape(bits, [OM, BR, OK, BC])
        amax = tl.max(tl.max(blk, axis=3), axis=1)  # (OM, OK)
        orow = tl.program_id(0) * OM + tl.arange(0, OM)
        ocol = tl.program_id(1) * OK + tl.arange(0, OK)
        om = (orow < M // BR)[:, None] & (ocol < K // BC)[None, :]
        tl.store(out_ptr + orow.to(tl.int64)[:, None] * (K // BC) + ocol[None, :], amax, mask=om)

    @triton.jit
    def _tensor_amax(x_ptr, out_ptr, N, MASK: tl.constexpr, INF: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        bits = abs_bits(tl.load(x_ptr + offs, mask=offs < N, other=0), MASK, INF)
        tl.store(out_ptr + tl.program_id(0), tl.max(bits, axis=0))


TENSOR_BLOCK = 8192  # elements per program of the whole-tensor amax


def handles_tensor(x: torch.Tensor) -> bool:
    """Whether `tensor_amax` covers x: contiguous, a float dtype with a bit pattern spec."""
    return triton is not None and x.dtype in ABS_BITS and x.is_contiguous() and x.numel() > 0


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over all of x, NaN ignored: a 0-dim tensor in x's dtype."""
    itype, mask, inf = ABS_BITS[x.dtype]
    n = x.numel()
    partial = torch.empty(-(-n // TENSOR_BLOCK), dtype=itype, device=x.device)
    _tensor_amax[(partial.numel(),)](x.view(itype), partial, n, MASK=mask, INF=inf, BLOCK=TENSOR_BLOCK)
    return partial.amax().view(x.dtype)


def handles(blocks: torch.Tensor, dim) -> bool:
    """Whether `block_amax` covers this call: a contiguous (Mr, br, Kc, bc) view reduced over
    (1, 3), power-of-two block sides, a float dtype with a bit pattern spec."""
    if triton is None or dim != (1, 3) or blocks.dim() != 4 or blocks.dtype not in ABS_BITS:
        return False
    br, bc = blocks.shape[1], blocks.shape[3]
    pow2 = br & (br - 1) == 0 and bc & (bc - 1) == 0
    return pow2 and br <= ROWS * 2 and bc <= COLS and blocks.is_contiguous()


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| over dims (1, 3) of a (Mr, br, Kc, bc) block view, NaN ignored: (Mr, Kc) in x's dtype."""
    mr, br, kc, bc = blocks.shape
    itype, mask, inf = ABS_BITS[blocks.dtype]
    x2 = blocks.view(mr * br, kc * bc).view(itype)
    out = torch.empty(mr, kc, dtype=itype, device=blocks.device)
    om, ok = max(1, ROWS // br), max(1, COLS // bc)
    grid = (-(-mr // om), -(-kc // ok))
    _block_amax[grid](x2, out, mr * br, kc * bc, MASK=mask, INF=inf, BR=br, BC=bc, OM=om, OK=ok)
    return out.view(blocks.dtype)
