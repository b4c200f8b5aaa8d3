"""TE FusedAdam's AdamW step on bf16 parameters with int16 remainders, one Triton pass per tensor.

Megatron's default optimizer on TE (fp32 master weights, fp32 moments, fp32 main grads) is TE
FusedAdam with `store_param_remainders`: the fp32 master is the bf16 parameter plus 16 low bits kept
as int16, and `multi_tensor_adam_param_remainder` updates grad, parameter, both moments and the
remainder in one kernel (`AdamFunctorMasterParamRemainder`, transformer_engine/common/multi_tensor/
adam.cu). TE launches it as multi_tensor_apply does: 320 blocks of 512 threads per launch, less than
one wave of an H200, so a step over the 4.6B parameters of the Mixtral-like slice ran at about half
of the memory bandwidth (benchmarks/RESULTS.md, "Where the MoE slice's step goes"). Gradient clipping
adds one more pass over every main grad (`torch._foreach_mul_` by the clipping coefficient).

`step_` is the same element-wise arithmetic with a grid that covers each tensor, and the clipping
coefficient applied to the gradient on load (`mul.rn.f32`, as `_foreach_mul_` rounds it). TE builds
adam.cu with `--use_fast_math`, so its kernel flushes fp32 denormals, divides by a reciprocal
(`rcp.approx.ftz` and a multiply) and takes an approximate square root (`sqrt.approx.ftz`); nvcc
contracts `a*b + c*d` to fma(a, b, c*d) and `x - a*b` to fma(-a, b, x) (TE 2.20.2's sm_90 SASS:
FFMA.FTZ, FMUL.FTZ, MUFU.RCP, MUFU.SQRT). Those instructions are written out here in PTX
(`TE_ARITHMETIC`, `arithmetic()`), so neither Triton nor LLVM chooses them; the GPU test holds the
parameters, remainders and moments bit-identical to TE's kernel over several steps, clipped and not.
Triton's interpreter cannot run inline PTX, so the kernel has no CPU twin: the CPU tests check the
master's split and join, the bias corrections and the arithmetic's text.
"""

from __future__ import annotations

import functools

import torch

try:  # optional: only the CUDA path needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI's CPU machine)
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


@functools.lru_cache(maxsize=16)  # one step's tensors share them: computed once a step, not per tensor
def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """TE's host code: 1 - std::pow(float beta, int step), evaluated in double (stored as float when
    handed to the kernel)."""
    b1, b2 = (float(torch.tensor(b, dtype=torch.float32)) for b in (beta1, beta2))
    return 1.0 - b1**step, 1.0 - b2**step


TE_ARITHMETIC = {"div": "approx", "sqrt": "approx", "ftz": True}
"""How TE 2.20.2's fast-math kernel divides, takes square roots and treats denormals."""


def arithmetic(div: str = "approx", sqrt: str = "approx", ftz: bool = True) -> str:
    """The AdamW update of one element in PTX, from the scaled gradient, both moments and the master
    ($3..$6) and the step's scalars ($7..$13: beta1, beta2, the two bias corrections, eps, lr,
    weight decay) to the new moments and master ($0..$2). `div`: "approx" (reciprocal and multiply,
    TE's), "full" or "rn" (IEEE); `sqrt`: "approx" (TE's) or "rn"; `ftz`: flush denormals (TE's)."""
    if div not in ("approx", "full", "rn") or sqrt not in ("approx", "rn"):
        raise ValueError(f"adam_kernel.arithmetic: div={div!r}, sqrt={sqrt!r} unknown")
    z = ".ftz" if ftz else ""

    def divide(out: str, a: str, b: str) -> str:
        if div == "approx":
            return f"rcp.approx{z}.f32 {out}, {b}; mul.rn{z}.f32 {out}, {a}, {out};"
        return f"div.{div}{z}.f32 {out}, {a}, {b};"

    return " ".join(
        [
            "{ .reg .f32 c, m, v, p, t, mh, vh, d, x;",
            f"sub.rn{z}.f32 c, 0f3F800000, $7;",  # 1 - beta1
            f"mul.rn{z}.f32 t, c, $3;",
            f"fma.rn{z}.f32 m, $7, $4, t;",  # beta1 * m + (1 - beta1) * g
            f"sub.rn{z}.f32 c, 0f3F800000, $8;",
            f"mul.rn{z}.f32 t, c, $3;",
            f"mul.rn{z}.f32 t, t, $3;",
            f"fma.rn{z}.f32 v, $8, $5, t;",  # beta2 * v + (1 - beta2) * g * g
            divide("mh", "m", "$9"),
            divide("vh", "v", "$10"),
            f"sqrt.{sqrt}{z}.f32 d, vh;",
            f"add.rn{z}.f32 d, d, $11;",  # sqrt(v_hat) + eps
            divide("x", "mh", "d"),
            f"fma.rn{z}.f32 x, $13, $6, x;",  # update = m_hat / denom + decay * p
            f"neg{z}.f32 t, $12;",
            f"fma.rn{z}.f32 p, t, x, $6;",  # p - lr * update
            "mov.f32 $0, m; mov.f32 $1, v; mov.f32 $2, p; }",
        ]
    )


