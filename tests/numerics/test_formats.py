"""Element formats: worked cases of docs/numerics.md section 0 (saturation, ties, E8M0 rounding up)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.numerics.formats import (
    E4M3,
    E5M2,
    cast_fp8,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    e8m0_decode,
    e8m0_encode,
    e8m0_quant_scale,
    fp8_to_float,
    int4_round,
    pack_fp4,
    unpack_fp4,
)

NAN, INF = float("nan"), float("inf")


def codes(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).tolist()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_fp8_cast_saturates_and_keeps_nan(fmt):
    x = torch.tensor([1e9, -1e9, INF, -INF, fmt.max, 61440.0, NAN])
    y = cast_fp8(x, fmt).float()
    assert y[:4].tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max]
    assert y[4] == fmt.max and y[5] == min(fmt.max, 61440.0)
    assert math.isnan(y[6])


def test_fp8_rne_ties_in_subnormals():
    # E4M3 subnormal quantum 2^-9: 2^-10 is the tie between 0 and code 1 (-> 0, even),
    # 1.5 * 2^-9 between codes 1 and 2 (-> 2, even); anything above 2^-10 rounds up
    x = torch.tensor([2**-10, 2**-10 * 1.0001, 1.5 * 2**-9, 2.5 * 2**-9])
    assert codes(cast_fp8(x, E4M3)) == [0, 1, 2, 2]
    # E5M2: quantum 2^-16, tie 2^-17 -> 0, 1.5 * 2^-16 -> code 2
    assert codes(cast_fp8(torch.tensor([2**-17, 1.5 * 2**-16]), E5M2)) == [0, 2]


def test_fast_e4m3_decode_matches_torch_on_every_code():
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~torch.isnan(q.float())
    vals, factor = fp8_to_float(q[finite], has_nan=False)
    assert torch.equal(vals * factor, q[finite].float())
    slow, one = fp8_to_float(q, has_nan=True)  # NaN codes take torch's own conversion
    assert one == 1.0 and torch.isnan(slow).sum() == 2


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (1.0, 127),  # exact power of two: no rounding
        (1.0000001, 128),  # any mantissa bit rounds up (torch's cast gives 127)
        (1.25, 128),  # torch's cast gives 127
        (1.5, 128),
        (2.0**-127, 0),  # subnormal with mantissa 0x400000: stays 0
        (2.0**-127 + 2.0**-149, 1),  # just above: rounds up to 2^-126
        (2.0**-149, 0),
        (0.0, 0),
        (2.0**127, 254),
        (1.5 * 2.0**127, 254),  # exponent 0xFE saturates, no round up
        (INF, 254),
        (NAN, 255),
    ],
)
def test_e8m0_rounds_up(value, code):
    assert e8m0_encode(torch.tensor([value], dtype=torch.float32)).item() == code


def test_e8m0_differs_from_torch_cast():
    v = torch.tensor([1.25, 1.0000001])
    assert e8m0_encode(v).tolist() == [128, 128]
    assert v.to(torch.float8_e8m0fnu).view(torch.uint8).tolist() == [127, 127]


def test_e8m0_decode_and_kernel_scale():
    e = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8)
    dec = e8m0_decode(e)
    assert dec[:5].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127] and math.isnan(dec[5])
    # TE's exp2f_rcp (>= 2.13): 2^(127-e), e=254 -> the subnormal 2^-127, e=255 -> NaN
    k = e8m0_quant_scale(e)
    assert k[:5].tolist() == [2.0**127, 2.0**126, 1.0, 0.5, 2.0**-127] and math.isnan(k[5])


E2M1_TIES = [  # (scaled value, grid value): RNE on the code's parity, saturation at 6
    (0.25, 0.0),
    (0.26, 0.5),
    (0.75, 1.0),
    (1.25, 1.0),
    (1.75, 2.0),
    (2.5, 2.0),
    (3.5, 4.0),
    (5.0, 4.0),
    (5.01, 6.0),
    (6.5, 6.0),
    (1e30, 6.0),
    (INF, 6.0),
    (-0.75, -1.0),
    (-5.0, -4.0),
    (-INF, -6.0),
]


def test_e2m1_rne_table():
    v = torch.tensor([a for a, _ in E2M1_TIES])
    assert e2m1_round(v.clone()).tolist() == [b for _, b in E2M1_TIES]


def test_e2m1_signed_zero_and_nan():
    q = e2m1_round(torch.tensor([-0.1, -0.0, 0.0, NAN]))
    assert e2m1_encode(q).tolist() == [8, 8, 0, 7]  # tiny negatives keep the sign; NaN -> +6 (I)


def test_e2m1_codes_roundtrip_and_packing():
    grid = torch.tensor(
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    )
    c = e2m1_encode(grid)
    assert c.tolist() == list(range(16))
    assert torch.equal(e2m1_decode(c), grid)
    packed = pack_fp4(c.view(1, 16))
    assert packed[0, 0].item() == 0x10  # element 0 in the low nibble, element 1 in the high one
    assert torch.equal(unpack_fp4(packed), c.view(1, 16))


def test_int4_round_half_even_and_clamp():
    v = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 6.6, 7.5, -9.0])
    assert int4_round(v).tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 7.0, 7.0, -7.0]
