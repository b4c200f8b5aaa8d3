"""NVFP4 (TE NVFP4BlockScaling): E2M1 elements, E4M3 scale per 16 elements, fp32 global scale.

docs/numerics.md section 6. Two-level scaling from a global amax (S_enc = 2688/amax), 1x16 blocks for
activations and gradients (16x1 for their columnwise copies), 16x16 tiles for weights (the
columnwise copy is then the exact transpose). The wgrad operands' columnwise copies go through the
random Hadamard transform (fixed signs, result rounded to bf16) and use the post-RHT amax;
gradients round stochastically.

TE 2.20's options (docs/numerics.md, "NVFP4 row-scaled activations" and "NVFP4 4over6"), both
following TE's custom_recipes/reference_nvfp4.py operation by operation: `row_scaled` gives every
line of a copy (a row of the rowwise copy, a column of x for the columnwise one) its own global
amax; `four_over_six` picks per block between the block scaled to 6 (the normal scale) and to 4
(the scale x 1.5) by the dequantization error, MAE or MSE, under a global E4M3 bound of 448 or 256.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from harness.numerics import fast, triton_cast, triton_random
from harness.numerics.formats import E4M3, FLT_MAX, cast_fp8, e2m1_encode, e2m1_round, pack_fp4
from harness.numerics.qtensor import BlockQuantized, as_2d, block_view, pad2d, round_up
from harness.numerics.scaling import amax, amax_nosync, const

BLOCK = 16
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # TE's get_wgrad_sign_vector


@functools.lru_cache(maxsize=8)
def rht_matrix(device: torch.device) -> torch.Tensor:
    """diag(s) @ H16 / 4 (Sylvester Hadamard): entries +-0.25, exact in bf16 and fp32."""
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (torch.tensor(RHT_SIGNS, dtype=torch.float32)[:, None] * h * 0.25).to(device)


def rht_tokens(x2: torch.Tensor) -> torch.Tensor:
    """TE's RHT of x^T, in x's orientation: every 16 consecutive rows (tokens) of each column c
    become chunk @ M. Products accumulate in fp32; the result is rounded to bf16 (not fast-math)."""
    xp = pad2d(x2, BLOCK, 1)  # (Mp, K)
    chunks = xp.float().view(-1, BLOCK, xp.shape[1])  # (Mp/16, 16, K)
    y = torch.matmul(rht_matrix(x2.device).t(), chunks)  # y[j] = sum_k x[k] M[k, j]
    return y.view(xp.shape).to(torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Options:
    """TE 2.20's per-tensor NVFP4 options (NVFP4Quantizer's row_scaled_nvfp4, nvfp4_use_4over6,
    nvfp4_e4m3_max, nvfp4_4over6_err_mode). `e4m3_max` applies to 4over6 tensors only: TE keeps
    448 otherwise (tensor/nvfp4_tensor.py:169)."""

    row_scaled: bool = False
    four_over_six: bool = False
    e4m3_max: float = 448.0
    err_mode: str = "MAE"

    def __post_init__(self):
        if self.err_mode not in ("MAE", "MSE"):
            raise ValueError(f"NVFP4 4over6 err_mode={self.err_mode!r}: use 'MAE' or 'MSE'")
        if self.e4m3_max not in (448.0, 256.0):
            raise ValueError(f"NVFP4 e4m3_max={self.e4m3_max}: use 448 or 256")

    @property
    def bound(self) -> float:
        """The global scale's E4M3 bound: S_enc = 6 x bound / amax."""
        return self.e4m3_max if self.four_over_six else 448.0


PLAIN = Options()


