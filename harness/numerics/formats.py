"""Element formats as pure functions: FP8 (E4M3, E5M2), E8M0, E2M1 (FP4) and symmetric INT4.

Every function takes and returns torch tensors and works on any device. Rounding rules are TE's
(docs/numerics.md section 0): saturating round-to-nearest-even casts, E8M0 rounding *up*, an E2M1 grid
with RNE on the code's parity. torch's own float->float8_e8m0fnu cast rounds differently and its
float->float8 casts saturate only in some versions (2.11 turns large E4M3 values into NaN; E5M2
overflows to Inf), so FP8 encoding clamps before casting.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from harness.numerics import triton_random

FLT_MAX = torch.finfo(torch.float32).max

# |x| as integers: the bit patterns of non-negative floats order like their values (NaN above Inf),
# and integer max-reductions over short inner blocks are several times faster than float ones.
# dtype -> (integer view, |x| mask, Inf's pattern)
ABS_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}


@dataclass(frozen=True)
class FP8Format:
    name: str
    dtype: torch.dtype
    max: float

    def __repr__(self) -> str:
        return self.name.upper()


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0)
FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def cast_fp8(v: torch.Tensor, fmt: FP8Format, *, inplace: bool = False) -> torch.Tensor:
    """fp32 -> FP8 with RNE and saturation to +-max (Inf too); NaN stays NaN (cvt.rn.satfinite).

    Whether torch's own cast saturates depends on its version: torch 2.11's E4M3 cast (c10's
    fp8e4m3fn_from_fp32_value, CPU and CUDA) turns |v| >= 464 into NaN (0x7F), 2.13's CPU cast
    saturates, E5M2 casts overflow to Inf. So v is clamped first unless a probe of this torch
    showed its cast saturates (the clamp costs a pass over v). `inplace=True` clamps v itself
    (callers passing their own temporary). The clamp keeps NaN and -0.0.
    """
    if not _cast_saturates(torch_cast, v.dtype, fmt, v.device.type):
        v = v.clamp_(-fmt.max, fmt.max) if inplace else v.clamp(-fmt.max, fmt.max)
    return torch_cast(v, fmt.dtype)


def torch_cast(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's RNE cast of in-range values; a seam so tests can mimic other torch versions."""
    return v.to(dtype)


@functools.lru_cache(maxsize=32)
def _cast_saturates(cast, src: torch.dtype, fmt: FP8Format, device_type: str) -> bool:
    """Whether `cast` maps everything above max (ties, Inf) to +-max and keeps NaN, on a tensor
    long enough for both the vectorised body and the scalar tail of torch's kernels."""
    m = fmt.max
    top = m * (1 + 2.0 ** -(4 if fmt is E4M3 else 3))  # the midpoint past max
    edge = [m * 1.0001, top * 0.9999, top, top * 1.0001, 2 * m, 1e30, float("inf")]
    x = torch.tensor(edge * 11, dtype=torch.float32)  # 77 values
    x = torch.cat([x, -x]).to(device=device_type, dtype=src)  # all still >= max in src (or Inf)
    y = cast(x, fmt.dtype).float()
    nan = cast(torch.full((3,), float("nan"), dtype=src, device=device_type), fmt.dtype).float()
    return bool(torch.equal(y, x.float().clamp(-m, m)) and nan.isnan().all())


def fp8_to_float(q: torch.Tensor, has_nan: bool = True) -> tuple[torch.Tensor, float]:
    """FP8 codes (a float8 tensor) -> (fp32 values / factor, factor); multiply by factor later.

    torch's E4M3->fp32 conversion is slow on CPU (about 5x a pointwise op). Without NaN codes an
    E4M3 byte shifted left by 7 is the fp16 bit pattern of value/256 (normals and subnormals
    alike) and fp16->fp32 is fast, so this returns value/256 with factor 256: callers fold the
    factor into their scale multiply (exact: a power of two). has_nan=False promises no NaN code.
    """
    if q.dtype != torch.float8_e4m3fn or has_nan or q.device.type != "cpu":
        return q.float(), 1.0
    bits = q.view(torch.int8).to(torch.int16)  # sign-extended: bit 14 gets a copy of the sign
    bits = (bits << 7).bitwise_and_(-16385)  # clear bit 14 (0xBFFF): sign at 15, exp/mantissa below
    return bits.view(torch.float16).float(), 256.0


# ----------------------------------------------------------------------------------------------
# E8M0 (MXFP8 block scales)


