"""The FP8 quantizers against an independent float64 reference, on random shapes, inputs and scales.

The golden cases fix one shape and scales <= fp8max/amax, so products never pass 448. Here:
2-D and 3-D shapes that are not block multiples, the golden README's four input kinds, bf16 and
fp32 inputs, delayed scales with margins and factors up to 4x fp8max/amax (saturation), and every
per-tensor and block path. The reference works on the E4M3/E5M2 grids in float64: the fp32 product
is the exact float64 product rounded once to fp32, then round-to-nearest-even with saturation.

Each case also runs with torch's cast replaced by torch 2.11's (E4M3 |v| >= 464 -> NaN), which an
H200 host's CPU and CUDA casts use: the emulator must clamp before casting, not rely on torch.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import harness.numerics.formats as formats
from harness.numerics import quantize
from harness.numerics.api import resolve_recipe
from harness.numerics.formats import E4M3, E5M2, cast_fp8
from tests.numerics.references.inputs import KINDS, make_input

F64 = torch.float64
FLT_MAX = float(torch.finfo(torch.float32).max)


# ------------------------------------------------------------------------------------------
# the reference (float64, no lowp code)


def fl32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 values to fp32 (RNE, overflow to Inf), kept in float64."""
    return t.float().double()


def grid(fmt) -> torch.Tensor:
    """Non-negative finite values of the format by code, from the bit layout."""
    mbits, bias, n = (3, 7, 127) if fmt is E4M3 else (2, 15, 124)
    c = torch.arange(n, dtype=F64)
    e, m = torch.div(c, 2**mbits, rounding_mode="floor"), c % 2**mbits
    return torch.where(e == 0, m * 2.0 ** (1 - bias - mbits), (2**mbits + m) * 2.0 ** (e - bias - mbits))


def ref_codes(p: torch.Tensor, fmt) -> torch.Tensor:
    """float64 values (fp32-representable) -> FP8 bytes: RNE, saturating at +-max (no NaN here).

    In the binade of |p| (subnormals: the lowest), the quantum is 2^(E - mantissa bits); the
    rounded multiple r of it gives the code (E - emin) * 2^mbits + r, carries included.
    """
    mbits, emin = (3, -6) if fmt is E4M3 else (2, -14)
    a = p.abs().clamp(max=fmt.max)
    e = ((a.view(torch.int64) >> 52) - 1023).clamp(min=emin)  # a in [2^e, 2^(e+1)); 0 -> emin
    quantum = ((e + 1023 - mbits) << 52).view(F64)  # 2^(e - mbits)
    r = (a / quantum).round()  # exact division by a power of two; round = half-to-even
    code = ((e - emin) * 2**mbits + r.long()).to(torch.uint8)
    return torch.where(torch.signbit(p), code | 0x80, code)


def decode(codes: torch.Tensor, fmt) -> torch.Tensor:
    vals = grid(fmt)
    mag = vals[(codes & 0x7F).long()]
    return torch.where(codes >= 0x80, -mag, mag)


def ref_scale(amax, fmax, *, pow2=False, eps=0.0, inf_value=FLT_MAX):
    """TE's compute_scale_from_amax: fl32(fmax / max(amax, eps)), 1 for 0/Inf/NaN, pow2 rounds down."""
    a = torch.clamp(amax, min=fl32(torch.tensor(eps, dtype=F64)).item()) if eps > 0 else amax
    s = fl32(fmax / a)
    s = torch.where(torch.isinf(s), torch.full_like(s, inf_value), s)
    s = torch.where((a == 0) | torch.isinf(a) | torch.isnan(a), torch.ones_like(s), s)
    if pow2:
        s = torch.ldexp(torch.full_like(s, 0.5), torch.frexp(s).exponent)
    return s


def ref_e8m0(amax, fmax):
    """E8M0 of fl32(amax * fl32(1/fmax)) rounded up, and the element multiplier 2^(127-e)."""
    v = fl32(amax * fl32(torch.tensor(1.0 / fmax, dtype=F64)))
    mant, ex = torch.frexp(v)  # v = mant * 2^ex, mant in [0.5, 1)
    e = torch.where(mant == 0.5, ex + 126, ex + 127).clamp(0, 254)
    e = torch.where(v == 0, 0, e)
    return e.to(torch.uint8), torch.where(e == 0, 1.0, torch.ldexp(torch.ones_like(v), 127 - e))


