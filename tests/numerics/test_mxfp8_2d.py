"""MXFP8 2D weights (recipe.enable_2d_quantization; docs/numerics.md "MXFP8 2D weights").

Hand-computed 32x32 tiles: each tile's E8M0 is ceil(log2(tile amax / 448)) + 127 (TE's
float_to_e8m0 of amax * fl32(1/448), rounded up), every 1x32 row block and 32x1 column block of the
tile carries it, and the codes are the elements times 2^(127 - e) cast to E4M3 (torch's own
round-to-nearest-even cast here), the same in both copies. Only weights get tiles (TE 2.20.2
quantization.py:1536-1547).
"""

from __future__ import annotations

import math

import torch

from harness.numerics import NumericsContext, QuantizedLinear, make_quantizer, quantize, resolve_recipe

BF16 = torch.bfloat16
TILE_AMAX = [[448.0, 100.0], [1.0, 0.3]]  # (2 x 2 tiles of 32 x 32)


def _weight():
    """(64, 64) bf16 with each tile's amax set exactly and other elements below it."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(64, 64, generator=g) * 2 - 1  # in (-1, 1)
    w *= torch.exp2(-(torch.arange(64) % 8).float())[:, None]  # rows a few binades apart
    for i in range(2):
        for j in range(2):
            a = TILE_AMAX[i][j]
            tile = w[32 * i : 32 * i + 32, 32 * j : 32 * j + 32]
            tile.mul_(a * 0.9)
            tile[5 + i, 7 + j] = -a  # the tile's amax, placed off the block diagonal
    return w.to(BF16)


def _e8m0(a: float) -> int:
    return math.ceil(math.log2(a / 448.0)) + 127  # no amax here makes a/448 land on a power of two's edge


def test_tiles_hand_computed():
    w = _weight()
    recipe = resolve_recipe("mxfp8", enable_2d_quantization=True)
    row = quantize(w, recipe, role="weight")
    col = quantize(w, recipe, role="weight", columnwise=True)
    e = torch.tensor([[_e8m0(a) for a in r] for r in TILE_AMAX], dtype=torch.uint8)  # (2, 2)
    assert e.tolist() == [[127, 125], [119, 117]]
    want_row = e.repeat_interleave(32, 0)  # rowwise scales (M, K/32)
    want_col = e.repeat_interleave(32, 1)  # columnwise scales (M/32, K)
    assert torch.equal(row.scale_inv[:64, :2], want_row)
    assert torch.equal(col.scale_inv[:2, :64], want_col)
    scale = torch.exp2(127.0 - e.float()).repeat_interleave(32, 0).repeat_interleave(32, 1)  # (64, 64)
    codes = (w.float() * scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(row.data, codes)
    assert torch.equal(col.data, codes)  # the copies share codes
    assert torch.equal(row.dequantize(), col.dequantize())


def test_without_the_flag_blocks_are_1x32():
    w = _weight()
    row = quantize(w, resolve_recipe("mxfp8"), role="weight")
    col = quantize(w, resolve_recipe("mxfp8"), role="weight", columnwise=True)
    assert not torch.equal(row.data, col.data)  # 1x32 and 32x1 blocks scale differently
    assert len(set(row.scale_inv[:32, 0].tolist())) > 1


def test_only_weights_get_tiles():
    recipe = resolve_recipe("mxfp8", enable_2d_quantization=True)
    assert "32x32" in repr(make_quantizer(recipe, "weight"))
    assert "1x32" in repr(make_quantizer(recipe, "input")) and "1x32" in repr(make_quantizer(recipe, "grad"))


def test_linear_uses_tiled_weight_copies():
    """dgrad reads the columnwise weight copy: with tiles it has the rowwise copy's codes."""
    recipe = resolve_recipe("mxfp8", enable_2d_quantization=True)
    lin = QuantizedLinear("blocks.0.attn.proj", recipe, NumericsContext(), fast_gemm=False)
    w = torch.nn.Parameter(_weight().float())
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    lin.linear(x, w, None).backward(torch.ones(64, 64, dtype=BF16))
    wr, wc = lin._weight_cache[:2]
    assert torch.equal(wr.data, wc.data)
