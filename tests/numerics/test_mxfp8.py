"""MXFP8: an independent per-block oracle (docs/numerics.md section 5, TE's float_to_e8m0 and
exp2f_rcp) and worked cases: E8M0 round-up, zero blocks, NaN/Inf, subnormal scales, ties."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from harness.numerics import quantize

NAN, INF = float("nan"), float("inf")


def oracle_e8m0(v: np.float32) -> int:
    if math.isnan(v):
        return 255
    if math.isinf(v):
        return 254
    if v == 0:
        return 0
    bits = struct.unpack("<I", struct.pack("<f", float(v)))[0]
    exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if mant > 0 and exp != 0xFE and not (exp == 0 and mant <= 0x400000):
        exp += 1
    return exp


def oracle_block(block: np.ndarray, fmax: float, dtype) -> tuple[list[int], int]:
    finite = block[~np.isnan(block)]
    amax = np.float32(np.max(np.abs(finite))) if finite.size else np.float32(0)
    e = oracle_e8m0(np.float32(amax * np.float32(1.0 / fmax)))
    scale = NAN if e == 255 else math.ldexp(1.0, 127 - e)  # docs/numerics.md section 5: 2^(127-e)
    scaled = torch.from_numpy((block.astype(np.float32) * np.float32(scale)).astype(np.float32))
    q = scaled.clamp(-fmax, fmax).to(dtype)
    return q.view(torch.uint8).tolist(), e


def oracle(x: torch.Tensor, columnwise: bool, fmax=448.0, dtype=torch.float8_e4m3fn):
    a = x.float().numpy()
    if columnwise:
        a = a.T
    m, k = a.shape
    codes = np.zeros((m, k), dtype=np.uint8)
    scales = np.zeros((m, k // 32), dtype=np.uint8)
    for i in range(m):
        for j in range(k // 32):
            c, e = oracle_block(a[i, 32 * j : 32 * (j + 1)], fmax, dtype)
            codes[i, 32 * j : 32 * (j + 1)], scales[i, j] = c, e
    if columnwise:
        codes, scales = codes.T, scales.T
    return torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales))


def inputs():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-6, 4, 96)
    x[3, :32] = 0.0  # a zero block
    x[5, 40] = 449.0  # forces a round-up to the next power of two
    x[9, :32] = 1e-38  # amax * (1/448) is subnormal (<= 2^-127): e = 0
    return x.bfloat16()


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("role", ["input", "grad"])
def test_mxfp8_matches_oracle(columnwise, role):
    x = inputs()
    fmt = {"input": (448.0, torch.float8_e4m3fn), "grad": (57344.0, torch.float8_e5m2)}[role]
    q = quantize(x, "mxfp8", role=role, columnwise=columnwise, fp8="e4m3" if role == "input" else "hybrid")
    want_codes, want_e = oracle(x, columnwise, *fmt)
    assert torch.equal(q.data, want_codes)
    valid = q.scale_inv[: want_e.shape[0], : want_e.shape[1]]
    assert torch.equal(valid, want_e)


def test_worked_blocks():
    x = torch.zeros(32, 32)
    x[0, :] = torch.linspace(-448, 448, 32)  # amax 448: e = 127, elements cast unscaled
    x[1, 0] = 449.0  # 449/448 rounds up to 2: e = 128, scale 1/2
    x[2, 0], x[2, 1] = INF, 3.0  # Inf amax: e = 254, kernel scale 2^-127: Inf -> 448, 3 -> 0
    x[3, 0], x[3, 1] = NAN, 3.0  # NaN ignored by the amax; stays NaN
    x[4, 0] = 1e-38  # subnormal scale: e = 0, kernel scale 2^127: 1.7 -> 1.75, kept
    x[5, 0], x[5, 1] = 1.125, 1.0625  # 1.125/448 -> 2^-8 (e = 119, scale 256): 288 exact, 272 a tie
    q = quantize(x, "mxfp8", role="input")
    e = q.scale_inv[:6, 0].tolist()
    assert e == [127, 128, 254, 120, 0, 119]  # 3/448 = 2^-7.2 rounds up to 2^-7
    assert e[3] == oracle_e8m0(np.float32(3.0) * np.float32(1 / 448))
    deq = q.dequantize()
    assert torch.equal(deq[0], x[0].to(torch.float8_e4m3fn).float())
    assert deq[1, 0] == 448.0  # 449 * 0.5 = 224.5 -> 224 (RNE), times 2
    assert deq[2, 1] == 0 and q.data[2, 0].view(torch.float8_e4m3fn).float() == 448.0
    assert math.isnan(deq[3, 0]) and deq[3, 1] == 3.0
    assert q.data[4, 0].view(torch.float8_e4m3fn).float() == 1.75 and q.data[4, 1:].eq(0).all()
    assert deq[5, 0] == 1.125 and deq[5, 1] == 1.0  # 272: tie of 256 and 288 -> 256 (even)
    assert q.data[2:4].sum() > 0  # zero rows elsewhere stay code 0
    assert q.data[6:].eq(0).all() and q.scale_inv[6:32, 0].eq(0).all()


def test_layouts():
    x = torch.randn(64, 128).bfloat16()
    row = quantize(x, "mxfp8", role="input")
    col = quantize(x, "mxfp8", role="input", columnwise=True)
    assert row.data.shape == col.data.shape == (64, 128)  # TE keeps MXFP8 columnwise untransposed
    assert row.scale_inv.shape == (128, 4) and row.scale_inv[64:].eq(0).all()
    assert col.scale_inv.shape == (4, 128) and col.scale_inv[2:].eq(0).all()
    deq = row.dequantize()
    scale = torch.exp2(row.scale_inv[:64].float() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(deq, row.data.view(torch.float8_e4m3fn).float() * scale)


def _edge_blocks(columnwise: bool) -> torch.Tensor:
    """Rows (or columns) of 32: amax at and below 448 * 2^-127 (E8M0 byte 0), +-Inf with finite
    neighbours, and an ordinary block beside them."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    x[0, :32] = torch.linspace(-1, 1, 32) * (448 * 2.0**-127)  # amax exactly 448 * 2^-127: e = 0
    x[1, :32] = torch.linspace(-1, 1, 32) * 1e-39  # amax/448 subnormal far below 2^-127: e = 0
    x[2, :32], x[2, 5], x[2, 9] = 2.0, INF, -INF  # e = 254: +-Inf -> +-448, the 2.0s -> 0
    x[3, :32], x[3, 7] = -INF, 1e30  # e = 254 again, all but one element -Inf
    return x.T.contiguous() if columnwise else x


