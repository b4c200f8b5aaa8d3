"""Blockwise FP8, MXFP8 and NVFP4 quantization in one Triton pass per copy on CUDA: block amax,
scale, cast and the GEMM operand together.

The reference (harness.numerics.blockwise / mxfp8 / nvfp4) runs each stage as its own tensor
operation: a block-amax reduction, a dozen small scale ops (E8M0 encode and decode, the NVFP4 global
and block scales), the cast, the dequantized copy. At the 1.4B shape that is ~20 launches per quantized
tensor, 576 tensors a step for MXFP8, and the GPU sat idle for a third of the step waiting for
them. Each kernel here reads a tile of x once and writes the codes, the block scales and the
dequantized bf16 operand, with the reference's operations in the reference's order:

- amax: integer max over the |x| bit patterns, NaN patterns zeroed (exact in any order).
- Blockwise (power-of-two scales): scale = fp8max / amax (IEEE division), Inf -> the input dtype's
  max, amax 0 or Inf -> 1, mantissa cleared (`scaling.scale_from_amax`); scale_inv = 1 / scale.
- MXFP8: e = E8M0(amax * fl32(1/fp8max)) rounded up (`formats.e8m0_encode`), elements
  fp32(x) * 2^(127-e) (`formats.e8m0_quant_scale`), saturated, rounded to nearest even.
- NVFP4: S_enc = fl32(2688 / amax_g) (IEEE division), sf = E4M3(amax_b * fl32(S_enc * fl32(1/6))),
  k = min(fl32(1 / fl32(sf * S_dec)), FLT_MAX), elements fp32(x * k) on the E2M1 grid, to nearest
  even or stochastically: floor(v / step + u) with u = Philox's tl.rand(seed, element index), the
  uniforms the reference's CUDA path materializes (harness.numerics.triton_random).
- NVFP4's RHT (`rht`): each 16-token chunk times diag(s) H16 / 4, summed in fp32 in k order,
  rounded to bf16, with the transform's amax from the same pass.
- FP8 rounding is done in fp32 on the format's grid (spacing 2^(max(e, emin) - mantissa bits),
  half to even), then converted, exact: the hardware's cvt.rn.satfinite would give the same
  codes, and Triton's CPU interpreter (whose fp8 conversion does not round half to even) checks
  the same arithmetic the GPU runs. bf16 results are rounded on the bits (c10's rounding), and
  nothing flushes subnormals. FMA contraction is off (a product feeding a sum stays two roundings,
  as in the reference).

tests/numerics/test_triton_cast.py runs every kernel in Triton's interpreter against the reference
quantizers at atol=0; tests/numerics/test_fast_path_gpu.py compares the compiled kernels on CUDA
with the CPU reference.
"""

from __future__ import annotations

import functools

import torch

from harness.numerics import triton_amax
from harness.numerics.formats import ABS_BITS, FLT_MAX, FP8Format

try:  # optional: only the CUDA fast path needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent (CI's CPU machine)
    triton = None

ROWS, COLS = 64, 128  # input elements a program reads: about this many rows and columns
GLOBAL_MAX = 448.0 * 6.0
_FP8 = {  # format dtype -> (mantissa bits, min normal exponent)
    torch.float8_e4m3fn: (3, -6),
    torch.float8_e5m2: (2, -14),
}


def available() -> bool:
    return triton is not None


def _fl32(v: float) -> float:
    """The fp32 value nearest v (the reference's `const(v)`), as a Python float."""
    return float(torch.tensor(v, dtype=torch.float32))