if triton is not None:

    @triton.jit
    def _adam_remainder_kernel(
        g_ptr,
        p_ptr,
        m_ptr,
        v_ptr,
        r_ptr,
        scale_ptr,
        n,
        lr,
        beta1,
        beta2,
        bc1,
        bc2,
        eps,
        decay,
        HAS_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
        ASM: tl.constexpr,
    ):
        # the float arguments arrive as fp32, as TE's kernel takes them
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if HAS_SCALE:  # torch's _foreach_mul_: IEEE, denormals kept
            g = tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=f,f,f", [g, tl.load(scale_ptr)], tl.float32, True, 1
            )
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
        lo = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.int32)
        hi = hi - (lo < 0).to(tl.int32)  # undo the bf16 rounding
        master = ((hi << 16) | (lo & 0xFFFF)).to(tl.float32, bitcast=True)

        m, v, master = tl.inline_asm_elementwise(
            ASM,
            "=f,=f,=f,f,f,f,f,f,f,f,f,f,f,f",
            [g, m, v, master, beta1, beta2, bc1, bc2, eps, lr, decay],
            (tl.float32, tl.float32, tl.float32),
            True,
            1,
        )

        bits = master.to(tl.int32, bitcast=True)
        lo = bits & 0xFFFF
        hi = (bits >> 16) + (lo >= 0x8000).to(tl.int32)  # round the bf16 half to nearest
        tl.store(p_ptr + offs, hi.to(tl.int16), mask=mask)
        tl.store(r_ptr + offs, lo.to(tl.int16), mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


BLOCK = 2048
_TE_ASM = arithmetic(**TE_ARITHMETIC)


def _check(grad, param, exp_avg, exp_avg_sq, remainder) -> None:
    n = param.numel()
    parts = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "remainder": remainder}
    for name, t in parts.items():
        if t.numel() != n or not t.is_contiguous():
            raise ValueError(f"adam_kernel: {name} must be contiguous with the parameter's {n} elements")
    want = {"grad": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    want["remainder"] = torch.int16
    for name, dtype in want.items():
        if parts[name].dtype != dtype:
            raise ValueError(f"adam_kernel: {name} must be {dtype}, got {parts[name].dtype}")
    if param.dtype != torch.bfloat16 or not param.is_contiguous():
        raise ValueError("adam_kernel: the parameter must be a contiguous bf16 tensor")


def step_(
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    remainder: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: torch.Tensor | None = None,
    asm: str | None = None,
) -> None:
    """One AdamW step (TE's ADAM_MODE_1 with bias correction) in place on param, remainder and the
    moments; `grad_scale` (a one-element fp32 device tensor) multiplies the gradient first. `asm`
    (another `arithmetic()`) is for measuring which instructions TE's kernel runs."""
    _check(grad, param, exp_avg, exp_avg_sq, remainder)
    n = param.numel()
    if n == 0:
        return
    asm = asm or _TE_ASM
    scale = grad_scale if grad_scale is not None else grad  # any pointer when unused
    bc1, bc2 = bias_corrections(beta1, beta2, step)
    _adam_remainder_kernel[(triton.cdiv(n, BLOCK),)](
        grad,
        param.view(torch.int16),
        exp_avg,
        exp_avg_sq,
        remainder,
        scale,
        n,
        lr,
        beta1,
        beta2,
        bc1,
        bc2,
        eps,
        weight_decay,
        HAS_SCALE=grad_scale is not None,
        BLOCK=BLOCK,
        ASM=asm,
        num_warps=8,
    )


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 rounded to nearest as int16 bits, int16 remainder): TE's split."""
    bits = master.view(torch.int32)
    lo = bits & 0xFFFF
    hi = (bits >> 16) + (lo >= 0x8000).to(torch.int32)
    return _int16(hi), _int16(lo)


def join_master(param_bits: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(int16 bf16 bits, int16 remainder) -> fp32: TE's reconstruction."""
    hi = param_bits.to(torch.int32) - (remainder < 0).to(torch.int32)
    return ((hi << 16) | (remainder.to(torch.int32) & 0xFFFF)).view(torch.float32)


def _int16(x: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of an int32 tensor, as int16 (two's complement wrap)."""
    x = x & 0xFFFF
    return (x - ((x >= 0x8000).to(torch.int32) << 16)).to(torch.int16)
