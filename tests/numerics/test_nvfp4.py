"""NVFP4 against TE's pure-PyTorch reference rules, plus worked cases and stochastic rounding.

The oracle below is a small port of transformer_engine/pytorch/custom_recipes/reference_nvfp4.py
(TE's own bit-exact reference of its kernels): cast_to_fp4x2, the 1x16/16x16 block quantization
with the kernel's fl32(S_enc * fl32(1/6)) multiplier, and the fixed-sign Hadamard transform.
Its scalar/tensor divisions are written tensor/tensor (docs/numerics.md's division trap).
"""

from __future__ import annotations

import pytest
import torch

from harness.numerics import quantize
from harness.numerics.nvfp4 import quantize_nvfp4, rht_matrix

FMAX = torch.finfo(torch.float32).max


def ref_cast_to_fp4x2(x):
    r = torch.zeros_like(x, dtype=torch.uint8)
    r[(x > 0.25) & (x < 0.75)] = 1
    r[(x >= 0.75) & (x <= 1.25)] = 2
    r[(x > 1.25) & (x < 1.75)] = 3
    r[(x >= 1.75) & (x <= 2.5)] = 4
    r[(x > 2.5) & (x < 3.5)] = 5
    r[(x >= 3.5) & (x <= 5.0)] = 6
    r[x > 5.0] = 7
    r[(x >= -0.25) & (x < -0.0)] = 8
    r[(x < -0.25) & (x > -0.75)] = 9
    r[(x <= -0.75) & (x >= -1.25)] = 10
    r[(x < -1.25) & (x > -1.75)] = 11
    r[(x <= -1.75) & (x >= -2.5)] = 12
    r[(x < -2.5) & (x > -3.5)] = 13
    r[(x <= -3.5) & (x >= -5.0)] = 14
    r[x < -5.0] = 15
    return r[:, ::2] + r[:, 1::2] * 16


