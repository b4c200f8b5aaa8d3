"""Scale arithmetic shared by the FP8 quantizers: amax, scale from amax, role -> format.

Division trap (docs/numerics.md section 0): torch 2.13 CPU computes `python_scalar / tensor` as a
reciprocal times the scalar, not correctly rounded; TE divides in IEEE fp32. Every division here
is tensor / tensor.
"""

from __future__ import annotations

import functools

import torch

from harness.numerics import fast, triton_amax
from harness.numerics.formats import ABS_BITS, E4M3, E5M2, FLT_MAX, FP8Format

ROLES = ("input", "weight", "grad")


def fp8_format_for(fp8: str | None, role: str) -> FP8Format:
    """TE's get_fp8_te_dtype: E4M3 everywhere, or HYBRID = E4M3 forward and E5M2 gradients."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: use one of {ROLES}")
    if fp8 == "e4m3":
        return E4M3
    if fp8 == "hybrid":
        return E5M2 if role == "grad" else E4M3
    raise ValueError(f"fp8={fp8!r}: use e4m3 or hybrid (TE rejects pure E5M2)")


def const(value: float, like: torch.Tensor) -> torch.Tensor:
    """An fp32 scalar tensor on like's device (so arithmetic is tensor-tensor, IEEE fp32).

    Cached: quantizers use a handful of constants thousands of times per step; never mutate it.
    """
    return _const(float(value), like.device)


@functools.lru_cache(maxsize=256)
def _const(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def amax(x: torch.Tensor, dim=None) -> tuple[torch.Tensor, bool]:
    """max|x| as fp32, NaN ignored (TE's fmaxf from 0), and whether x held a NaN.

    Exact in x's own dtype. Reduces over `dim` (all dims if None). On CUDA: no host sync (see
    `amax_nosync`); has_nan is then True ("may hold a NaN"), which every consumer treats exactly as
    it treats a tensor without NaN: the NaN-safe branches are no-ops on NaN-free values.
    """
    spec = ABS_BITS.get(x.dtype)
    if x.is_cuda and spec is not None:
        return amax_nosync(x, dim), True
    if dim is None or spec is None:
        return _amax_float(x, dim)
    itype, mask, inf = spec
    bits = x.view(itype) & mask  # |x| bit patterns
    m = bits.amax(dim=dim)
    has_nan = bool((m > inf).any())
    if has_nan:  # rare: drop NaNs so they are ignored like fmaxf does
        m = bits.masked_fill_(bits > inf, 0).amax(dim=dim)
    return m.view(x.dtype).float(), has_nan


def amax_nosync(x: torch.Tensor, dim=None, fused: bool = True) -> torch.Tensor:
    """`amax`'s value without the host sync its NaN check costs: NaN bit patterns (above Inf's)
    are zeroed before the max-reduction unconditionally, one compiled reduction over x (integer
    max: exact in any order). A sync per quantized tensor drains the launch queue on a GPU."""
    if fused and x.is_cuda and triton_amax.handles(x, dim):  # block amaxes: one Triton pass
        return _block_amax_or_compiled(x, dim)
    if fused and x.is_cuda and dim is None and triton_amax.handles_tensor(x):
        return _tensor_amax_or_compiled(x, dim)
    return _compiled_amax(x, dim, fused)


def _compiled_amax(x: torch.Tensor, dim, fused: bool = True) -> torch.Tensor:
    fn = _amax_bits(x.dtype, dim)
    return (fast.compiled(fn, x.device.type, True) if fused else fn)(x)


def _triton_block_amax(x: torch.Tensor, dim) -> torch.Tensor:
    return triton_amax.block_amax(x).float()


_block_amax_or_compiled = fast.first_working(_triton_block_amax, _compiled_amax)


def _triton_tensor_amax(x: torch.Tensor, dim) -> torch.Tensor:
    return triton_amax.tensor_amax(x).float()


_tensor_amax_or_compiled = fast.first_working(_triton_tensor_amax, _compiled_amax)


@functools.cache
def _amax_bits(dtype: torch.dtype, dim):
    itype, mask, inf = ABS_BITS[dtype]

    def amax_bits(x):
        bits = x.view(itype) & mask  # |x| bit patterns
        bits = torch.where(bits > inf, torch.zeros_like(bits), bits)  # NaN -> 0, ignored like fmaxf
        m = bits.amax() if dim is None else bits.amax(dim=dim)
        return m.view(dtype).float()

    return amax_bits


def _amax_float(x: torch.Tensor, dim=None) -> tuple[torch.Tensor, bool]:
    if dim is None:  # one pass, no |x| temporary
        lo, hi = torch.aminmax(x)
        m = torch.maximum(-lo, hi)
    else:
        m = x.abs().amax(dim=dim)
    has_nan = bool(torch.isnan(m).any())
    if has_nan:
        a = torch.nan_to_num(x.abs(), nan=0.0, posinf=float("inf"))
        m = a.amax() if dim is None else a.amax(dim=dim)
    return m.float(), has_nan


def scale_from_amax(
    amax_: torch.Tensor,
    fp8max: float,
    *,
    power_2: bool = False,
    epsilon: float = 0.0,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """TE's compute_scale_from_amax (recipe_common.cuh), elementwise over a tensor of amaxes.

    a = max(amax, eps); a in {0, Inf, NaN} -> 1; else fp8max / a (IEEE); Inf -> value_for_inf;
    power_2 clears the 23 mantissa bits (rounds down to a power of two).
    """
    a = amax_.float()
    if epsilon > 0:
        a = torch.where(a < epsilon, const(epsilon, a), a)
    scale = torch.div(const(fp8max, a), a)
    scale = torch.where(torch.isinf(scale), const(value_for_inf, a), scale)
    bad = torch.isinf(a) | (a == 0) | torch.isnan(a)
    scale = torch.where(bad, const(1.0, a), scale)
    if power_2:
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)  # 0xFF800000
    return scale


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """scale_inv = 1 / scale in IEEE fp32 (TE's __frcp_rn)."""
    return torch.div(torch.ones_like(scale), scale)


def dtype_max(dtype: torch.dtype) -> float:
    """Largest finite value of the *input* dtype (blockwise scaling's fallback for Inf scales)."""
    return float(torch.finfo(dtype).max) if dtype.is_floating_point else FLT_MAX


__all__ = ["ROLES", "E4M3", "E5M2", "amax", "fp8_format_for", "reciprocal", "scale_from_amax"]
