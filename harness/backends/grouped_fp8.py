"""FP8 expert groups under per-expert current scaling (recipe=tensorwise, recipe.fp8=e4m3) on one
grouped kernel per pass (CUDA only).

TE's `GroupedLinear` quantizes each expert on its own (one Float8CurrentScalingQuantizer per expert
and operand, docs/numerics_grouped.md §2.2, §3.2) and runs one cuBLAS GEMM per expert; at
fine-grained MoE shapes that group is 2-5x slower under FP8 than under BF16 on an H200
(benchmarks/RESULTS.md, "The expert MLP alone"). Here the same codes and scales come from two Triton
passes over the whole group, and the GEMMs are grouped:

- `group_amax`: each expert's amax over its own rows (rows grouped by expert, `ends` cumulative
  int32 as in harness.backends.grouped_gemm): an integer max over the |x| bit patterns with NaN
  patterns zeroed (harness.numerics.triton_amax), then an atomic integer max of each program's
  fp32 bits into the expert's slot: exact in any order.
- `group_cast`: each expert's scale and scale_inv from its amax, computed in the cast kernel as the
  emulator computes them (harness.numerics.scaling.scale_from_amax, reciprocal): fp8max 448 /
  max(amax, epsilon) in IEEE fp32, FLT_MAX where that overflows, 1 where the amax is 0, Inf or NaN,
  optionally a power of two (TE's compute_scale_from_amax, docs/numerics.md §3); an expert without
  rows gets amax 0 and the scale the rule gives it (1, or 448 / epsilon): TE computes nothing for it
  (its quantizer returns before the amax, docs/numerics_grouped.md §4), and no GEMM reads it. Then
  each expert's rows times its scale in fp32, saturated to +-448 and rounded to
  nearest even on the E4M3 grid (harness.numerics.triton_cast's arithmetic, the emulator's
  `cast_fp8`), written as the rowwise codes and, where a wgrad or dgrad needs them, the columnwise
  copy: the byte transpose (one scale per expert and tensor, so TE's columnwise copy is the
  transpose of the rowwise one, docs/numerics.md §2-§3). Activations' columnwise copy is the
  (K, rows) transpose of the whole group; a weight group's is one (in, out) transpose per expert.
- `FP8GroupedLinear`: fprop y = x W_e^T and dgrad dx = dy W_e on `torch._scaled_grouped_mm` (E4M3
  operands only, mat_a row-major, mat_b column-major, fp32 rowwise scales: each row's expert
  scale_inv and each expert's weight scale_inv broadcast over its columns; BF16 output, as TE's
  GEMMs write), fast accumulation in fprop only (TE's Float8CurrentScaling: fp8_gemm_fprop without
  split accumulator, dgrad and wgrad with it; common/recipe/__init__.py L307-L309); wgrad
  dW_e = dy_e^T x_e by `grouped_wgrad_fp8`, a Triton kernel over the columnwise codes (the copies
  TE's wgrad reads) on Hopper's FP8 MMA, its partial sums promoted into an fp32 accumulator every
  128 products (TE's wgrad runs without fast accumulation), times the two experts' scale_inv, added
  into the fp32 `main_grad` (TE's wgrad with
  fuse_wgrad_accumulation accumulates there in fp32, module/grouped_linear.py L1448-L1469; a
  BF16-rounded wgrad failed a loss check, RESULTS.md).

The codes and scales equal the emulator's (CurrentScalingQuantizer per expert) to the bit; the GEMM
outputs agree with TE's to fp32 accumulation-order differences. Only E4M3 operands: recipe.fp8=hybrid
(E5M2 gradients) cannot run on torch's grouped FP8 kernel (`require_e4m3`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from harness.numerics.formats import ABS_BITS

try:  # optional: only the CUDA path needs it
    import triton
    import triton.language as tl

    from harness.numerics import triton_amax, triton_cast
except ImportError:  # pragma: no cover - exercised where triton is absent (CI's CPU machine)
    triton = None

BF16 = torch.bfloat16
ROWS, COLS = 64, 128  # the tile one program of the amax and cast kernels reads per loop step
SPLIT = 4  # programs per (expert, column tile): an expert's rows are strided over them


def available() -> bool:
    return triton is not None and torch.cuda.is_available() and hasattr(torch, "_scaled_grouped_mm")


def require_e4m3(fp8: str | None) -> None:
    """torch._scaled_grouped_mm multiplies E4M3 operands only (torch/_meta_registrations.py,
    `_meta_grouped_mm_common`), so every tensor of the group must be E4M3."""
    if fp8 != "e4m3":
        raise ValueError(
            f"backend.moe_experts=grouped with recipe=tensorwise needs E4M3 gradients (torch's grouped "
            f"FP8 GEMM takes E4M3 only), not recipe.fp8={fp8}: set recipe.fp8=e4m3 or backend.moe_experts=te"
        )


if triton is not None:

    @triton.jit
    def _rows_of(ends_ptr, e):
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        return start, tl.load(ends_ptr + e)

    @triton.jit
    def _amax_kernel(
        x_ptr,
        ends_ptr,
        out_ptr,
        K,
        DTYPE: tl.constexpr,
        IBITS: tl.constexpr,
        MASK: tl.constexpr,
        INF: tl.constexpr,
        SPLIT: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
    ):
        """out[e] (int32, zeroed, read as fp32) = max |x| over expert e's rows; program (e, c, s) reads
        the rows s, s + SPLIT, ... (in BR-row steps) of column tile c and max-es its fp32 bits in."""
        e, c, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end = _rows_of(ends_ptr, e)
        cols = c * BC + tl.arange(0, BC)
        m = tl.zeros((BR, BC), dtype=tl.int32)  # |x| bit patterns, widened: one loop-carried type
        for r0 in range(start + s * BR, end, SPLIT * BR):
            rows = r0 + tl.arange(0, BR)
            inside = (rows < end)[:, None] & (cols < K)[None, :]
            bits = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=inside, other=0)
            m = tl.maximum(m, triton_amax.abs_bits(bits, MASK, INF).to(tl.int32))
        amax = triton_cast._f32(tl.max(tl.max(m, axis=1), axis=0).to(IBITS).to(DTYPE, bitcast=True))
        tl.atomic_max(out_ptr + e, amax.to(tl.int32, bitcast=True))  # non-negative: bits order as values

    @triton.jit
    def _scale_from_amax(a, eps, HAS_EPS: tl.constexpr, POW2: tl.constexpr):
        """scaling.scale_from_amax(a, 448, power_2=POW2, epsilon=eps) of one fp32 amax."""
        if HAS_EPS:
            a = tl.where(a < eps, eps, a)
        scale = tl.math.div_rn(448.0, a)
        scale = tl.where(scale > 3.4028234663852886e38, 3.4028234663852886e38, scale)  # Inf -> FLT_MAX
        scale = tl.where((a > 3.4028234663852886e38) | (a == 0) | (a != a), 1.0, scale)
        if POW2:
            scale = (triton_cast._bits_f32(scale) & -8388608).to(tl.float32, bitcast=True)  # & 0xFF800000
        return scale

    @triton.jit
    def _cast_kernel(
        x_ptr,
        ends_ptr,
        amax_ptr,
        scale_ptr,
        sinv_ptr,
        row_ptr,
        col_ptr,
        row_sinv_ptr,
        M,
        K,
        eps,
        HAS_EPS: tl.constexpr,
        POW2: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLUMNWISE: tl.constexpr,
        PER_EXPERT_T: tl.constexpr,
        ROW_SCALES: tl.constexpr,
        SPLIT: tl.constexpr,
        BR: tl.constexpr,
        BC: tl.constexpr,
    ):
        """Expert e's scale and scale_inv from amax[e] (written by program (e, 0, 0)); its rows (s,
        s + SPLIT, ... in BR-row steps), columns tile c, cast with that scale: rowwise codes at
        [row, col] of (M, K); columnwise at [col, row] of (K, M), or with PER_EXPERT_T at
        [col, row - start] of expert e's own (K, end - start) block; each row's scale_inv
        (ROW_SCALES, written by the first column tile)."""
        e, c, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start, end = _rows_of(ends_ptr, e)
        scale = _scale_from_amax(tl.load(amax_ptr + e), eps, HAS_EPS, POW2)
        sinv = tl.math.div_rn(1.0, scale)
        if (c == 0) & (s == 0):
            tl.store(scale_ptr + e, scale)
            tl.store(sinv_ptr + e, sinv)
        cols = c * BC + tl.arange(0, BC)
        if PER_EXPERT_T:
            base, ld = start.to(tl.int64) * K, end - start
        else:
            base, ld = start.to(tl.int64), M
        for r0 in range(start + s * BR, end, SPLIT * BR):
            rows = r0 + tl.arange(0, BR)
            inside = (rows < end)[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=inside, other=0.0)
            v = triton_cast._f32(x) * scale
            v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0))  # satfinite, NaN kept
            q = triton_cast._fp8_bits(triton_cast._rne_on_grid(v, 3, -6), tl.float8e4nv)
            if ROWWISE:
                tl.store(row_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=inside)
            if COLUMNWISE:
                at = base + cols.to(tl.int64)[None, :] * ld + (rows - start)[:, None]
                tl.store(col_ptr + at, q, mask=inside)
            if ROW_SCALES:
                first_tile = rows * 0 + c == 0  # block-shaped: the interpreter rejects a scalar mask
                tl.store(
                    row_sinv_ptr + rows, sinv + tl.zeros((BR,), tl.float32), mask=(rows < end) & first_tile
                )

    @triton.jit
    def _wgrad_kernel(
        dyt_ptr,
        xt_ptr,
        ends_ptr,
        dy_sinv_ptr,
        x_sinv_ptr,
        out_ptr,
        M,
        N,
        R,
        ACCUMULATE: tl.constexpr,
        UPCAST: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """out[e] (+)= (dyT[:, rows of e] @ xT[:, rows of e]^T) * dy_sinv[e] * x_sinv[e] in fp32,
        from E4M3 codes dyT (M, R), xT (N, R); program (tile, expert). An expert
        without rows leaves an accumulated `out` untouched (TE's main grad) and zeroes a fresh one."""
        e = tl.program_id(1)
        tile = tl.program_id(0)
        tiles_n = tl.cdiv(N, BN)
        rm = (tile // tiles_n) * BM + tl.arange(0, BM)
        rn = (tile % tiles_n) * BN + tl.arange(0, BN)
        start, end = _rows_of(ends_ptr, e)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(start, end, BK):
            rk = k0 + tl.arange(0, BK)
            in_k = rk < end
            a = tl.load(
                dyt_ptr + rm.to(tl.int64)[:, None] * R + rk[None, :],
                mask=(rm[:, None] < M) & in_k[None, :],
                other=0.0,
            )
            b = tl.load(
                xt_ptr + rn.to(tl.int64)[:, None] * R + rk[None, :],
                mask=(rn[:, None] < N) & in_k[None, :],
                other=0.0,
            )
            if UPCAST:  # Triton's CPU interpreter: fp32 products of E4M3 codes are exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            # Hopper's FP8 MMA keeps a narrower accumulator; its partial sums are added into the
            # fp32 `acc` every BK (128) products, as TE's wgrad does not use fast accumulation
            # (split accumulator). Triton's sm_90 default never promotes (fast accumulation); 0
            # would promote but leaves wgmma for fp16 mma.sync (seen in the sm_90 PTX).
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BK)
        acc = acc * (tl.load(dy_sinv_ptr + e) * tl.load(x_sinv_ptr + e))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        out = out_ptr + e.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
        if ACCUMULATE:
            mask = mask & (rm[:, None] * 0 + end > start)  # block-shaped, as the interpreter needs
            acc += tl.load(out, mask=mask)
        tl.store(out, acc, mask=mask)

    def _wgrad_configs():
        shapes = [(128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (64, 128, 128, 4, 4)]
        return [
            triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in shapes
        ]

    # tiles timed per (M, N) on first use; out is restored between the timed runs it accumulates into
    _wgrad_tuned = triton.autotune(configs=_wgrad_configs(), key=["M", "N"], restore_value=["out_ptr"])(
        _wgrad_kernel
    )


class GroupQuantized(NamedTuple):
    """A group's E4M3 copies: `rowwise` (M, K) codes, `columnwise` (K, M) (or (E, K, m_e) per
    expert for weights) or None, each expert's fp32 `amax`, `scale`, `scale_inv` (E,), and each
    row's scale_inv `row_scale_inv` (M,) or None."""

    rowwise: torch.Tensor | None
    columnwise: torch.Tensor | None
    amax: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    row_scale_inv: torch.Tensor | None


def group_amax(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each expert's max |x| over its rows of x (M, K) as fp32 (E,), NaN ignored; 0 without rows."""
    x = x.contiguous()
    itype, mask, inf = ABS_BITS[x.dtype]
    experts, k = ends.numel(), x.shape[1]
    amax = torch.zeros(experts, dtype=torch.int32, device=x.device)
    _amax_kernel[(experts, triton.cdiv(k, COLS), SPLIT)](
        x.view(itype), ends, amax, k, DTYPE=_TL[x.dtype], IBITS=_TL[itype], MASK=mask, INF=inf,
        SPLIT=SPLIT, BR=ROWS, BC=COLS,
    )  # fmt: skip
    return amax.view(torch.float32)


_TL = {} if triton is None else {
    torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
    torch.int16: tl.int16, torch.int32: tl.int32,
}  # fmt: skip


def group_cast(
    x: torch.Tensor,
    ends: torch.Tensor,
    amax: torch.Tensor,
    *,
    power_2: bool = False,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
    per_expert_t: bool = False,
    row_scales: bool = False,
):
    """Each expert's scale and scale_inv (E,) from its amax, and the E4M3 codes of x (M, K) with expert
    e's rows times its scale: (scale, scale_inv, rowwise (M, K), columnwise (K, M) or with
    `per_expert_t` (E, K, M / E), row scale_inv (M,)), the last three None where not asked for."""
    x = x.contiguous()
    m, k = x.shape
    experts = ends.numel()
    dev, u8, f32 = x.device, torch.uint8, torch.float32
    scale, scale_inv = (
        torch.empty(experts, dtype=f32, device=dev),
        torch.empty(experts, dtype=f32, device=dev),
    )
    row = torch.empty(m, k, dtype=u8, device=dev) if rowwise else None
    col = torch.empty(k * m, dtype=u8, device=dev) if columnwise else None
    row_sinv = torch.empty(m, dtype=f32, device=dev) if row_scales else None
    dummy = torch.empty(1, dtype=u8, device=dev)
    _cast_kernel[(experts, triton.cdiv(k, COLS), SPLIT)](
        x, ends, amax, scale, scale_inv,
        row if rowwise else dummy, col if columnwise else dummy, row_sinv if row_scales else scale_inv,
        m, k, float(epsilon),
        HAS_EPS=epsilon > 0, POW2=power_2,
        ROWWISE=rowwise, COLUMNWISE=columnwise, PER_EXPERT_T=per_expert_t, ROW_SCALES=row_scales,
        SPLIT=SPLIT, BR=ROWS, BC=COLS, enable_fp_fusion=False,
    )  # fmt: skip
    fp8 = torch.float8_e4m3fn
    if col is not None:
        col = col.view(experts, k, m // experts) if per_expert_t else col.view(k, m)
        col = col.view(fp8)
    return scale, scale_inv, (row.view(fp8) if row is not None else None), col, row_sinv


def quantize_group(
    x: torch.Tensor,
    ends: torch.Tensor,
    *,
    power_2: bool = False,
    epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
    per_expert_t: bool = False,
    row_scales: bool = False,
) -> GroupQuantized:
    """Per-expert current scaling of x (M, K), rows grouped by expert: amax, then scales and casts."""
    amax = group_amax(x, ends)
    scale, scale_inv, row, col, row_sinv = group_cast(
        x, ends, amax, power_2=power_2, epsilon=epsilon,
        rowwise=rowwise, columnwise=columnwise, per_expert_t=per_expert_t, row_scales=row_scales,
    )  # fmt: skip
    return GroupQuantized(row, col, amax, scale, scale_inv, row_sinv)


@functools.lru_cache(maxsize=64)
def _weight_ends(experts: int, n: int, device: torch.device) -> torch.Tensor:
    """Each expert's end row in a (E * N, K) weight view (a few per model: built once)."""
    return torch.arange(1, experts + 1, device=device, dtype=torch.int32) * n


def quantize_weights(
    weight: torch.Tensor, *, power_2: bool, epsilon: float, columnwise: bool
) -> GroupQuantized:
    """Each expert's weight (E, N, K) quantized on its own (TE's quantize_weight per expert):
    rowwise (E, N, K) with row scale_inv (E, N), columnwise (E, K, N) when asked for."""
    experts, n, k = weight.shape
    ends = _weight_ends(experts, n, weight.device)
    q = quantize_group(
        weight.reshape(experts * n, k), ends, power_2=power_2, epsilon=epsilon,
        columnwise=columnwise, per_expert_t=True, row_scales=True,
    )  # fmt: skip
    return q._replace(rowwise=q.rowwise.view(experts, n, k), row_scale_inv=q.row_scale_inv.view(experts, n))


def grouped_wgrad_fp8(
    dy_t: torch.Tensor,
    x_t: torch.Tensor,
    ends: torch.Tensor,
    dy_scale_inv: torch.Tensor,
    x_scale_inv: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dW (E, N_out, K_in) fp32 with dW_e = dy_e^T x_e from the columnwise E4M3 codes dy_t (N_out, M)
    and x_t (K_in, M) and each expert's two scale_inv: added into `out` (fp32, the main grad) when
    given, else a new tensor."""
    experts, (m, n, r) = ends.numel(), (dy_t.shape[0], x_t.shape[0], dy_t.shape[1])
    accumulate = out is not None
    if out is None:
        out = torch.empty(experts, m, n, device=dy_t.device, dtype=torch.float32)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (experts, m, n):
        raise ValueError(f"grouped_wgrad_fp8: out must be a contiguous fp32 ({experts}, {m}, {n}) tensor")

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]), experts)

    args = (dy_t, x_t, ends, dy_scale_inv, x_scale_inv, out, m, n, r)
    if dy_t.is_cuda:
        _wgrad_tuned[grid](*args, ACCUMULATE=accumulate, UPCAST=False)
    else:  # Triton's CPU interpreter (the tests): one small tile, nothing to time
        _wgrad_kernel[grid](*args, ACCUMULATE=accumulate, UPCAST=True, BM=32, BN=32, BK=16)
    return out


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    ends: torch.Tensor,
    fast_accum: bool,
) -> torch.Tensor:
    """Row i of expert e: out[i, j] = (a[i] . b[e][:, j]) * scale_a[i] * scale_b[e, j], BF16; a (M, K)
    E4M3 row-major, b (E, K, N) E4M3 column-major. torch._scaled_grouped_mm on CUDA; on the CPU
    (Triton's interpreter tests: torch has no CPU kernel for it) the same products in fp32."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(
            a, b, scale_a, scale_b, offs=ends, out_dtype=BF16, use_fast_accum=fast_accum
        )
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        out.append((a[start:end].float() @ b[e].float()) * scale_a[start:end, None] * scale_b[e])
        start = end
    return torch.cat(out).to(BF16)


class FP8GroupedLinear(torch.autograd.Function):
    """y = x W_e^T on each expert's rows, every operand E4M3 with its own per-expert current scale:
    fprop and dgrad by torch._scaled_grouped_mm (`scaled_grouped_mm`), wgrad by grouped_wgrad_fp8.
    With an fp32 `weight.main_grad` the wgrad is added there and no `.grad` is returned (TE's fused
    wgrad accumulation); else the fp32 wgrad, rounded to the weight's dtype, is the weight's grad.
    `power_2`, `epsilon`: the recipe's power_2_scales and amax_epsilon (one value for all roles,
    as lowp's recipe has)."""

    @staticmethod
    def forward(ctx, x, weight, ends, power_2: bool, epsilon: float):
        wgrad, dgrad = weight.requires_grad, x.requires_grad
        q = dict(power_2=power_2, epsilon=epsilon)
        xq = quantize_group(x, ends, columnwise=wgrad, row_scales=True, **q)
        wq = quantize_weights(weight, columnwise=dgrad, **q)
        y = scaled_grouped_mm(  # W_e^T: the rowwise (N, K) codes seen column-major
            xq.rowwise,
            wq.rowwise.transpose(-2, -1),
            xq.row_scale_inv,
            wq.row_scale_inv,
            ends,
            fast_accum=True,  # TE's fp8_gemm_fprop: no split accumulator
        )
        ctx.save_for_backward(xq.columnwise, xq.scale_inv, wq.columnwise, wq.scale_inv, ends)
        ctx.weight, ctx.q = weight, q
        return y

    @staticmethod
    def backward(ctx, dy):
        x_t, x_sinv, w_t, w_sinv, ends = ctx.saved_tensors
        weight, (dgrad, wgrad) = ctx.weight, ctx.needs_input_grad[:2]
        dyq = quantize_group(dy, ends, rowwise=dgrad, columnwise=wgrad, row_scales=dgrad, **ctx.q)
        dx = dw = None
        if dgrad:
            experts, k, _ = w_t.shape
            dx = scaled_grouped_mm(
                dyq.rowwise,
                w_t.transpose(-2, -1),  # (E, N, K), column-major: W_e as dgrad's operand
                dyq.row_scale_inv,
                w_sinv[:, None].expand(experts, k).contiguous(),
                ends,
                fast_accum=False,
            )
        if wgrad:
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is not None:
                grouped_wgrad_fp8(dyq.columnwise, x_t, ends, dyq.scale_inv, x_sinv, out=main_grad)
            else:
                dw = grouped_wgrad_fp8(dyq.columnwise, x_t, ends, dyq.scale_inv, x_sinv).to(weight.dtype)
        return dx, dw, None, None, None