def ref_blocks(x2, br, bc, scale_of_amax):
    """Codes (M, K), scales (M/br, K/bc) and block amax of x2 quantized in br x bc blocks (float64)."""
    m, k = x2.shape
    xp = torch.nn.functional.pad(x2, (0, (-k) % bc, 0, (-m) % br))
    blocks = xp.view(xp.shape[0] // br, br, xp.shape[1] // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = scale_of_amax(amax)
    prod = fl32(blocks * scale[:, None, :, None]).view(xp.shape)[:m, :k]
    return prod, scale


# ------------------------------------------------------------------------------------------
# random cases


def random_shape(gen: torch.Generator) -> tuple[int, ...]:
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    if r(0, 1):
        return (r(1, 3), r(1, 70), r(1, 260))
    return (r(1, 200), r(1, 260))


def random_delayed_scales(x2: torch.Tensor, fmt, gen: torch.Generator) -> list[torch.Tensor]:
    """fp8max * 2^-margin / amax (margin 0..2) times a factor: one in [0.5, 1.5), a power of two
    in 2^-3..2^3, one in [1.5, 6) (saturating), as amax histories give and stale ones overshoot."""
    amax = max(float(x2.double().abs().max()), 1e-30)
    out = []
    for pick in range(3):
        margin = int(torch.randint(0, 3, (1,), generator=gen))
        u = float(torch.rand(1, generator=gen))
        factor = [0.5 + u, 2.0 ** round(6 * u - 3), 1.5 + 4.5 * u][pick]
        factor *= 2.0**margin if pick == 2 else 1.0  # still saturating after the margin
        out.append(torch.tensor([fmt.max * 2.0**-margin / amax * factor], dtype=torch.float32))
    return out


def old_torch_cast(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch 2.11's float -> float8_e4m3fn: |v| >= 464 becomes NaN (no saturation)."""
    if dtype == torch.float8_e4m3fn:
        v = torch.where(v.abs() >= 464, float("nan"), v)
    return v.to(dtype)


@pytest.fixture
def use_cast(monkeypatch):
    def use(cast: str) -> None:
        if cast == "torch2.11":
            monkeypatch.setattr(formats, "torch_cast", old_torch_cast)

    return use


# config: (recipe, role, quantize() fields)
CONFIGS = {
    "delayed_e4m3": ("delayed", "input", {}),
    "delayed_e5m2": ("delayed", "grad", {}),
    "current_e4m3": ("tensorwise", "input", {}),
    "current_e5m2": ("tensorwise", "grad", {}),
    "current_e4m3_pow2": ("tensorwise", "input", {"power_2_scales": True}),
    "current_e4m3_eps": ("tensorwise", "input", {"amax_epsilon": 1e-3}),
    "block1d_e4m3": ("blockwise", "input", {}),
    "block1d_e4m3_fp32scale": ("blockwise", "input", {"power_2_scales": False}),
    "block1d_e5m2": ("blockwise", "grad", {"fp8": "hybrid"}),
    "block2d_e4m3": ("blockwise", "weight", {}),
    "block2d_e4m3_fp32scale": ("blockwise", "weight", {"power_2_scales": False}),
    "mxfp8_e4m3": ("mxfp8", "input", {}),
    "mxfp8_e5m2": ("mxfp8", "grad", {"fp8": "hybrid"}),
}


@functools.cache
def recipe_config(name: str):
    recipe, _, fields = CONFIGS[name]
    return resolve_recipe(recipe, **fields)


def reference(name, recipe, role, fields, x2, scale, columnwise):
    """(fp32 products, fmt, per-block scale, (br, bc)) for one copy, in x2's orientation."""
    fmt = E5M2 if role == "grad" else E4M3
    if recipe == "delayed":
        fixed = scale.double().reshape(1, 1)
        prod, s = ref_blocks(x2, x2.shape[0], x2.shape[1], lambda a: fixed)
        return prod, fmt, s, None
    if recipe == "tensorwise":
        f = lambda a: ref_scale(
            a,
            fmt.max,
            pow2=fields.get("power_2_scales", False),  # noqa: E731
            eps=fields.get("amax_epsilon", 0.0),
        )
        prod, s = ref_blocks(x2, x2.shape[0], x2.shape[1], f)
        return prod, fmt, s, None
    if recipe == "blockwise":
        block = (128, 128) if role == "weight" else ((128, 1) if columnwise else (1, 128))
        f = lambda a: ref_scale(a, fmt.max, pow2=fields.get("power_2_scales", True))  # noqa: E731
        prod, s = ref_blocks(x2, *block, f)
        return prod, fmt, s, block
    block = (32, 1) if columnwise else (1, 32)
    prod, e8m0 = ref_blocks(x2, *block, lambda a: ref_e8m0(a, fmt.max)[1])
    return prod, fmt, e8m0, block


def check_copy(name, x, scale, columnwise):
    recipe, role, fields = CONFIGS[name]
    q = quantize(x, recipe_config(name), role=role, columnwise=columnwise, scale=scale)
    x2 = x.double().reshape(-1, x.shape[-1])
    m, k = x2.shape
    prod, fmt, s, block = reference(name, recipe, role, fields, x2, scale, columnwise)
    codes = ref_codes(prod, fmt)  # (M, K)
    where = f"{name} {tuple(x.shape)} {x.dtype} columnwise={columnwise}"
    transposed = recipe != "mxfp8" and columnwise
    want = codes.t().reshape(k, *x.shape[:-1]) if transposed else codes.reshape(x.shape)
    bad = int((q.data.view(torch.uint8) != want).sum())
    assert bad == 0, f"{where}: {bad} codes differ"
    # scale_inv in TE's layout (valid region only)
    if recipe == "mxfp8":
        mb, kb = math.ceil(m / block[0]), math.ceil(k / block[1])
        e = ref_e8m0_grid(x2, block, fmt)
        assert torch.equal(q.scale_inv[:mb, :kb], e), where
        full = torch.ldexp(torch.ones_like(e, dtype=F64), e.long() - 127)
        full = full.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:m, :k]
        deq = fl32(decode(codes, fmt) * full).reshape(x.shape)
        assert torch.equal(q.dequantize().double(), deq), where
        return
    sinv = fl32(1.0 / s)  # (Mb, Kb) in x's orientation
    if block is None:
        assert torch.equal(q.scale_inv.double().reshape(()), sinv.reshape(())), where
    elif block == (128, 128):
        got = q.scale_inv[: sinv.shape[1], : sinv.shape[0]].t() if columnwise else q.scale_inv
        assert torch.equal(got[: sinv.shape[0], : sinv.shape[1]].double(), sinv), where
    elif columnwise:  # 128x1 blocks: (M/128, K)
        assert torch.equal(q.scale_inv[:, :k].double(), sinv), where
    else:  # 1x128 blocks: (K/128, M)
        assert torch.equal(q.scale_inv[:, :m].double(), sinv.t()), where
    # dequantization: codes times the block's scale_inv, one fp32 product
    br, bc = block or (m, k)
    full = sinv.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:m, :k]
    deq = fl32(decode(codes, fmt) * full).reshape(x.shape)
    assert torch.equal(q.dequantize().double(), deq), where


