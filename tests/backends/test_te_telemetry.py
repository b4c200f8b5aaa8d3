"""The TE telemetry's pure parts (no TE needed): the activation derivative it recomputes fc1's
gradient with is autograd's of the emulated activation."""

from __future__ import annotations

import enum

import pytest
import torch

from harness.backends.emulated import _act
from harness.backends.te_telemetry import _act_backward, _Row
from harness.numerics.telemetry import tensor_row


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_activation_backward_matches_autograd(kind):
    gen = torch.Generator().manual_seed(0)
    width = 64 if kind == "swiglu" else 32
    h = (3 * torch.randn(128, width, generator=gen, dtype=torch.float64)).requires_grad_(True)
    dy = torch.randn(128, 32, generator=gen, dtype=torch.float64)
    (want,) = torch.autograd.grad(_act(h, kind), h, dy)
    torch.testing.assert_close(_act_backward(h.detach(), dy, kind), want, rtol=1e-12, atol=1e-12)


class _DType(enum.IntEnum):  # TE's transformer_engine.pytorch.constants.DType is an IntEnum
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8


class _Float8Storage:
    """The attributes of TE's Float8TensorStorage that the row reader reads (_data, _fp8_dtype,
    _scale_inv, dequantize)."""

    def __init__(self, codes: torch.Tensor, scale_inv: float, tag):
        self._data = codes.view(torch.uint8)
        self._fp8_dtype, self._scale_inv = tag, torch.tensor([scale_inv])

    def dequantize(self, dtype=torch.float32):
        return self._data.view(torch.float8_e4m3fn).to(dtype) * self._scale_inv


@pytest.mark.parametrize("tag", [_DType.kFloat8E4M3, "DType.kFloat8E4M3"])
def test_row_reader_finds_fp8_codes_whatever_the_dtype_tag(tag):
    """Saturation and scale come from TE's element codes: the tag may be TE's IntEnum (str() gives
    its number on Python >= 3.11) or the pybind11 enum (str() gives its name)."""
    x = torch.tensor([448.0, -448.0, 1.0, 0.5, 0.0, 3.0]) / 4.0
    codes = (x * 4.0).to(torch.float8_e4m3fn)
    row = tensor_row("blocks.0.attn.qkv", "input", x, _Row(_Float8Storage(codes, 0.25, tag), x))
    assert row["saturation"] == pytest.approx(2 / 6) and row["scale"] == pytest.approx(4.0)