@pytest.mark.parametrize("columnwise", [False, True])
def test_e8m0_byte_0_and_inf_blocks_as_te_2_13(columnwise):
    """TE >= 2.13's exp2f_rcp: byte 0 scales by 2^127 (the block survives), byte 254 by 2^-127
    (an Inf becomes +-448 under satfinite, not NaN)."""
    x = _edge_blocks(columnwise)
    q = quantize(x, "mxfp8", role="input", columnwise=columnwise, fp8="e4m3")
    want_codes, want_e = oracle(x, columnwise)
    assert torch.equal(q.data, want_codes)
    assert torch.equal(q.scale_inv[: want_e.shape[0], : want_e.shape[1]], want_e)
    vals = q.data.view(torch.float8_e4m3fn).float()
    rows = vals.T if columnwise else vals  # (4, 64) in _edge_blocks' orientation
    e = want_e.T if columnwise else want_e
    assert e[:2, 0].tolist() == [0, 0] and e[2:, 0].tolist() == [254, 254]
    assert rows[0, 31] == 448.0 and rows[0, 0] == -448.0  # 448 * 2^-127 * 2^127
    assert rows[1, :32].ne(0).sum() >= 30  # 1e-39 * 2^127 ~ 0.17: kept, not flushed
    assert (rows[2, 5], rows[2, 9]) == (448.0, -448.0) and rows[2, :5].eq(0).all()
    assert rows[3, 0] == -448.0 and rows[3, 7] == 0.0
    assert not torch.isnan(vals).any()