class NVFP4Quantized(BlockQuantized):
    """NVFP4Tensor: packed E2M1 data, E4M3 block scales (uint8, padded) and the global amax.

    `amax`: (1,), or for a row-scaled copy one per line (M,) rowwise / (K,) columnwise: TE's
    global_amax_row / global_amax_col. `bound`: the global scale's E4M3 bound (448, or 256)."""

    def __init__(self, elems, dec, sf, block, shape, columnwise, amax_, rht, bound=448.0, per_line=False):
        super().__init__(elems, dec, block, shape, columnwise)
        self.sf, self.amax, self.rht = sf, amax_.reshape(-1), rht
        self.bound, self.per_line = bound, per_line

    def _gemm_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """E2M1 x E4M3 block scale (exact in bf16), the global amax / (6 x bound) folded into the
        GEMM (a row-scaled copy's as a vector over the GEMM output's lines: `_post`)."""
        blocks = block_view(self.elems, *self.block)  # (Mr, br, Kc, bc)
        vals = (blocks * self.sf.float()[:, None, :, None]).view(self.elems.shape)[: self.m, : self.k]
        post = _post(self.amax, self.bound, self.per_line, self.columnwise)
        return vals.to(torch.bfloat16).reshape(self.shape), post

    @property
    def data(self) -> torch.Tensor:
        """Rowwise (M, K/2); columnwise (K, M/2) from the transposed codes; two codes per byte."""
        codes = e2m1_encode(self.elems[: self.m, : self.k])  # (M, K)
        if self.columnwise:
            return pack_fp4(codes.t().contiguous())
        return pack_fp4(codes).reshape(*self.shape[:-1], self.k // 2)

    @property
    def scale_inv(self) -> torch.Tensor:
        """Rowwise (round128(M), round4(K/16)); columnwise (round128(K), round4(M/16)); E4M3 bytes
        of the scale of every row's 16-blocks (2-D tiles repeat theirs over their 16 rows)."""
        sf = self.sf.view(torch.uint8)  # (M/br, K/bc) grid in x's orientation
        if self.columnwise:
            sf = sf.t()  # rows of the transposed tensor: (K, M/16) or (K/16, M/16) tiles
        if self.block == (BLOCK, BLOCK):  # 16x16 tiles: every row repeats its tile's scale
            sf = sf.repeat_interleave(BLOCK, dim=0)
        rows, nblk = (self.k, -(-self.m // BLOCK)) if self.columnwise else (self.m, -(-self.k // BLOCK))
        out = torch.zeros(round_up(rows, 128), round_up(nblk, 4), dtype=torch.uint8, device=sf.device)
        out[:rows, :nblk] = sf[:rows, :nblk]
        return out

    def saturated_count(self) -> torch.Tensor:
        return (self.elems[: self.m, : self.k].abs() == 6.0).sum()

    def telemetry_scale(self) -> torch.Tensor:
        """The global encode scale S_enc (6 x bound / amax; a row-scaled copy's largest line's)."""
        return global_encode_scale(self.amax.max(), self.bound).reshape(())


def _post(amax_g: torch.Tensor, bound: float, per_line: bool, columnwise: bool) -> torch.Tensor:
    """The GEMM's post scale amax / (6 x bound). Per line: (M, 1) for a rowwise copy (fprop's output
    rows), (1, K) for a columnwise one (wgrad's output columns), the vectors TE's row-scaled GEMM
    multiplies its fp32 output by (TE 2.20.2 cpp_extensions/gemm.py:85-110, 300-360)."""
    post = amax_g.reshape(-1) * const(1.0 / (6.0 * bound), amax_g)
    if not per_line:
        return post
    return post.reshape(1, -1) if columnwise else post.reshape(-1, 1)


def _fused_draws_match(device: torch.device) -> bool:
    """The fused cast draws torch.rand(v.shape) as the CUDA reference does; a CPU's reference draws
    its own way (formats.add_uniform_), so stochastic rounding stays eager there."""
    return device.type != "cpu"


def global_encode_scale(amax_g: torch.Tensor, bound: float = 448.0) -> torch.Tensor:
    """S_enc = fl32(6 x bound / amax) (2688 / amax; 1536 / amax under 4over6's 256 bound), capped at
    FLT_MAX; 1 when amax is 0 or the result is 0 (TE's kernel; the reference keeps FLT_MAX for a zero
    amax, which gives the same all-zero codes and scales)."""
    s = torch.div(const(6.0 * bound, amax_g), amax_g)
    s = torch.minimum(s, const(FLT_MAX, s))
    return torch.where((amax_g == 0) | (s == 0), const(1.0, s), s)


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    columnwise: bool = False,
    tile_2d: bool = False,
    rht: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    fused: bool = False,
    options: Options = PLAIN,
) -> NVFP4Quantized:
    """One NVFP4 copy. `rht` applies to the columnwise copy only (as TE); x should be bf16 then.
    `fused`: the element cast and the GEMM operand in one pass (on CUDA the scales, the cast and
    the operand in one Triton kernel after the amax, harness.numerics.triton_cast; same codes).
    A CPU's stochastic rounding keeps the reference's own draws (formats.add_uniform_).
    `options`: row scaling and 4over6 (`Options`); the Triton kernel has neither, so those copies
    take the reference's code (row scaling keeps the compiled element cast, 4over6 runs eagerly)."""
    if options.row_scaled and tile_2d:
        raise ValueError("row-scaled NVFP4 supports 1x16 blocks only, not 16x16 tiles (as TE)")
    if options.four_over_six and stochastic:
        raise ValueError("NVFP4 4over6 does not support stochastic rounding (as TE)")
    x2 = as_2d(x)
    use_rht = rht and columnwise and not tile_2d
    if tile_2d:
        br, bc = BLOCK, BLOCK
    else:
        br, bc = (BLOCK, 1) if columnwise else (1, BLOCK)
    plain = options == PLAIN
    kernels = plain and fused and x2.is_cuda and triton_cast.handles(x2, br, bc)
    src, amax_g = x2, None
    if use_rht:  # (Mp, K); with the kernels the transform and its amax come from one Triton pass
        x16 = x2.to(torch.bfloat16)
        src, amax_g = _rht_kernel(x16) if kernels else (rht_tokens(x16), None)
    args = (src, (br, bc), x.shape, columnwise, use_rht, stochastic, generator)
    if kernels:
        return _one_kernel(*args, amax_g)
    return _quantize(*args, fused, options)


def _rht_kernel_fn(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_cast.rht(x2, rht_matrix(x2.device))


def _rht_stages(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    src = rht_tokens(x2)
    return src, amax_nosync(src, None)


_rht_kernel = fast.first_working(_rht_kernel_fn, _rht_stages)


def one_kernel(src, block, shape, columnwise, use_rht, stochastic, generator, amax_g=None) -> NVFP4Quantized:
    """The whole-tensor amax (unless given), then scales, cast and GEMM operand in one Triton
    kernel (harness.numerics.triton_cast); stochastic rounding draws the CUDA reference's uniforms
    (harness.numerics.triton_random: one seed from `generator`, Philox in the kernel)."""
    br, bc = block
    if amax_g is None:  # the max of the block amaxes (from the bits: +0.0 for a zero tensor)
        amax_g = amax_nosync(src, None, fused=src.is_cuda)
    seed = triton_random.draw_seed(generator, src.device) if stochastic else None
    q, sf, dec, vals16, post = triton_cast.nvfp4(src, br, bc, amax_g, True, seed)
    out = NVFP4Quantized(q, dec, sf, block, shape, columnwise, amax_g, use_rht)
    out._gop = (vals16[: out.m, : out.k].reshape(shape), post)
    return out


def _stages(src, block, shape, columnwise, use_rht, stochastic, generator, amax_g=None) -> NVFP4Quantized:
    return _quantize(src, block, shape, columnwise, use_rht, stochastic, generator, True)


_one_kernel = fast.first_working(one_kernel, _stages)


def _line_amax(block_amax: torch.Tensor, row_scaled: bool, columnwise: bool) -> torch.Tensor:
    """The global amax, broadcastable to the (Mr, Kc) block grid: (1, 1) for the whole tensor, or
    per line: (M, 1) rows for a rowwise copy, (1, K) columns of x for a columnwise one."""
    if not row_scaled:
        return block_amax.max().reshape(1, 1)
    return block_amax.amax(dim=0, keepdim=True) if columnwise else block_amax.amax(dim=1, keepdim=True)


def _quantize(
    src, block, shape, columnwise, use_rht, stochastic, generator, fused, options=PLAIN
) -> NVFP4Quantized:
    br, bc = block
    blocks = block_view(pad2d(src, br, bc), br, bc)  # (Mr, br, Kc, bc)
    block_amax, has_nan = amax(blocks, dim=(1, 3))  # (Mr, Kc)
    amax_g = _line_amax(block_amax, options.row_scaled, columnwise)  # post-RHT for an RHT copy
    s_enc = global_encode_scale(amax_g, options.bound)
    s_dec = torch.div(const(1.0, s_enc), s_enc)
    if options.four_over_six:
        q, sf = _four_over_six(blocks, block_amax, amax_g, s_enc, s_dec, has_nan, options, columnwise)
        return _result(q, sf, block, shape, columnwise, amax_g, use_rht, options)
    sf = cast_fp8(block_amax * (s_enc * const(1.0 / 6.0, s_enc)), E4M3, inplace=True)  # level-1 scale, E4M3
    sf32 = sf.float()
    k = torch.minimum(torch.div(const(1.0, sf32), sf32 * s_dec), const(FLT_MAX, sf32))  # (Mr, Kc)
    vals16 = None
    if fused and (not stochastic or _fused_draws_match(blocks.device)):
        q, vals16 = fast.cast_e2m1(blocks, k, sf32, has_nan, generator, stochastic)
        q = q.view(blocks.shape[0] * br, -1)
    else:
        v = blocks.float() if blocks.dtype != torch.float32 else blocks.clone()
        v = v.mul_(k[:, None, :, None])  # fp32(x * k)
        q = e2m1_round(v, generator, stochastic, has_nan).view(blocks.shape[0] * br, -1)  # (Mp, Kp)
    out = _result(q, sf, block, shape, columnwise, amax_g, use_rht, options)
    if vals16 is not None:
        post = _post(amax_g, options.bound, options.row_scaled, columnwise)
        out._gop = (vals16.view(q.shape)[: out.m, : out.k].reshape(shape), post)
    return out


def _result(q, sf, block, shape, columnwise, amax_g, use_rht, options) -> NVFP4Quantized:
    """The copy, with TE's dequantization multiplier fl32(fl32(sf x amax) x fl32(1 / (6 x bound)))
    per block (dequantize_nvfp4.cuh: the line's amax for a row-scaled copy)."""
    dec = (sf.float() * amax_g) * const(1.0 / (6.0 * options.bound), amax_g)  # (Mr, Kc)
    bound, per_line = options.bound, options.row_scaled
    return NVFP4Quantized(q, dec, sf, block, shape, columnwise, amax_g, use_rht, bound, per_line)


def _four_over_six(blocks, block_amax, amax_g, s_enc, s_dec, has_nan, options, columnwise):
    """4over6 (TE 2.20.2 reference_nvfp4.py:524-649, quantize_4over6_nvfp4.cuh): both candidates'
    E2M1 values and E4M3 scales, each block taking map-to-4 where its error is strictly smaller
    (ties keep map-to-6). Returns (values (Mp, Kp), scales (Mr, Kc) E4M3)."""
    base = torch.div(block_amax, const(6.0, block_amax)) * s_enc  # fl32(fl32(amax_b / 6) x S_enc)
    x = blocks.float()  # (Mr, br, Kc, bc)
    cands = []
    for expand in (1.5, 1.0):  # map-to-4: the scale x 1.5 so that E2M1 4 reaches the block amax
        sf = cast_fp8(base * const(expand, base), E4M3)  # clamped to 448 (RNE)
        sf32 = sf.float()
        k = torch.minimum(torch.div(const(1.0, sf32), sf32 * s_dec), const(FLT_MAX, sf32))
        q = e2m1_round(x * k[:, None, :, None], None, False, has_nan)
        cands.append((q, sf, _block_error(q, sf32, amax_g, x, options, columnwise)))
    (q4, sf4, err4), (q6, sf6, err6) = cands
    pick4 = err4 < err6  # (Mr, Kc)
    q = torch.where(pick4[:, None, :, None], q4, q6).view(x.shape[0] * x.shape[1], -1)
    sf = torch.where(pick4, sf4.view(torch.uint8), sf6.view(torch.uint8)).view(torch.float8_e4m3fn)
    return q, sf


def _block_error(q, sf32, amax_g, x, options, columnwise) -> torch.Tensor:
    """Each block's error in the input's domain: the sum of |d| (MAE) or d*d (MSE) over its
    elements, d = fl32(fl32(fl32(q x sf) x amax) / (6 x bound)) - x, accumulated in fp32 in TE's
    order: along each 16-element line in element order, then for a 16x16 tile over its 16 lines
    as the kernel's warp reduction does (reference_nvfp4.py:513-521, 608-642)."""
    denom = const(6.0 * options.bound, x)
    val = torch.div((q * sf32[:, None, :, None]) * amax_g[:, None, :, None], denom)
    d = val - x
    e = d.abs() if options.err_mode == "MAE" else d * d  # (Mr, br, Kc, bc)
    line_axis, tile_axis = (1, 3) if columnwise else (3, 1)  # the 16 elements of a block's line
    acc = e.select(line_axis, 0)
    for i in range(1, e.shape[line_axis]):
        acc = acc + e.select(line_axis, i)
    tile_axis -= tile_axis > line_axis  # (Mr, Kc, bc) or (Mr, br, Kc) now
    n = acc.shape[tile_axis]
    while n > 1:  # 16 lines: [0:8]+[8:16], [0:4]+[4:8], [0:2]+[2:4], [0]+[1]
        n //= 2
        acc = acc.narrow(tile_axis, 0, n) + acc.narrow(tile_axis, n, n)
    return acc.squeeze(tile_axis)