def ref_e8m0_grid(x2, block, fmt):
    m, k = x2.shape
    br, bc = block
    xp = torch.nn.functional.pad(x2, (0, (-k) % bc, 0, (-m) % br))
    amax = xp.view(xp.shape[0] // br, br, xp.shape[1] // bc, bc).abs().amax(dim=(1, 3))
    return ref_e8m0(amax, fmt.max)[0]


CASES = [  # torch 2.11's cast differs from torch's own only for E4M3
    (name, kind, cast)
    for cast in ("torch", "torch2.11")
    for name in CONFIGS
    for kind in KINDS
    if cast == "torch" or CONFIGS[name][1] != "grad"
]


@pytest.mark.parametrize(("name", "kind", "cast"), CASES)
def test_random_cases_match_reference(name, kind, cast, use_cast):
    use_cast(cast)
    seed = list(CONFIGS).index(name) * 100 + KINDS.index(kind)
    gen = torch.Generator().manual_seed(seed)
    for i in range(2):
        shape = random_shape(gen)
        x = make_input(kind, shape, gen, torch.bfloat16 if i == 0 else torch.float32)
        scales = [None]
        if CONFIGS[name][0] == "delayed":
            fmt = E5M2 if CONFIGS[name][1] == "grad" else E4M3
            scales = random_delayed_scales(x.reshape(-1, shape[-1]), fmt, gen)
        for scale in scales:
            for columnwise in (False, True):
                check_copy(name, x, scale, columnwise)


@pytest.mark.parametrize("cast", ["torch", "torch2.11"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_cast_saturates_whatever_torch_does(fmt, cast, use_cast):
    """Just above max (rounding back to max), the tie past max, far above, and Inf all give +-max."""
    use_cast(cast)
    m = fmt.max
    top = 464.0 if fmt is E4M3 else 61440.0  # the midpoint between max and the next binade step
    x = torch.tensor([m, m * 1.0001, top * 0.9999, top, top * 1.0001, 2 * m, 1e30, float("inf")])
    x = torch.cat([x, -x])
    want = torch.cat([torch.full((8,), m), torch.full((8,), -m)])
    assert torch.equal(cast_fp8(x, fmt).float(), want)
    assert torch.isnan(cast_fp8(torch.tensor([float("nan")]), fmt).float()).all()


def test_reference_grid_and_ties():
    """The reference itself: every code decodes back to itself; ties go to the even code."""
    for fmt in (E4M3, E5M2):
        vals = grid(fmt)
        assert vals[-1] == fmt.max
        assert torch.equal(ref_codes(vals, fmt), torch.arange(len(vals)).to(torch.uint8))
        torch_vals = torch.arange(len(vals), dtype=torch.uint8).view(fmt.dtype).double()
        assert torch.equal(vals, torch_vals)
    ties = torch.tensor([2**-10, 1.5 * 2**-9, 2.5 * 2**-9, 17.0, 19.0, 464.0], dtype=F64)
    assert decode(ref_codes(ties, E4M3), E4M3).tolist() == [0.0, 2**-8, 2**-8, 16.0, 20.0, 448.0]


def test_saturation_probe():
    """The probe that lets cast_fp8 skip its clamp sees through a non-saturating cast."""
    for fmt in (E4M3, E5M2):
        for src in (torch.float32, torch.bfloat16):
            assert not formats._cast_saturates(old_torch_cast, src, fmt, "cpu")
            big = torch.tensor([fmt.max * 1.1, 1e30, float("inf")], dtype=src).repeat(40)
            native = bool((big.to(fmt.dtype).float() == fmt.max).all())
            assert formats._cast_saturates(formats.torch_cast, src, fmt, "cpu") == native