def e8m0_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 (>= 0) -> E8M0 byte, TE's `float_to_e8m0`: keep the exponent, +1 if any mantissa bit.

    NaN -> 0xFF, Inf -> 0xFE, 0 -> 0x00; exponent 0xFE stays (saturates at 2^127); subnormals
    up to 2^-127 (mantissa <= 0x400000) stay 0, larger ones round up to 1.
    """
    v = v.float()
    bits = v.view(torch.int32) & 0x7FFFFFFF  # |v|
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # exponent, rounded up
    e = e.clamp_(max=0xFE)  # 0xFE stays, Inf -> 0xFE (NaN is fixed below)
    e = torch.where(bits <= 0x400000, 0, e)  # 0 and subnormals up to 2^-127 -> 0
    e = torch.where(bits > 0x7F800000, 0xFF, e)  # NaN
    return e.to(torch.uint8)


def e8m0_decode(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> 2^(e-127) in fp32 (0 -> 2^-127, 255 -> NaN), the MX/cuBLAS reading."""
    return e.view(torch.float8_e8m0fnu).float()


def e8m0_quant_scale(e: torch.Tensor) -> torch.Tensor:
    """The factor the MXFP8 kernel multiplies elements by, TE's `ptx::exp2f_rcp(e)` (TE >= 2.13).

    2^(127-e) built from fp32 bits, `(254 - e) << 23`: e=0 gives 2^127, so a block whose amax is
    <= 448*2^-127 is scaled up and kept rather than flushed. Two bytes need more than the exponent
    field: e=254 (an Inf amax) gives the subnormal 2^-127 (0x00400000), which satfinite maps
    +-Inf to +-fp8max, and e=255 (NaN) gives NaN. Before TE commit 71971e33d (v2.13) e=0 gave
    1.0, 254 gave 0.0 and 255 -Inf.
    """
    e = e.to(torch.int32)
    bits = (254 - e) << 23
    bits = torch.where(e == 254, 0x00400000, bits)
    bits = torch.where(e == 255, 0x7FFFFFFF, bits)
    return bits.view(torch.float32)


# ----------------------------------------------------------------------------------------------
# E2M1 (FP4 elements)

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_round(
    v: torch.Tensor,
    generator: torch.Generator | None = None,
    stochastic: bool = False,
    has_nan: bool = True,
) -> torch.Tensor:
    """fp32 values (already scaled) -> values on the E2M1 grid, saturating at +-6, in fp32.

    Works in place on v (callers pass their own scaled copy). RNE: torch.round is half-to-even
    on v/step, and the parity of that multiple is the parity of the E2M1 code in every binade.
    Stochastic: floor(v/step + u), u ~ U[0, 1): away from zero with probability equal to the
    distance fraction (unbiased). NaN -> +6 (E2M1 has no NaN; satfinite gives max) (I).
    Signed zeros are kept (a tiny negative gives -0, code 8, as TE's kernel).
    """
    if has_nan:
        v.nan_to_num_(nan=E2M1_MAX)
    v.clamp_(-E2M1_MAX, E2M1_MAX)
    expo = (v.view(torch.int32) & 0x7F800000).clamp_(min=0x3F800000)  # exponent field, >= 2^0
    step = expo.sub_(1 << 23).view(torch.float32)  # 2^(e-1): 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
    r = v.div_(step)  # exact: step is a power of two
    if stochastic:
        r = add_uniform_(r, generator).floor_()
    else:
        r = r.round_()
    return r.mul_(step)


def add_uniform_(t: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """t += U[0, 1) in place, 16 random bits per element (the SR resolution of this emulator).

    On a CPU torch.rand costs several pointwise ops per element; 64-bit random words split into
    four 16-bit draws are ~3x cheaper. The bias of 16-bit SR is below 2^-16 of a grid step.
    """
    if t.device.type != "cpu":  # the fused NVFP4 kernel's own draws (harness.numerics.triton_random)
        return t.add_(triton_random.uniforms(t.shape, generator, t.device))
    n = t.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1, generator=generator)
    draws = words.view(torch.int16)[:n].view(t.shape).float()  # uniform integers in [-32768, 32767]
    return t.add_(draws, alpha=1.0 / 65536).add_(32768.5 / 65536)


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """Grid values (fp32) -> 4-bit codes in uint8 (sign in bit 3; -0.0 -> 8)."""
    lut = torch.tensor([0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 6, 7], dtype=torch.uint8, device=q.device)
    mag = lut[(q.abs() * 2).to(torch.int64)]  # 2|q| in {0,1,2,3,4,6,8,12}
    return mag | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> fp32 values."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return lut[codes.to(torch.int64)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) 4-bit codes -> (..., K/2) bytes, element 2i in the low nibble (TE's layout)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) bytes -> (..., K) 4-bit codes."""
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# INT4 (symmetric, -7..7; miles fake QAT)

INT4_MAX = 7


def int4_round(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> integers in [-7, 7] (round half to even, as torch.round); -8 unused."""
    return torch.round(v).clamp_(-INT4_MAX, INT4_MAX)
