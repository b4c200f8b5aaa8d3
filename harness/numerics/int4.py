"""INT4 fake quantization-aware training (miles): symmetric groups along the input dim, STE.

docs/numerics.md section 9: per weight W[out, in], zero-pad `in` to a multiple of g; per 1xg group
s = max(fp32(amax)/7, 1e-5) (true division), q = clamp(round(W/s), -7, 7) (half to even),
W_hat = bf16(q * s). Backward is straight-through: dL/dW = dL/dW_hat.
"""

from __future__ import annotations

import torch

from harness.numerics.formats import INT4_MAX, int4_round
from harness.numerics.qtensor import Quantized, as_2d, block_view, pad2d
from harness.numerics.scaling import amax, const

MIN_SCALE = 1e-5


class Int4Quantized(Quantized):
    """int8 codes in [-7, 7] (x's shape) and fp32 group scales `.scale` (out, in/g)."""

    def __init__(self, q, scale, group, shape, out_dtype):
        self.q, self.scale, self.group = q, scale, group
        self.shape, self.out_dtype = torch.Size(shape), out_dtype

    def _dequantize(self) -> torch.Tensor:
        m, k = self.shape.numel() // self.shape[-1], self.shape[-1]
        vals = block_view(self.q.float(), 1, self.group) * self.scale[:, None, :, None]
        return vals.view(self.q.shape)[:m, :k].to(self.out_dtype).float()  # W_hat = dtype(q*s)

    @property
    def data(self) -> torch.Tensor:
        m, k = self.shape.numel() // self.shape[-1], self.shape[-1]
        return self.q[:m, :k].to(torch.int8).reshape(self.shape)

    def saturated_count(self) -> torch.Tensor:
        return (self.q.abs() == INT4_MAX).sum()

    def telemetry_scale(self) -> torch.Tensor:
        return torch.div(const(1.0, self.scale), self.scale.max())  # 1/s of the largest group


def quantize_int4(w: torch.Tensor, group_size: int, out_dtype=torch.bfloat16) -> Int4Quantized:
    """Groups of `group_size` along the last dim; out_dtype is the weight dtype W_hat is cast to."""
    w2 = as_2d(w)
    blocks = block_view(pad2d(w2, 1, group_size).float(), 1, group_size)  # (out, 1, in/g, g)
    group_amax, _ = amax(blocks, dim=(1, 3))  # (out, in/g)
    scale = torch.clamp_min(torch.div(group_amax, const(float(INT4_MAX), group_amax)), MIN_SCALE)
    q = int4_round(torch.div(blocks, scale[:, None, :, None]))  # W / s, tensor / tensor
    return Int4Quantized(q.view(blocks.shape[0], -1), scale, group_size, w.shape, out_dtype)


class _FakeInt4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, group_size):
        ctx.dtype = w.dtype
        return quantize_int4(w, group_size).dequantize().to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None  # straight-through


def fake_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W_hat in bf16 with a straight-through gradient (in W's dtype)."""
    return _FakeInt4.apply(w, group_size)
