"""TE's LayerNorm statistics (harness.numerics.te_layernorm) as one Triton kernel on CUDA.

The reference gathers each thread's values with an index tensor and loops over them with tensor ops;
torch.compile makes that a gather-heavy kernel (about 1.5 ms a call for 16384 x 2048 on an H200, a
third of the emulated BF16 step's overhead). This kernel does the same fp32 operations in the same
order, one program per `BLOCK_R` rows, a lane per TE thread:

- each lane sums its values in load order (vector `it * THREADS_PER_ROW + thread`, `NUM_ELTS` values
  each; values past the row count as the reference's appended zeros);
- the warp butterfly (xor 1, 2, 4, 8, 16) is a chain of pairwise sums: after `v += v[lane ^ k]` the
  two lanes of each pair hold the same value, so reshaping the lanes to (.., 2) and adding the pair is
  that step (a + b == b + a in IEEE arithmetic);
- M2's multiply-add is an FMA site emulated as the reference does, fp32(fp64(d) * fp64(d) + fp64(m2))
  (the product is exact in fp64), and FMA contraction is off for the kernel, so no other multiply-add
  is fused.

Only the per-warp (mean, M2) come from here; Chan's merge across warps and everything after stay the
reference's code. Equality with the reference is checked at atol=0 on CUDA
(tests/numerics/test_fast_path_gpu.py) and, through Triton's interpreter, on a CPU where triton is
installed (tests/numerics/test_te_layernorm.py).
"""

from __future__ import annotations

import torch