def ref_quantize(x, global_amax, tile_2d):
    m, n = x.shape
    if tile_2d:
        tiles = x.unfold(0, 16, 16).unfold(1, 16, 16).float()
        vec_max = tiles.abs().amax(dim=(-1, -2)).repeat_interleave(16, dim=0).unsqueeze(-1)
    else:
        vec_max = x.view(m, n // 16, 16).abs().amax(-1, keepdim=True).float()
    x = x.view(m, n // 16, 16)
    f4, f8 = torch.tensor(6.0), torch.tensor(448.0)
    enc = torch.min(torch.div(f8 * f4, global_amax), torch.tensor(FMAX))
    enc = torch.where(enc == 0, torch.tensor(1.0), enc)
    dec = torch.div(torch.tensor(1.0), enc)
    sf = torch.clamp(torch.min(vec_max * (enc * torch.reciprocal(f4)), torch.tensor(FMAX)), -f8, f8)
    sf = sf.to(torch.float8_e4m3fn)
    k = torch.min(torch.div(torch.tensor(1.0), sf.float() * dec), torch.tensor(FMAX))
    scaled = torch.clamp(x.float() * k, -f4, f4).reshape(m, n)
    return ref_cast_to_fp4x2(scaled), sf.squeeze(-1).view(torch.uint8)


def ref_rht(xt):
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    s = torch.tensor([1.0, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1])
    m = ((s * torch.eye(16)) @ h).to(xt.dtype) * 0.25
    return (xt.contiguous().view(-1, 16) @ m).view(xt.shape)


def reference(x, tile_2d=False, rht=False):
    col_in = ref_rht(x.t().contiguous()) if rht else x.t().contiguous()
    amax_r, amax_c = x.abs().max().float().view(1), col_in.abs().max().float().view(1)
    return (*ref_quantize(x, amax_r, tile_2d), *ref_quantize(col_in, amax_c, tile_2d), amax_r, amax_c)


def inputs():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(128, 256, generator=g)
    outl = base.clone()
    outl[:, ::37] *= 300
    outl[7] = 0
    return {
        "normal": base.bfloat16(),
        "decades": (base * torch.logspace(-6, 3, 256)).bfloat16(),
        "outliers": outl.bfloat16(),
    }


@pytest.mark.parametrize("name", ["normal", "decades", "outliers"])
@pytest.mark.parametrize(("tile_2d", "rht"), [(False, False), (False, True), (True, False)])
def test_matches_te_reference(name, tile_2d, rht):
    x = inputs()[name]
    qx, sx, qt, st, ar, ac = reference(x, tile_2d, rht)
    row = quantize_nvfp4(x, tile_2d=tile_2d)
    col = quantize_nvfp4(x, columnwise=True, tile_2d=tile_2d, rht=rht)
    assert torch.equal(row.data, qx) and torch.equal(col.data, qt)
    assert torch.equal(row.amax, ar) and torch.equal(col.amax, ac)
    assert torch.equal(row.scale_inv[:128, :16], sx) and torch.equal(col.scale_inv[:256, :8], st)


def test_roles_follow_te_defaults():
    x = inputs()["normal"]
    w = quantize(x, "nvfp4", role="weight")
    assert w.block == (16, 16) and not w.rht
    xc = quantize(x, "nvfp4", role="input", columnwise=True)
    assert xc.block == (16, 1) and xc.rht
    assert quantize(x, "nvfp4", role="input", columnwise=True, disable_rht=True).rht is False
    assert quantize(x, "nvfp4", role="weight", disable_2d_quantization=True).block == (1, 16)


def test_layouts_and_dequantize_formula():
    x = inputs()["normal"][:32, :64]
    row = quantize_nvfp4(x)
    assert row.data.shape == (32, 32) and row.scale_inv.shape == (128, 4)
    col = quantize_nvfp4(x, columnwise=True)
    assert col.data.shape == (64, 16) and col.scale_inv.shape == (128, 4)
    # TE's dequantize: code * fl32(fl32(sf * amax) * fl32(1/2688))
    sf = row.scale_inv[:32].view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    from harness.numerics.formats import e2m1_decode, unpack_fp4

    vals = e2m1_decode(unpack_fp4(row.data))
    want = vals * ((sf * row.amax) * torch.tensor(1 / 2688, dtype=torch.float32))
    assert torch.equal(row.dequantize(), want)


def test_zero_tensor_and_underflowing_block():
    z = quantize_nvfp4(torch.zeros(16, 32))
    assert z.dequantize().eq(0).all() and z.data.eq(0).all()
    x = torch.zeros(16, 32)
    x[0, 0] = 1e6  # the global amax
    x[1, 16] = 1e-3  # its block's E4M3 scale underflows to 0
    q = quantize_nvfp4(x)
    assert q.dequantize()[0, 0] == pytest.approx(1e6, rel=0.1)
    assert q.dequantize()[1, 16] == 0 and q.elems[1, 16] == 6.0  # encodes as 6, decodes to 0


def test_rht_is_orthogonal_and_cancels_in_wgrad():
    m = rht_matrix(torch.device("cpu"))
    assert torch.equal(m @ m.t(), torch.eye(16))
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(64, 48, generator=g).bfloat16()
    xc = quantize(x, "nvfp4", role="input", columnwise=True).dequantize()
    dyc = quantize(dy, "nvfp4", role="grad", columnwise=True, generator=g).dequantize()
    exact = dy.float().t() @ x.float()
    err = (dyc.t() @ xc - exact).norm() / exact.norm()
    assert err < 0.3 and not torch.allclose(xc, x.float(), atol=0.1)  # transformed, yet dW right


def test_stochastic_rounding_reproducible_and_unbiased():
    x = torch.full((64, 1024), 2.6)
    x[:, ::16] = 6.0  # every block's amax is 6: scale ~1, so 2.6 sits between grid points 2 and 3
    a = quantize(x, "nvfp4", role="grad", generator=torch.Generator().manual_seed(1))
    b = quantize(x, "nvfp4", role="grad", generator=torch.Generator().manual_seed(1))
    c = quantize(x, "nvfp4", role="grad", generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
    vals = a.elems.view(64, 64, 16)[:, :, 1:]
    assert set(vals.unique().tolist()) == {2.0, 3.0}
    assert vals.mean().item() == pytest.approx(2.6, abs=0.01)  # unbiased: P(3) = 0.6 (60k draws)
    rn = quantize(x, "nvfp4", role="grad", disable_stochastic_rounding=True)
    assert rn.elems.view(64, 64, 16)[:, :, 1:].eq(3.0).all()


def test_sr_streams_differ_between_copies():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 64, generator=g) * 3).bfloat16()
    row = quantize(x, "nvfp4", role="grad", generator=g, disable_rht=True)
    col = quantize(x, "nvfp4", role="grad", columnwise=True, generator=g, disable_rht=True)
    assert row.dequantize().ne(col.dequantize()).any()


def test_inf_and_nan_elements():
    x = torch.ones(16, 32)
    x[0, 0], x[0, 1], x[5, 20] = float("inf"), -3.0, float("nan")
    q = quantize_nvfp4(x)
    # Inf global amax: S_enc = 2688/Inf = 0 -> 1; the Inf block's scale saturates at 448
    assert q.amax.item() == float("inf") and q.sf[0, 0].float().item() == 448.0
    assert q.elems[0, 0] == 6.0 and q.elems[0, 1] == 0.0  # -3/448 rounds to -0
    assert q.elems[5, 20] == 6.0  # NaN -> +6: E2M1 has no NaN, satfinite (I)
    assert torch.isinf(q.dequantize()[0, 0])  # decodes through amax = Inf
