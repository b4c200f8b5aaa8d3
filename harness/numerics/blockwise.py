"""FP8 block scaling (TE Float8BlockScaling): 1x128 activation/gradient blocks, 128x128 weight tiles.

docs/numerics.md section 4: per block amax -> compute_scale_from_amax (power-of-two by default; the
Inf fallback is the input dtype's max), scale_inv = 1/scale. A 1x128 tensor's columnwise copy is
quantized separately from high precision with 128x1 blocks; a 128x128 tensor's columnwise copy is
the exact transpose (same tile scales).
"""

from __future__ import annotations

import torch

from harness.numerics import fast, triton_cast
from harness.numerics.formats import FP8Format, cast_fp8
from harness.numerics.qtensor import BlockQuantized, as_2d, block_view, pad2d, pad_last
from harness.numerics.scaling import amax, dtype_max, reciprocal, scale_from_amax

BLOCK = 128


class BlockwiseQuantized(BlockQuantized):
    """Float8BlockwiseQTensor: rowwise/columnwise data and fp32 scale_inv in TE's GEMM layouts."""

    def __init__(self, elems, dec, block, shape, columnwise, has_nan, fmt, scale, block_amax, pow2=True):
        super().__init__(elems, dec, block, shape, columnwise, has_nan)
        self.fmt, self._scale, self.block_amax = fmt, scale, block_amax
        self.exact_bf16 = pow2  # fp32 scales: dequantized values need fp32 (the fast GEMM keeps it)

    @property
    def tile_2d(self) -> bool:
        return self.block == (BLOCK, BLOCK)

    @property
    def data(self) -> torch.Tensor:
        codes = self._codes_2d()  # (M, K)
        if not self.columnwise:
            return codes.reshape(self.shape)
        return codes.t().contiguous().reshape(self._transposed_shape())

    @property
    def scale_inv(self) -> torch.Tensor:
        """1x128: (K/128, round4(M)) rowwise, (M/128, round4(K)) columnwise; 128x128: tile grid with
        its inner dim padded to 4 (padding zero here; uninitialised in TE)."""
        grid = self.dec  # (Mb|M, Kb|K) in x's orientation
        if self.tile_2d:
            return pad_last(grid.t() if self.columnwise else grid, 4).contiguous()
        if self.columnwise:  # 128x1 blocks: (M/128, K)
            return pad_last(grid[:, : self.k], 4).contiguous()
        return pad_last(grid[: self.m].t(), 4).contiguous()  # (K/128, M)

    def saturated_count(self) -> torch.Tensor:
        return (self._codes_float().abs() == self.fmt.max).sum()

    def _codes_float(self) -> torch.Tensor:
        return self.elems[: self.m, : self.k].float()

    def telemetry_scale(self) -> torch.Tensor:
        return self._scale.flatten()[torch.argmax(self.block_amax.flatten())]


def quantize_blockwise(
    x: torch.Tensor,
    fmt: FP8Format,
    *,
    tile_2d: bool,
    columnwise: bool = False,
    power_2: bool = True,
    epsilon: float = 0.0,
    fused: bool = False,
) -> BlockwiseQuantized:
    """One copy of a block-scaled FP8 tensor (rowwise 1x128, columnwise 128x1, or 128x128 tiles).
    `fused`: the cast and the GEMM operand in one pass (harness.numerics.fast; on CUDA with
    power-of-two scales the whole quantization in one Triton kernel, harness.numerics.triton_cast;
    same codes)."""
    x2 = as_2d(x)
    if tile_2d:
        br, bc = BLOCK, BLOCK
    else:
        br, bc = (BLOCK, 1) if columnwise else (1, BLOCK)
    if fused and power_2 and x2.is_cuda and triton_cast.handles(x2, br, bc):
        return _one_kernel(x2, fmt, (br, bc), x.shape, columnwise, epsilon)
    return _quantize(x2, fmt, (br, bc), x.shape, columnwise, power_2, epsilon, fused)


def one_kernel(x2, fmt: FP8Format, block, shape, columnwise: bool, epsilon: float) -> BlockwiseQuantized:
    """The whole quantization (power-of-two scales) in one Triton kernel (harness.numerics.triton_cast)."""
    codes, scale, dec, block_amax, deq16 = triton_cast.blockwise(
        x2, *block, fmt, epsilon, dtype_max(x2.dtype)
    )
    out = BlockwiseQuantized(codes, dec, block, shape, columnwise, True, fmt, scale, block_amax, True)
    out._gop = (deq16.reshape(shape), None)
    return out


def _stages(x2, fmt, block, shape, columnwise, epsilon) -> BlockwiseQuantized:
    return _quantize(x2, fmt, block, shape, columnwise, True, epsilon, True)


_one_kernel = fast.first_working(one_kernel, _stages)


def _quantize(x2, fmt, block, shape, columnwise, power_2, epsilon, fused) -> BlockwiseQuantized:
    br, bc = block
    xp = pad2d(x2, br, bc)  # (Mp, Kp)
    blocks = block_view(xp, br, bc)  # (Mr, br, Kc, bc)
    block_amax, has_nan = amax(blocks, dim=(1, 3))  # (Mr, Kc)
    scale = scale_from_amax(
        block_amax, fmt.max, power_2=power_2, epsilon=epsilon, value_for_inf=dtype_max(x2.dtype)
    )
    dec = reciprocal(scale)
    if fused:
        q, deq16 = fast.cast_blocks(blocks, scale, dec, fmt)
        q = q.view(xp.shape)
    else:
        v = blocks.float() if blocks.dtype != torch.float32 else blocks.clone()
        v = v.mul_(scale[:, None, :, None])  # fp32(x) * scale, rounded to fp32
        q = cast_fp8(v, fmt, inplace=True).view(xp.shape)  # (Mp, Kp)
    out = BlockwiseQuantized(q, dec, (br, bc), shape, columnwise, has_nan, fmt, scale, block_amax, power_2)
    if fused and power_2:
        out._gop = (deq16.view(xp.shape)[: out.m, : out.k].reshape(shape), None)
    return out
