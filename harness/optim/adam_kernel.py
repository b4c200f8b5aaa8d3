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
coefficient applied to the gradient on load (one fp32 multiply, as `_foreach_mul_` rounds it). The
operations and their order are TE's: nvcc (default -fmad=true, IEEE division and square root)
contracts `a*b + c*d` to fma(a, b, c*d) and `x - a*b` to fma(-a, b, x), so those are explicit
`tl.fma` here and Triton's own contraction is off (`enable_fp_fusion=False`). The GPU test holds the
parameters, remainders and moments bit-identical to TE's kernel over several steps.

`reference_step_` is the same arithmetic in PyTorch on any device (fma in float64, one rounding to
fp32 except in the rare double-rounding case), for the CPU tests.
"""

from __future__ import annotations

import torch

try:  # optional: only the CUDA path needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI's CPU machine)
    triton = None


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def hyperparameters(lr, beta1, beta2, eps, weight_decay, step, device) -> torch.Tensor:
    """[lr, beta1, beta2, bias correction 1 and 2, eps, weight decay] as the kernel reads them (fp32)."""
    bc1, bc2 = bias_corrections(beta1, beta2, step)
    values = [lr, beta1, beta2, bc1, bc2, eps, weight_decay]
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """TE's host code: 1 - std::pow(float beta, int step), evaluated in double, stored as float."""
    b1, b2 = (float(torch.tensor(b, dtype=torch.float32)) for b in (beta1, beta2))
    return 1.0 - b1**step, 1.0 - b2**step


CONTRACTIONS = {"m": 1, "v": 1, "update": 1, "param": 1}
"""Where nvcc fused TE's multiplies and adds: for the moments' `a*b + c*d`, 0 = two products and a
sum, 1 = fma(a, b, c*d), 2 = fma(c, d, a*b); for the update's `x + decay*p` and the parameter's
`p - lr*u`, 1 = one fma, 0 = a product and a sum."""


if triton is not None:

    @triton.jit
    def _tl_sum_of_products(a, b, c, d, FMA: tl.constexpr):
        if FMA == 1:
            return tl.fma(a, b, c * d)
        elif FMA == 2:
            return tl.fma(c, d, a * b)
        else:
            return a * b + c * d

    @triton.jit
    def _adam_remainder_kernel(
        g_ptr,
        p_ptr,
        m_ptr,
        v_ptr,
        r_ptr,
        scale_ptr,
        hp_ptr,
        n,
        HAS_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
        FMA_M: tl.constexpr,
        FMA_V: tl.constexpr,
        FMA_UPDATE: tl.constexpr,
        FMA_PARAM: tl.constexpr,
    ):
        # TE's float arguments, from a device tensor (hyperparameters()): fp32 here and in Triton's
        # interpreter, which would keep Python floats as doubles
        lr, beta1, beta2 = tl.load(hp_ptr), tl.load(hp_ptr + 1), tl.load(hp_ptr + 2)
        bc1, bc2, eps, decay = (
            tl.load(hp_ptr + 3),
            tl.load(hp_ptr + 4),
            tl.load(hp_ptr + 5),
            tl.load(hp_ptr + 6),
        )
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if HAS_SCALE:
            g = g * tl.load(scale_ptr)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
        lo = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.int32)
        hi = hi - (lo < 0).to(tl.int32)  # undo the bf16 rounding
        master = ((hi << 16) | (lo & 0xFFFF)).to(tl.float32, bitcast=True)

        m = _tl_sum_of_products(beta1, m, 1.0 - beta1, g, FMA_M)
        v = _tl_sum_of_products(beta2, v, (1.0 - beta2) * g, g, FMA_V)
        m_hat = tl.math.div_rn(m, bc1)
        v_hat = tl.math.div_rn(v, bc2)
        denom = tl.sqrt_rn(v_hat) + eps
        x = tl.math.div_rn(m_hat, denom)
        update = tl.fma(decay, master, x) if FMA_UPDATE else x + decay * master
        master = tl.fma(-lr, update, master) if FMA_PARAM else master - lr * update

        bits = master.to(tl.int32, bitcast=True)
        lo = bits & 0xFFFF
        hi = (bits >> 16) + (lo >= 0x8000).to(tl.int32)  # round the bf16 half to nearest
        tl.store(p_ptr + offs, hi.to(tl.int16), mask=mask)
        tl.store(r_ptr + offs, lo.to(tl.int16), mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


BLOCK = 2048


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
) -> None:
    """One AdamW step (TE's ADAM_MODE_1 with bias correction) in place on param, remainder and the
    moments; `grad_scale` (a one-element fp32 device tensor) multiplies the gradient first."""
    _check(grad, param, exp_avg, exp_avg_sq, remainder)
    n = param.numel()
    if n == 0:
        return
    scale = grad_scale if grad_scale is not None else grad  # any pointer when unused
    _adam_remainder_kernel[(triton.cdiv(n, BLOCK),)](
        grad,
        param.view(torch.int16),
        exp_avg,
        exp_avg_sq,
        remainder,
        scale,
        hyperparameters(lr, beta1, beta2, eps, weight_decay, step, param.device),
        n,
        HAS_SCALE=grad_scale is not None,
        BLOCK=BLOCK,
        FMA_M=CONTRACTIONS["m"],
        FMA_V=CONTRACTIONS["v"],
        FMA_UPDATE=CONTRACTIONS["update"],
        FMA_PARAM=CONTRACTIONS["param"],
        num_warps=8,
        enable_fp_fusion=False,
    )


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _fma(a, b, c) -> torch.Tensor:
    """fp32 fma: the float64 product of two fp32 values is exact; one rounding of the sum to fp32
    (after a float64 rounding, which differs from a single rounding only on rare ties)."""
    return _f32(a.double() * b.double() + c.double())


def _sum_of_products(a, b, c, d, fma: int) -> torch.Tensor:
    if fma == 1:
        return _fma(a, b, c * d)
    if fma == 2:
        return _fma(c, d, a * b)
    return a * b + c * d


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


@torch.no_grad()
def reference_step_(grad, param, exp_avg, exp_avg_sq, remainder, *, lr, beta1, beta2, eps, weight_decay,
                    step, grad_scale=None) -> None:  # fmt: skip
    """`step_`'s arithmetic in PyTorch, on any device."""
    f = lambda x: torch.tensor(x, dtype=torch.float32, device=param.device)  # noqa: E731
    bc1, bc2 = bias_corrections(beta1, beta2, step)
    b1, b2, lr_, eps_, wd = f(beta1), f(beta2), f(lr), f(eps), f(weight_decay)
    g = _f32(grad) if grad_scale is None else _f32(grad) * grad_scale.to(torch.float32)
    master = join_master(param.view(torch.int16), remainder)
    m = _sum_of_products(b1, exp_avg, 1 - b1, g, CONTRACTIONS["m"])
    v = _sum_of_products(b2, exp_avg_sq, (1 - b2) * g, g, CONTRACTIONS["v"])
    x = (m / f(bc1)) / (torch.sqrt(v / f(bc2)) + eps_)
    update = _fma(wd, master, x) if CONTRACTIONS["update"] else x + wd * master
    master = _fma(-lr_, update, master) if CONTRACTIONS["param"] else master - lr_ * update
    hi, lo = split_master(master.contiguous())
    param.view(torch.int16).copy_(hi)
    remainder.copy_(lo)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