if triton is not None:

    @triton.jit
    def _bits_f32(v):
        return v.to(tl.int32, bitcast=True)

    @triton.jit
    def _rne_on_grid(v, MANT: tl.constexpr, EMIN: tl.constexpr):
        """v (fp32, finite or NaN) rounded half to even onto the grid of a float format with MANT
        mantissa bits and minimum normal exponent EMIN (its subnormals included); NaN stays NaN.
        The grid spacing at |v| is a power of two, so v / step (v times its exact inverse) is
        exact; |v / step| < 2^(MANT+1), where adding and subtracting 2^23 rounds to an integer,
        half to even."""
        bits = _bits_f32(v)
        expo = tl.maximum(bits & 0x7F800000, (EMIN + 127) << 23)
        step = (expo - (MANT << 23)).to(tl.float32, bitcast=True)
        r = v * _inverse_pow2(step)
        a = tl.abs(r)
        t = _with_sign_of(r, (a + 8388608.0) - 8388608.0)
        return tl.where(v != v, v, t * step)

    @triton.jit
    def _inverse_pow2(p):
        """1 / p for a normal power of two p, exact: the exponent field mirrored about 127."""
        return ((254 << 23) - _bits_f32(p)).to(tl.float32, bitcast=True)

    @triton.jit
    def _floor(y):
        """floor(y) for |y| < 2^22 without flushing subnormals (Triton's floor is cvt.rmi.ftz:
        floor(-2^-140) would give -0.0, not -1): the nearest integer, one less where above y."""
        t = _with_sign_of(y, (tl.abs(y) + 8388608.0) - 8388608.0)
        return tl.where(t > y, t - 1.0, t)

    @triton.jit
    def _with_sign_of(r, t):
        """|t| with r's sign bit (-0.0 included: Triton's -t is 0 - t, which gives +0.0)."""
        sign = _bits_f32(r) & -2147483648  # 0x80000000
        return (_bits_f32(t) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_bits(q, CODE: tl.constexpr):
        """The FP8 byte of q (fp32, on CODE's grid or NaN): |q| converted (exact), q's sign bit set
        as c10's conversion sets it (-0.0 and negative NaNs included)."""
        mag = tl.abs(q).to(CODE).to(tl.uint8, bitcast=True)
        mag = tl.where(q != q, 0x7F, mag)  # NaN: c10's 0x7F (E4M3) / 0x7F (E5M2), then the sign
        return mag | ((_bits_f32(q) >> 24) & 0x80).to(tl.uint8)

    @triton.jit
    def _f32(x):
        """x in fp32, exactly: a bf16 value's bits shifted into fp32's (the interpreter's own
        conversion mishandles bf16 subnormals; on the GPU both are the same exact widening)."""
        if x.dtype == tl.bfloat16:
            return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return x.to(tl.float32)

    @triton.jit
    def _bf16(v):
        """fp32 -> bf16 rounded to nearest even on the bits (c10's rounding, subnormals and its
        NaN 0x7FC0 included; the interpreter's own conversion rounds subnormals otherwise)."""
        b = v.to(tl.uint32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16)
        r = tl.where(v != v, 0x7FC0, r).to(tl.uint16)
        return r.to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _tile(x_ptr, M, K, BR: tl.constexpr, BC: tl.constexpr, OM: tl.constexpr, OK: tl.constexpr):
        """This program's tile of x (zeros past M, K: the reference's zero padding) and its offsets."""
        rows = tl.program_id(0) * OM * BR + tl.arange(0, OM * BR)
        cols = tl.program_id(1) * OK * BC + tl.arange(0, OK * BC)
        inside = (rows < M)[:, None] & (cols < K)[None, :]
        offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        return x, rows, cols, inside

    @triton.jit
    def _block_amax(x, IBITS: tl.constexpr, MASK: tl.constexpr, INF: tl.constexpr, BR, BC, OM, OK):
        """(OM, OK) fp32 amaxes of the tile's blocks, NaN ignored."""
        bits = triton_amax.abs_bits(x.to(IBITS, bitcast=True), MASK, INF)
        m = tl.max(tl.max(tl.reshape(bits, [OM, BR, OK, BC]), axis=3), axis=1)
        return _f32(m.to(IBITS).to(x.dtype, bitcast=True))

    @triton.jit
    def _per_block(v, s, BR: tl.constexpr, BC: tl.constexpr, OM: tl.constexpr, OK: tl.constexpr):
        """Each element of the tile v times its block's entry of s (OM, OK)."""
        blk = tl.reshape(v, [OM, BR, OK, BC]) * s[:, None, :, None]
        return tl.reshape(blk, [OM * BR, OK * BC])

    @triton.jit
    def _store_blocks(
        ptr, vals, Mp, Kp, BR: tl.constexpr, BC: tl.constexpr, OM: tl.constexpr, OK: tl.constexpr
    ):
        orow = tl.program_id(0) * OM + tl.arange(0, OM)
        ocol = tl.program_id(1) * OK + tl.arange(0, OK)
        om = (orow < Mp // BR)[:, None] & (ocol < Kp // BC)[None, :]
        tl.store(ptr + orow.to(tl.int64)[:, None] * (Kp // BC) + ocol[None, :], vals, mask=om)

    @triton.jit
    def _store_tiles(codes_ptr, codes, deq_ptr, deq, rows, cols, inside, M, K, Mp, Kp):
        """Codes into the padded (Mp, Kp) array, the GEMM operand into the unpadded (M, K) one."""
        padded = (rows < Mp)[:, None] & (cols < Kp)[None, :]
        tl.store(codes_ptr + rows.to(tl.int64)[:, None] * Kp + cols[None, :], codes, mask=padded)
        tl.store(deq_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], deq, mask=inside)

    @triton.jit
    def _mxfp8(
        x_ptr, codes_ptr, e8m0_ptr, dec_ptr, deq_ptr, M, K, Mp, Kp, inv_max,
        IBITS: tl.constexpr, MASK: tl.constexpr, INF: tl.constexpr,
        FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, CODE: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr, OM: tl.constexpr, OK: tl.constexpr,
    ):  # fmt: skip
        x, rows, cols, inside = _tile(x_ptr, M, K, BR, BC, OM, OK)
        amax = _block_amax(x, IBITS, MASK, INF, BR, BC, OM, OK)
        # E8M0 of amax * fl32(1/fp8max), rounded up (formats.e8m0_encode)
        b = _bits_f32(amax * inv_max) & 0x7FFFFFFF
        e = (b >> 23) + ((b & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.minimum(e, 0xFE)
        e = tl.where(b <= 0x400000, 0, e)
        e = tl.where(b > 0x7F800000, 0xFF, e)
        # the elements' factor 2^(127-e) (formats.e8m0_quant_scale) and the decode 2^(e-127)
        qs = tl.where(e == 254, 0x00400000, (254 - e) << 23)
        qs = tl.where(e == 255, 0x7FFFFFFF, qs).to(tl.float32, bitcast=True)
        dec = tl.where(e == 0, 0x00400000, e << 23)
        dec = tl.where(e == 255, 0x7FC00000, dec).to(tl.float32, bitcast=True)
        v = _per_block(_f32(x), qs, BR, BC, OM, OK)
        v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -FMAX), FMAX))  # satfinite, NaN kept
        q = _rne_on_grid(v, MANT, EMIN)
        deq = _bf16(_per_block(q, dec, BR, BC, OM, OK))
        _store_tiles(codes_ptr, _fp8_bits(q, CODE), deq_ptr, deq, rows, cols, inside, M, K, Mp, Kp)
        _store_blocks(e8m0_ptr, e.to(tl.uint8), Mp, Kp, BR, BC, OM, OK)
        _store_blocks(dec_ptr, dec, Mp, Kp, BR, BC, OM, OK)

    @triton.jit
    def _blockwise(
        x_ptr, codes_ptr, scale_ptr, dec_ptr, amax_ptr, deq_ptr, M, K, Mp, Kp, eps, inf_value,
        IBITS: tl.constexpr, MASK: tl.constexpr, INF: tl.constexpr,
        FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, CODE: tl.constexpr,
        HAS_EPS: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr, OM: tl.constexpr, OK: tl.constexpr,
    ):  # fmt: skip
        x, rows, cols, inside = _tile(x_ptr, M, K, BR, BC, OM, OK)
        amax = _block_amax(x, IBITS, MASK, INF, BR, BC, OM, OK)
        # scaling.scale_from_amax with power_2: fp8max / amax (IEEE), Inf -> the input dtype's
        # max, amax in {0, Inf} -> 1, then the mantissa cleared (a power of two, rounded down)
        a = amax
        if HAS_EPS:
            a = tl.where(a < eps, eps, a)
        scale = tl.math.div_rn(FMAX, a)
        scale = tl.where(scale > 3.4028234663852886e38, inf_value, scale)
        scale = tl.where((a > 3.4028234663852886e38) | (a == 0) | (a != a), 1.0, scale)
        scale = (_bits_f32(scale) & -8388608).to(tl.float32, bitcast=True)  # & 0xFF800000
        dec = tl.math.div_rn(1.0, scale)  # scale_inv (exact: a power of two)
        v = _per_block(_f32(x), scale, BR, BC, OM, OK)
        v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -FMAX), FMAX))  # satfinite, NaN kept
        q = _rne_on_grid(v, MANT, EMIN)
        deq = _bf16(_per_block(q, dec, BR, BC, OM, OK))
        _store_tiles(codes_ptr, _fp8_bits(q, CODE), deq_ptr, deq, rows, cols, inside, M, K, Mp, Kp)
        _store_blocks(scale_ptr, scale, Mp, Kp, BR, BC, OM, OK)
        _store_blocks(dec_ptr, dec, Mp, Kp, BR, BC, OM, OK)
        _store_blocks(amax_ptr, amax, Mp, Kp, BR, BC, OM, OK)

    @triton.jit
    def _nvfp4(
        x_ptr, amax_g_ptr, seed_ptr, q_ptr, sf_ptr, dec_ptr, deq_ptr, post_ptr, M, K, Mp, Kp,
        sixth, inv_global, flt_max,
        IBITS: tl.constexpr, MASK: tl.constexpr, INF: tl.constexpr,
        HAS_NAN: tl.constexpr, STOCHASTIC: tl.constexpr,
        BR: tl.constexpr, BC: tl.constexpr, OM: tl.constexpr, OK: tl.constexpr,
    ):  # fmt: skip
        x, rows, cols, inside = _tile(x_ptr, M, K, BR, BC, OM, OK)
        amax = _block_amax(x, IBITS, MASK, INF, BR, BC, OM, OK)
        amax_g = tl.load(amax_g_ptr)
        # global scale (nvfp4.global_encode_scale) and its reciprocal
        s_enc = tl.minimum(tl.math.div_rn(2688.0, amax_g), flt_max)
        s_enc = tl.where((amax_g == 0) | (s_enc == 0), 1.0, s_enc)
        s_dec = tl.math.div_rn(1.0, s_enc)
        # level-1 scale in E4M3 (satfinite), the encode factor k, TE's dequantization factor
        sf = _rne_on_grid(tl.minimum(amax * (s_enc * sixth), 448.0), 3, -6)
        k = tl.minimum(tl.math.div_rn(1.0, sf * s_dec), flt_max)
        dec = (sf * amax_g) * inv_global
        v = _per_block(_f32(x), k, BR, BC, OM, OK)
        if HAS_NAN:
            v = tl.where(v != v, 6.0, v)
        v = tl.minimum(tl.maximum(v, -6.0), 6.0)
        expo = tl.maximum(_bits_f32(v) & 0x7F800000, 0x3F800000)
        step = (expo - (1 << 23)).to(tl.float32, bitcast=True)  # 2^(e-1): the grid spacing at |v|
        r = v * _inverse_pow2(step)  # == v / step
        if STOCHASTIC:  # U[0, 1) of element (row, col) of the padded matrix (triton_random.from_seed)
            u = tl.rand(tl.load(seed_ptr), rows.to(tl.int64)[:, None] * Kp + cols[None, :])
            r = _floor(r + u)
        else:
            r = _with_sign_of(r, (tl.abs(r) + 8388608.0) - 8388608.0)  # half to even
        q = r * step
        deq = _bf16(_per_block(q, sf, BR, BC, OM, OK))
        _store_tiles(q_ptr, _bf16(q), deq_ptr, deq, rows, cols, inside, M, K, Mp, Kp)  # q: exact in bf16
        _store_blocks(sf_ptr, _fp8_bits(sf, tl.float8e4nv), Mp, Kp, BR, BC, OM, OK)
        _store_blocks(dec_ptr, dec, Mp, Kp, BR, BC, OM, OK)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(post_ptr, amax_g * inv_global)  # the GEMM's alpha factor: amax / 2688

    @triton.jit
    def _rht(x_ptr, m_ptr, y_ptr, amax_ptr, M, K, BK: tl.constexpr):
        """NVFP4's random Hadamard transform of x^T in x's orientation (nvfp4.rht_tokens) for one
        chunk of 16 rows (tokens) x BK columns: y[j, c] = sum_k x[k, c] M[k, j], the products
        (bf16 x +-1/4, exact) summed in fp32 in k order, rounded to bf16; and the chunk's amax of
        |y| (bf16 bits), so that the global post-RHT amax needs no second pass over y."""
        rows = tl.program_id(0) * 16 + tl.arange(0, 16)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        inside = (rows < M)[:, None] & (cols < K)[None, :]
        x = _f32(tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=inside, other=0.0))
        mat = tl.load(m_ptr + tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :])  # M[k, j]
        y = _bf16(tl.trans(tl.dot(tl.trans(x), mat, input_precision="ieee")))  # (16, BK)
        cm = (cols < K)[None, :] & (rows >= 0)[:, None]
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], y, mask=cm)
        bits = triton_amax.abs_bits(y.to(tl.int16, bitcast=True), 0x7FFF, 0x7F80)  # formats.ABS_BITS[bf16]
        amax = tl.max(tl.max(tl.where(cm, bits, 0), axis=1), axis=0)
        tl.store(amax_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), amax.to(tl.int16))


