"""MXFP8 (TE MXFP8BlockScaling): FP8 elements with one E8M0 scale per 32 elements.

docs/numerics.md section 5: e = E8M0(amax * fl32(1/fp8max)) rounded *up*; elements are multiplied by
TE's exp2f_rcp(e) and cast with saturation. Rowwise (1x32) and columnwise (32x1) copies are each
quantized from high precision. TE stores MXFP8 columnwise data untransposed, shape (M, K).

`tile_2d` (recipe.enable_2d_quantization, weights only; docs/numerics.md "MXFP8 2D weights"): one E8M0
scale per 32x32 tile, from the tile's amax (TE common/cast/mxfp8/quantize_mxfp8.cuh, kIs2DBlockScaling:
the rowwise pass reduces its 32 rows' 1x32 amaxes, the columnwise pass its 32 columns' 32x1 amaxes by a
warp reduction). The scale layouts stay per 1x32 / 32x1 block, each holding its tile's E8M0, and the two
copies' codes are equal (the same elements times the same scale).
"""

from __future__ import annotations

import torch

from harness.numerics import fast, triton_cast
from harness.numerics.formats import FP8Format, cast_fp8, e8m0_decode, e8m0_encode, e8m0_quant_scale
from harness.numerics.qtensor import BlockQuantized, as_2d, block_view, pad2d, round_up
from harness.numerics.scaling import amax, const

BLOCK = 32


class MXFP8Quantized(BlockQuantized):
    """MXFP8Tensor: uint8 FP8 data (M, K) for both copies, uint8 E8M0 scales in TE's padded layout."""

    def __init__(self, elems, e8m0, block, shape, columnwise, has_nan, fmt, dec=None):
        dec = e8m0_decode(e8m0) if dec is None else dec
        super().__init__(elems, dec, block, shape, columnwise, has_nan)
        self.e8m0, self.fmt = e8m0, fmt

    @property
    def data(self) -> torch.Tensor:
        return self._codes_2d().reshape(self.shape)

    @property
    def scale_inv(self) -> torch.Tensor:
        """Rowwise (round128(M), round4(K/32)); columnwise (round4(M/32), round128(K)); zero padding."""
        e = self.e8m0  # (M, K/32) or (M/32, K), x's orientation
        if self.columnwise:
            rows, cols = round_up(e.shape[0], 4), round_up(self.k, 128)
        else:
            rows, cols = round_up(self.m, 128), round_up(e.shape[1], 4)
        out = torch.zeros(rows, cols, dtype=torch.uint8, device=e.device)
        valid = e[:, : self.k] if self.columnwise else e[: self.m]
        out[: valid.shape[0], : valid.shape[1]] = valid
        return out

    def saturated_count(self) -> torch.Tensor:
        return (self.elems[: self.m, : self.k].float().abs() == self.fmt.max).sum()

    def telemetry_scale(self) -> torch.Tensor:
        return e8m0_quant_scale(self.e8m0.flatten()[torch.argmax(self.e8m0.flatten())])


def quantize_mxfp8(
    x: torch.Tensor, fmt: FP8Format, *, columnwise: bool = False, fused: bool = False, tile_2d: bool = False
) -> MXFP8Quantized:
    """One MXFP8 copy: 1x32 blocks along rows, or 32x1 along columns when columnwise; `tile_2d`: each
    block scaled by its 32x32 tile's E8M0. `fused`: the cast and the GEMM operand in one pass (on
    CUDA one Triton kernel for the whole 1D quantization, harness.numerics.triton_cast; the compiled
    cast of fast.cast_blocks for 2D tiles; same codes)."""
    x2 = as_2d(x)
    br, bc = (BLOCK, 1) if columnwise else (1, BLOCK)
    if fused and not tile_2d and x2.is_cuda and triton_cast.handles(x2, br, bc):
        return _one_kernel(x2, fmt, x.shape, columnwise)
    return _quantize(x2, fmt, x.shape, columnwise, fused, tile_2d)


def one_kernel(x2: torch.Tensor, fmt: FP8Format, shape, columnwise: bool) -> MXFP8Quantized:
    """The whole quantization in one Triton kernel (harness.numerics.triton_cast)."""
    br, bc = (BLOCK, 1) if columnwise else (1, BLOCK)
    codes, e, dec, deq16 = triton_cast.mxfp8(x2, br, bc, fmt)
    out = MXFP8Quantized(codes, e, (br, bc), shape, columnwise, True, fmt, dec)
    out._gop = (deq16.reshape(shape), None)
    return out


def _stages(x2: torch.Tensor, fmt: FP8Format, shape, columnwise: bool) -> MXFP8Quantized:
    return _quantize(x2, fmt, shape, columnwise, True)


_one_kernel = fast.first_working(one_kernel, _stages)


def _tile_amax(block_amax: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """Each 1x32 (or 32x1) block's amax replaced by its 32x32 tile's: (Mr, Kc) -> (Mr, Kc)."""
    mr, kc = block_amax.shape
    if columnwise:  # (M/32, K): 32 neighbouring columns make a tile
        tiles = block_amax.view(mr, kc // BLOCK, BLOCK).amax(2)  # (M/32, K/32)
        return tiles.repeat_interleave(BLOCK, dim=1)
    tiles = block_amax.view(mr // BLOCK, BLOCK, kc).amax(1)  # (M/32, K/32)
    return tiles.repeat_interleave(BLOCK, dim=0)


def _quantize(
    x2: torch.Tensor, fmt: FP8Format, shape, columnwise: bool, fused: bool, tile_2d: bool = False
) -> MXFP8Quantized:
    br, bc = (BLOCK, 1) if columnwise else (1, BLOCK)
    # (Mp, Kp); TE itself requires both dims divisible by 32 (2D tiles: padding to 32 both ways)
    xp = pad2d(x2, BLOCK, BLOCK) if tile_2d else pad2d(x2, br, bc)
    blocks = block_view(xp, br, bc)  # (Mr, br, Kc, bc)
    block_amax, has_nan = amax(blocks, dim=(1, 3))  # (Mr, Kc)
    if tile_2d:
        block_amax = _tile_amax(block_amax, columnwise)
    e = e8m0_encode(block_amax * const(1.0 / fmt.max, block_amax))  # multiply by fl32(1/fp8max)
    if fused:
        q, deq16 = fast.cast_blocks(blocks, e8m0_quant_scale(e), e8m0_decode(e), fmt)
        out = MXFP8Quantized(q.view(xp.shape), e, (br, bc), shape, columnwise, has_nan, fmt)
        out._gop = (deq16.view(xp.shape)[: out.m, : out.k].reshape(shape), None)
        return out
    v = blocks.float() if blocks.dtype != torch.float32 else blocks.clone()
    v = v.mul_(e8m0_quant_scale(e)[:, None, :, None])
    q = cast_fp8(v, fmt, inplace=True).view(xp.shape)
    return MXFP8Quantized(q, e, (br, bc), shape, columnwise, has_nan, fmt)