try:  # optional: only the CUDA fast path needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI's CPU machine)
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def halves(t):
        # (..., 2k) -> values at even and odd positions, each (..., k)
        return tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2] // 2, 2]))

    @triton.jit
    def fma64(d, acc):
        # fp32(fp64(d) * fp64(d) + fp64(acc)): the reference's emulated FMA (the product is exact)
        d64 = d.to(tl.float64)
        return (d64 * d64 + acc.to(tl.float64)).to(tl.float32)

    @triton.jit
    def step(acc, x, SQUARE: tl.constexpr, FMA: tl.constexpr):
        # one value into the lane's accumulator: acc + x, or x * x + acc (fused as the reference)
        if SQUARE:
            if FMA:
                out = fma64(x, acc)
            else:
                out = x * x + acc
        else:
            out = acc + x
        return out

    @triton.jit
    def in_order(acc, t, NE: tl.constexpr, SQUARE: tl.constexpr, FMA: tl.constexpr):
        # `step` for t[..., 0], t[..., 1], ..., t[..., NE - 1] in that order, NE = 4 or 8
        e, o = halves(t)  # x0 x2 x4 x6 | x1 x3 x5 x7
        if NE == 8:
            ee, eo = halves(e)  # x0 x4 | x2 x6
            oe, oo = halves(o)  # x1 x5 | x3 x7
            x0, x4 = tl.split(ee)
            x2, x6 = tl.split(eo)
            x1, x5 = tl.split(oe)
            x3, x7 = tl.split(oo)
            acc = four_steps(acc, x0, x1, x2, x3, SQUARE, FMA)
            acc = four_steps(acc, x4, x5, x6, x7, SQUARE, FMA)
        else:
            x0, x2 = tl.split(e)
            x1, x3 = tl.split(o)
            acc = four_steps(acc, x0, x1, x2, x3, SQUARE, FMA)
        return acc

    @triton.jit
    def four_steps(acc, a, b, c, d, SQUARE: tl.constexpr, FMA: tl.constexpr):
        # `step` for a, b, c, d in that order
        acc = step(acc, a, SQUARE, FMA)
        acc = step(acc, b, SQUARE, FMA)
        acc = step(acc, c, SQUARE, FMA)
        return step(acc, d, SQUARE, FMA)

    @triton.jit
    def pair_sum(v, BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
        # (BLOCK_R, 2 * GROUPS) -> (BLOCK_R, GROUPS): one butterfly step
        return tl.sum(tl.reshape(v, [BLOCK_R, GROUPS, 2]), axis=2)

    @triton.jit
    def warp_allreduce(v, BLOCK_R: tl.constexpr, WN: tl.constexpr):
        # (BLOCK_R, WN * 32) lanes -> (BLOCK_R, WN): __shfl_xor_sync with 1, 2, 4, 8, 16
        v = pair_sum(v, BLOCK_R, WN * 16)
        v = pair_sum(v, BLOCK_R, WN * 8)
        v = pair_sum(v, BLOCK_R, WN * 4)
        v = pair_sum(v, BLOCK_R, WN * 2)
        return pair_sum(v, BLOCK_R, WN)

    @triton.jit
    def _warp_stats(
        x_ptr,
        mean_ptr,
        m2_ptr,
        rows,
        stride,
        hidden,
        rn,
        WN: tl.constexpr,
        NE: tl.constexpr,
        LDGS: tl.constexpr,
        FMA_M2: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        T: tl.constexpr = 32 * WN  # threads per row
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < rows
        base = x_ptr + r.to(tl.int64)[:, None, None] * stride  # (BLOCK_R, 1, 1)
        # one load = one LDG of every thread: its NE consecutive values (coalesced)
        offs = tl.arange(0, T)[:, None] * NE + tl.arange(0, NE)[None, :]  # (T, NE)
        s = tl.zeros([BLOCK_R, T], dtype=tl.float32)
        for it in tl.static_range(LDGS):
            col = it * T * NE + offs
            m = rmask[:, None, None] & (col < hidden)[None, :, :]
            v = tl.load(base + col[None, :, :], mask=m, other=0.0).to(tl.float32)  # (BLOCK_R, T, NE)
            s = in_order(s, v, NE, False, False)
        mean = warp_allreduce(s, BLOCK_R, WN) * rn  # (BLOCK_R, WN)
        mean_t = tl.reshape(tl.broadcast_to(mean[:, :, None], [BLOCK_R, WN, 32]), [BLOCK_R, T])
        m2 = tl.zeros([BLOCK_R, T], dtype=tl.float32)
        for it in tl.static_range(LDGS):
            col = it * T * NE + offs
            valid = (col < hidden)[None, :, :]
            v = tl.load(base + col[None, :, :], mask=rmask[:, None, None] & valid, other=0.0).to(tl.float32)
            d = tl.where(valid, v - mean_t[:, :, None], 0.0)
            m2 = in_order(m2, d, NE, True, FMA_M2)
        m2 = warp_allreduce(m2, BLOCK_R, WN)
        out = r[:, None] * WN + tl.arange(0, WN)[None, :]
        tl.store(mean_ptr + out, mean, mask=rmask[:, None])
        tl.store(m2_ptr + out, m2, mask=rmask[:, None])

    _tuned_warp_stats = triton.autotune(  # rows per program and warps: speed only, same numbers
        configs=[
            triton.Config({"BLOCK_R": 1}, num_warps=1),
            triton.Config({"BLOCK_R": 2}, num_warps=2),
            triton.Config({"BLOCK_R": 4}, num_warps=4),
            triton.Config({"BLOCK_R": 8}, num_warps=4),
        ],
        key=["hidden", "WN", "NE", "LDGS"],
    )(_warp_stats)


def warp_stats(
    x: torch.Tensor, wn: int, ne: int, ldgs: int, rn: float, fma_m2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-warp (mean, M2) of TE's forward kernel for x (rows, hidden): two (rows, WARPS_N) fp32
    tensors, te_layernorm._warp_stats's values to the bit (`rn`: 1 / values averaged per warp)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, hidden = x.shape
    mean = torch.empty(rows, wn, dtype=torch.float32, device=x.device)
    m2 = torch.empty_like(mean)
    if ne not in (4, 8):
        raise ValueError(f"TE LayerNorm statistics: {ne} values a load; the kernel handles 4 or 8")
    args = (x, mean, m2, rows, x.stride(0), hidden, rn)
    meta = {"WN": wn, "NE": ne, "LDGS": ldgs, "FMA_M2": fma_m2, "enable_fp_fusion": False}
    if x.is_cuda:
        _tuned_warp_stats[lambda m: (-(-rows // m["BLOCK_R"]),)](*args, **meta)
    else:  # Triton's CPU interpreter (TRITON_INTERPRET=1), which cannot time configurations
        _warp_stats[(-(-rows // 2),)](*args, BLOCK_R=2, **meta)
    return mean, m2
