"""NVFP4 (TE NVFP4BlockScaling): E2M1 elements, E4M3 scale per 16 elements, fp32 global scale.

docs/numerics.md section 6. Two-level scaling from a global amax (S_enc = 2688/amax), 1x16 blocks for
activations and gradients (16x1 for their columnwise copies), 16x16 tiles for weights (the
columnwise copy is then the exact transpose). The wgrad operands' columnwise copies go through the
random Hadamard transform (fixed signs, result rounded to bf16) and use the post-RHT amax;
gradients round stochastically.
"""

from __future__ import annotations

import functools

import torch

from harness.numerics import fast, triton_cast, triton_random
from harness.numerics.formats import E4M3, FLT_MAX, cast_fp8, e2m1_encode, e2m1_round, pack_fp4
from harness.numerics.qtensor import BlockQuantized, as_2d, block_view, pad2d, round_up
from harness.numerics.scaling import amax, amax_nosync, const

BLOCK = 16
GLOBAL_MAX = 448.0 * 6.0  # E4M3 max x E2M1 max
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


class NVFP4Quantized(BlockQuantized):
    """NVFP4Tensor: packed E2M1 data, E4M3 block scales (uint8, padded) and the global amax."""

    def __init__(self, elems, dec, sf, block, shape, columnwise, amax_, rht):
        super().__init__(elems, dec, block, shape, columnwise)
        self.sf, self.amax, self.rht = sf, amax_.reshape(1), rht

    def _gemm_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """E2M1 x E4M3 block scale (exact in bf16), the global amax / 2688 folded into the GEMM."""
        blocks = block_view(self.elems, *self.block)  # (Mr, br, Kc, bc)
        vals = (blocks * self.sf.float()[:, None, :, None]).view(self.elems.shape)[: self.m, : self.k]
        post = self.amax * const(1.0 / GLOBAL_MAX, self.amax)
        return vals.to(torch.bfloat16).reshape(self.shape), post.reshape(1)

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
        """The global encode scale S_enc (2688 / amax)."""
        return global_encode_scale(self.amax).reshape(())


def _fused_draws_match(device: torch.device) -> bool:
    """The fused cast draws torch.rand(v.shape) as the CUDA reference does; a CPU's reference draws
    its own way (formats.add_uniform_), so stochastic rounding stays eager there."""
    return device.type != "cpu"


def global_encode_scale(amax_g: torch.Tensor) -> torch.Tensor:
    """S_enc = fl32(2688 / amax), capped at FLT_MAX; 1 when amax is 0 or the result is 0."""
    s = torch.div(const(GLOBAL_MAX, amax_g), amax_g)
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
) -> NVFP4Quantized:
    """One NVFP4 copy. `rht` applies to the columnwise copy only (as TE); x should be bf16 then.
    `fused`: the element cast and the GEMM operand in one pass (on CUDA the scales, the cast and
    the operand in one Triton kernel after the amax, harness.numerics.triton_cast; same codes).
    A CPU's stochastic rounding keeps the reference's own draws (formats.add_uniform_)."""
    x2 = as_2d(x)
    use_rht = rht and columnwise and not tile_2d
    if tile_2d:
        br, bc = BLOCK, BLOCK
    else:
        br, bc = (BLOCK, 1) if columnwise else (1, BLOCK)
    kernels = fused and x2.is_cuda and triton_cast.handles(x2, br, bc)
    src, amax_g = x2, None
    if use_rht:  # (Mp, K); with the kernels the transform and its amax come from one Triton pass
        x16 = x2.to(torch.bfloat16)
        src, amax_g = _rht_kernel(x16) if kernels else (rht_tokens(x16), None)
    args = (src, (br, bc), x.shape, columnwise, use_rht, stochastic, generator)
    if kernels:
        return _one_kernel(*args, amax_g)
    return _quantize(*args, fused)


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


def _quantize(src, block, shape, columnwise, use_rht, stochastic, generator, fused) -> NVFP4Quantized:
    br, bc = block
    blocks = block_view(pad2d(src, br, bc), br, bc)  # (Mr, br, Kc, bc)
    block_amax, has_nan = amax(blocks, dim=(1, 3))  # (Mr, Kc)
    amax_g = block_amax.max()  # the whole-tensor amax (post-RHT for an RHT copy)
    s_enc = global_encode_scale(amax_g)
    s_dec = torch.div(const(1.0, s_enc), s_enc)
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
    dec = (sf32 * amax_g) * const(1.0 / GLOBAL_MAX, sf32)  # TE's dequantize: sf * amax / 2688
    out = NVFP4Quantized(q, dec, sf, (br, bc), shape, columnwise, amax_g, use_rht)
    if vals16 is not None:
        post = (amax_g * const(1.0 / GLOBAL_MAX, amax_g)).reshape(1)
        out._gop = (vals16.view(q.shape)[: out.m, : out.k].reshape(shape), post)
    return out
