"""BF16 expert GEMMs on one grouped kernel per pass, with TE's rounding points (CUDA only).

TE's `GroupedLinear` (Megatron's TEGroupedMLP) runs an expert group as one cuBLAS GEMM per expert
in each of fprop, dgrad and wgrad; at fine-grained MoE shapes (Qwen3-30B-A3B: 128 experts of
hidden 2048, FFN 768) those GEMMs are small and the group runs far below the GPU's rate
(benchmarks/RESULTS.md, "The expert MLP alone"). Here:

- fprop (y_e = x_e W_e^T) and dgrad (dx_e = dy_e W_e) are one `torch._grouped_mm` each: BF16
  operands, fp32 accumulation, the output rounded to BF16 once, as TE's per-expert GEMMs round it;
- wgrad (dW_e = dy_e^T x_e over expert e's rows) is `grouped_wgrad`, a Triton kernel that sums in
  fp32 and adds the fp32 sum into the parameter's fp32 `main_grad` (TE's fused wgrad accumulation:
  its cuBLAS GEMM with beta = 1 into main_grad, `module/grouped_linear.py` with
  fuse_wgrad_accumulation). `torch._grouped_mm` writes BF16 only, and a BF16 wgrad added to the fp32
  main grad is one rounding TE does not make: that version failed its loss check (RESULTS.md).

Rows are grouped by expert (Megatron's permutation) and `ends` holds each expert's end row (int32,
cumulative); an expert without rows gets a zero wgrad. The sums run in another order than cuBLAS's,
so results agree with TE's to fp32 accumulation-order differences, not to the bit.
"""

from __future__ import annotations

import torch

try:  # optional: only the CUDA path needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI's CPU machine)
    triton = None

BF16 = torch.bfloat16


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    def _configs():
        shapes = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4)]
        return [
            triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in shapes
        ]

    @triton.jit
    def _wgrad_kernel(
        dy_ptr,
        x_ptr,
        ends_ptr,
        out_ptr,
        M,
        N,
        stride_dy,
        stride_x,
        ACCUMULATE: tl.constexpr,
        UPCAST: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """out[e] (+)= dy[rows of e]^T @ x[rows of e] in fp32; program (tile, expert)."""
        e = tl.program_id(1)
        tile = tl.program_id(0)
        tiles_n = tl.cdiv(N, BN)
        rm = (tile // tiles_n) * BM + tl.arange(0, BM)
        rn = (tile % tiles_n) * BN + tl.arange(0, BN)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(start, end, BK):
            rk = k0 + tl.arange(0, BK)
            in_k = rk < end
            a = tl.load(
                dy_ptr + rk[:, None] * stride_dy + rm[None, :],
                mask=in_k[:, None] & (rm[None, :] < M),
                other=0.0,
            )
            b = tl.load(
                x_ptr + rk[:, None] * stride_x + rn[None, :],
                mask=in_k[:, None] & (rn[None, :] < N),
                other=0.0,
            )
            if (
                UPCAST
            ):  # Triton's CPU interpreter multiplies bf16 dot operands wrongly; fp32 products are exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(tl.trans(a), b, acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        out = out_ptr + e.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
        if ACCUMULATE:
            acc += tl.load(out, mask=mask)
        tl.store(out, acc, mask=mask)

    # tiles timed per (M, N) on first use; out is restored between the timed runs it accumulates into
    _wgrad_tuned = triton.autotune(configs=_configs(), key=["M", "N"], restore_value=["out_ptr"])(
        _wgrad_kernel
    )


def grouped_wgrad(
    dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """dW (experts, out, in) fp32 with dW_e = dy_e^T x_e: added into `out` (fp32, the main grad) when
    given, else a new tensor. dy (rows, out) and x (rows, in) BF16, rows grouped by expert."""
    dy, x = dy.contiguous(), x.contiguous()
    experts, (m, n) = ends.numel(), (dy.shape[1], x.shape[1])
    accumulate = out is not None
    if out is None:
        out = torch.empty(experts, m, n, device=dy.device, dtype=torch.float32)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (experts, m, n):
        raise ValueError(f"grouped_wgrad: out must be a contiguous fp32 ({experts}, {m}, {n}) tensor")

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]), experts)

    args = (dy, x, ends, out, m, n, dy.stride(0), x.stride(0))
    if dy.is_cuda:
        _wgrad_tuned[grid](*args, ACCUMULATE=accumulate, UPCAST=False)
    else:  # Triton's CPU interpreter (the tests): one small tile, nothing to time
        _wgrad_kernel[grid](*args, ACCUMULATE=accumulate, UPCAST=True, BM=32, BN=32, BK=16)
    return out


class GroupedLinear(torch.autograd.Function):
    """y = x W_e^T on each expert's rows: fprop and dgrad by torch._grouped_mm, wgrad by
    grouped_wgrad. With an fp32 `weight.main_grad` the wgrad is added there and no `.grad` is
    returned (as TE's fused wgrad accumulation leaves it); else the fp32 wgrad, rounded to the
    weight's dtype, is the weight's grad."""

    @staticmethod
    def forward(ctx, x, weight, ends):
        ctx.save_for_backward(x, weight, ends)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, dy):
        x, weight, ends = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, weight, offs=ends) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is not None:
                grouped_wgrad(dy, x, ends, out=main_grad)
            else:
                dw = grouped_wgrad(dy, x, ends).to(weight.dtype)
        return dx, dw, None
