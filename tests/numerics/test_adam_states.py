"""FusedAdam's state encodings (harness.numerics.adam_states) against hand computations of
docs/numerics.md section 8 and an independent E4M3 encoder, exactly."""

from __future__ import annotations

import numpy as np
import torch

from harness.numerics.adam_states import decode_e4m3_over_256, dequantize, quantize
from tests.numerics.references.e4m3 import ALL_CODES, e4m3_codes

f32 = np.float32


def test_fp8_encoding_worked_example():
    x = torch.tensor([11.0, -5.5, 0.3, 1e-3, -2e-5, 0.0])
    codes, scale, scale_inv, s = quantize(x.clone(), "fp8")
    # by hand: s = fl32(11/448), scale = fl32(1/s), scale_inv = fl32(1/scale) != s (two reciprocals)
    s_ref = f32(11.0) / f32(448.0)
    scale_ref = f32(1.0) / s_ref
    assert s.item() == s_ref and scale.item() == scale_ref == f32(40.727272)
    assert scale_inv.item() == f32(1.0) / scale_ref == f32(0.024553573) != s_ref
    # 11 -> 447.99998 -> 448 (0x7E); -5.5 -> -224 (0xF6); 0.3 -> 12.2 -> 12 (0x54);
    # 1e-3 -> 0.0407 -> 10 * 2^-8 (0x12); -2e-5 -> -8.1e-4 < 2^-10 -> -0 (0x80); 0 -> 0x00
    expected = [0x7E, 0xF6, 0x54, 0x12, 0x80, 0x00]
    assert codes.view(torch.uint8).tolist() == expected
    assert e4m3_codes(x.numpy() * scale_ref).tolist() == expected
    # absmax 0.5: scale = 895.99994, not 448/0.5; its element still saturates onto 448
    codes, scale, _, _ = quantize(torch.tensor([0.5, -0.5]), "fp8")
    assert scale.item() == f32(895.99994) and codes.view(torch.uint8).tolist() == [0x7E, 0xFE]


def test_fp8_encoding_random_matches_reference_and_decodes_within_resolution():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=gen) * torch.logspace(-6, 2, 20000)
    codes, scale, scale_inv, _ = quantize(x.clone(), "fp8")
    ref = e4m3_codes(x.numpy() * f32(scale.item()))
    assert np.array_equal(codes.view(torch.uint8).numpy(), ref)
    back = dequantize(codes, scale_inv)
    assert torch.equal(back, codes.float() * scale_inv)  # TE's get_unscaled_state: q * scale_inv
    # E4M3: 3 mantissa bits -> relative error <= 2^-4; below 2^-6 absolute steps of 2^-9
    err = (back - x).abs()
    assert bool((err <= x.abs() * 2**-4 + 2**-10 * scale_inv * 1.0001).all())
    assert (codes.view(torch.uint8) & 0x7F).max().item() == 0x7E


def test_fast_decode_is_exact_for_every_code():
    fast = decode_e4m3_over_256(ALL_CODES) * 256
    ref = ALL_CODES.float()
    finite = ~torch.isnan(ref)
    assert torch.equal(fast[finite], ref[finite]) and int(finite.sum()) == 254
    si = torch.tensor([0.0])  # NaN codes with scale_inv 0 (the zero-state hazard) stay NaN
    assert torch.isnan(dequantize(ALL_CODES, si)[0x7F]).item()