def handles(x2: torch.Tensor, br: int, bc: int) -> bool:
    """Whether these kernels cover a (M, K) matrix with (br x bc) blocks: a dtype with a
    bit-pattern spec, power-of-two block sides that fit a tile (a strided x2 is copied first)."""
    if triton is None or x2.dim() != 2 or x2.dtype not in ABS_BITS:
        return False
    pow2 = br & (br - 1) == 0 and bc & (bc - 1) == 0
    return pow2 and br <= 2 * ROWS and bc <= COLS


def _launch(x2: torch.Tensor, br: int, bc: int):
    m, k = x2.shape
    mp, kp = -(-m // br) * br, -(-k // bc) * bc
    meta = _meta(x2.dtype, br, bc)
    grid = (-(-mp // (meta["OM"] * br)), -(-kp // (meta["OK"] * bc)))
    return (m, k, mp, kp), grid, meta


@functools.cache
def _meta(dtype: torch.dtype, br: int, bc: int) -> dict:
    """The kernels' compile-time arguments for x's dtype and the block shape (built once: a
    quantized tensor's launch is on the step's critical path on the host)."""
    itype, mask, inf = ABS_BITS[dtype]
    om, ok = max(1, ROWS // br), max(1, COLS // bc)
    bits = {"IBITS": _TL_INT[itype], "MASK": mask, "INF": inf, "BR": br, "BC": bc, "OM": om, "OK": ok}
    warps = 8 if om * br * ok * bc > ROWS * COLS else 4  # 128-row tiles: twice the elements
    return {**bits, "enable_fp_fusion": False, "num_warps": warps}


_TL_INT = {} if triton is None else {torch.int16: tl.int16, torch.int32: tl.int32}


def _outputs(x2: torch.Tensor, br: int, bc: int, code_dtype: torch.dtype, *block_dtypes: torch.dtype):
    """What every kernel here takes: x2 contiguous, its sizes (M, K, Mp, Kp), the grid and the
    compile-time arguments, and the kernel's outputs: codes (Mp, Kp) of `code_dtype`, one
    (Mp/br, Kp/bc) tensor per block dtype, the bf16 GEMM operand (M, K)."""
    x2 = x2.contiguous()
    sizes, grid, meta = _launch(x2, br, bc)
    m, k, mp, kp = sizes
    dev = x2.device
    codes = torch.empty(mp, kp, dtype=code_dtype, device=dev)
    per_block = [torch.empty(mp // br, kp // bc, dtype=d, device=dev) for d in block_dtypes]
    deq = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    return x2, sizes, grid, meta, codes, per_block, deq


def blockwise(x2: torch.Tensor, br: int, bc: int, fmt: FP8Format, epsilon: float, inf_value: float):
    """Blockwise FP8 copy of x2 (M, K) with (br x bc) blocks and power-of-two scales: FP8 codes
    (Mp, Kp), the fp32 scales, scale_inv and block amaxes (Mp/br, Kp/bc), the dequantized values
    (M, K) in bf16 (exact). `inf_value`: the scale where fp8max / amax overflows (the input
    dtype's max, scaling.dtype_max)."""
    f32 = torch.float32
    x2, sizes, grid, meta, codes, (scale, dec, amax), deq = _outputs(x2, br, bc, fmt.dtype, f32, f32, f32)
    _blockwise[grid](
        x2, codes.view(torch.uint8), scale, dec, amax, deq, *sizes, epsilon, inf_value,
        **_fmt_meta(fmt), HAS_EPS=epsilon > 0, **meta,
    )  # fmt: skip
    return codes, scale, dec, amax, deq


def _fmt_meta(fmt: FP8Format) -> dict:
    mant, emin = _FP8[fmt.dtype]
    code = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}[fmt.dtype]
    return {"FMAX": fmt.max, "MANT": mant, "EMIN": emin, "CODE": code}


_INV_MAX = {torch.float8_e4m3fn: _fl32(1.0 / 448.0), torch.float8_e5m2: _fl32(1.0 / 57344.0)}


def mxfp8(x2: torch.Tensor, br: int, bc: int, fmt: FP8Format):
    """MXFP8 copy of x2 (M, K) with (br x bc) blocks: FP8 codes (Mp, Kp) padded to whole blocks,
    E8M0 bytes and their fp32 decodes (Mp/br, Kp/bc), the dequantized values (M, K) in bf16."""
    x2, sizes, grid, meta, codes, (e8m0, dec), deq = _outputs(
        x2, br, bc, fmt.dtype, torch.uint8, torch.float32
    )
    inv_max = _INV_MAX[fmt.dtype]
    _mxfp8[grid](x2, codes.view(torch.uint8), e8m0, dec, deq, *sizes, inv_max, **_fmt_meta(fmt), **meta)
    return codes, e8m0, dec, deq


def nvfp4(x2: torch.Tensor, br: int, bc: int, amax_g: torch.Tensor, has_nan: bool, seed: torch.Tensor | None):
    """NVFP4 copy of x2 (M, K) with (br x bc) blocks and the whole-tensor amax `amax_g` (a
    one-element fp32 tensor): E2M1 grid values (Mp, Kp) in bf16 (exact: half the bytes of the
    reference's fp32), E4M3 block scales and TE's fp32 dequantization factors (Mp/br, Kp/bc),
    value x block scale (M, K) in bf16, and the GEMM's post scale amax / 2688 (one element).
    `seed`: stochastic rounding with triton_random's uniforms from this seed, or None (to
    nearest even)."""
    x2, sizes, grid, meta, q, (sf, dec), deq = _outputs(
        x2, br, bc, torch.bfloat16, torch.float8_e4m3fn, torch.float32
    )
    post = torch.empty(1, dtype=torch.float32, device=x2.device)
    stochastic = seed is not None
    _nvfp4[grid](
        x2, amax_g.reshape(1), seed if stochastic else amax_g, q, sf.view(torch.uint8), dec, deq, post,
        *sizes, *_NVFP4_CONSTS, HAS_NAN=has_nan, STOCHASTIC=stochastic, **meta,
    )  # fmt: skip
    return q, sf, dec, deq, post


_NVFP4_CONSTS = (_fl32(1.0 / 6.0), _fl32(1.0 / GLOBAL_MAX), FLT_MAX)


RHT_COLS = 64  # columns per program of the RHT kernel (16 rows each)


def rht(x2: torch.Tensor, mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nvfp4.rht_tokens(x2) for a bf16 (M, K) matrix: the (Mp, K) bf16 transform (Mp = M rounded
    up to 16, zero rows past M) and its amax (a one-element fp32 tensor, NaN ignored)."""
    x2 = x2.contiguous()
    m, k = x2.shape
    mp = -(-m // 16) * 16
    y = torch.empty(mp, k, dtype=torch.bfloat16, device=x2.device)
    grid = (mp // 16, -(-k // RHT_COLS))
    partial = torch.empty(grid, dtype=torch.int16, device=x2.device)
    _rht[grid](x2, mat.float().contiguous(), y, partial, m, k, BK=RHT_COLS, enable_fp_fusion=False)
    return y, partial.amax().view(1).view(torch.bfloat16).float()
