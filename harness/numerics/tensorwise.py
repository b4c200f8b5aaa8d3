"""Per-tensor FP8: delayed scaling (a given scale) and current scaling (scale from this amax).

One scale for the whole tensor, so TE's columnwise copy is the exact byte transpose of the
rowwise one (docs/numerics.md sections 2, 3): both copies share the codes computed here.
"""

from __future__ import annotations

import torch

from harness.numerics import fast
from harness.numerics.formats import FP8Format, cast_fp8, fp8_to_float
from harness.numerics.qtensor import Quantized, as_2d
from harness.numerics.scaling import amax, reciprocal, scale_from_amax


def scaled_fp32(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32(x) * scale, the product rounded to fp32 (TE multiplies in fp32, then casts)."""
    if x.dtype == torch.float32:
        return x * scale
    return x.float().mul_(scale)  # the widening copy is ours: scale in place


class PerTensorQuantized(Quantized):
    """Float8Tensor: `_data`, `_transpose` and `_scale_inv` of TE."""

    def __init__(self, q, scale, scale_inv, fmt, amax_, shape, columnwise, has_nan):
        self.q, self.scale, self._scale_inv, self.fmt = q, scale, scale_inv, fmt
        self.amax, self.shape, self.columnwise, self.has_nan = amax_, torch.Size(shape), columnwise, has_nan

    def _dequantize(self) -> torch.Tensor:
        vals, factor = fp8_to_float(self.q, self.has_nan)
        return vals.mul_(self._scale_inv * factor if factor != 1.0 else self._scale_inv)

    def _gemm_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The FP8 codes themselves (exact in bf16), scale_inv folded into the GEMM (as TE's alpha)."""
        return self.q.to(torch.bfloat16).reshape(self.shape), self._scale_inv.reshape(1)

    @property
    def data(self) -> torch.Tensor:
        codes = self.q.view(torch.uint8)  # (M, K)
        if not self.columnwise:
            return codes.reshape(self.shape)
        return codes.t().contiguous().reshape(self.shape[-1], *self.shape[:-1])

    @property
    def scale_inv(self) -> torch.Tensor:
        return self._scale_inv

    def saturated_count(self) -> torch.Tensor:
        return (self.q.float().abs() == self.fmt.max).sum()

    def telemetry_scale(self) -> torch.Tensor:
        return self.scale.reshape(())


def quantize_per_tensor(
    x: torch.Tensor,
    fmt: FP8Format,
    scale: torch.Tensor,
    *,
    columnwise: bool = False,
    amax_: torch.Tensor | None = None,
    has_nan: bool | None = None,
    fused: bool = False,
) -> PerTensorQuantized:
    """q = satfinite_rne(fp32(x) * scale), scale_inv = 1/scale (delayed scaling's cast).
    `fused`: the cast and the GEMM operand in one pass (harness.numerics.fast; same codes)."""
    x2 = as_2d(x)
    if amax_ is None or has_nan is None:
        amax_, has_nan = amax(x2)
    scale = scale.reshape(1).float()
    q16 = None
    if fused:
        q, q16 = fast.cast_tensor(x2, scale, fmt)
    else:
        q = cast_fp8(scaled_fp32(x2, scale), fmt, inplace=True)  # (M, K)
    out = PerTensorQuantized(q, scale, reciprocal(scale), fmt, amax_.reshape(1), x.shape, columnwise, has_nan)
    if q16 is not None:
        out._gop = (q16.reshape(x.shape), out.scale_inv.reshape(1))
    return out


def current_scale(amax_: torch.Tensor, fmt: FP8Format, *, power_2: bool, epsilon: float) -> torch.Tensor:
    """Float8CurrentScaling's scale: fp8max / max(amax, eps), optionally a power of two."""
    return scale_from_amax(amax_, fmt.max, power_2=power_2, epsilon=epsilon)
