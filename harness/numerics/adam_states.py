"""FusedAdam's optimizer-state encodings (docs/numerics.md sections 7-8): pure functions on tensors.

What Transformer Engine's ``FusedAdam`` stores for each ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` /
``--main-params-dtype`` (read from TE's ``pytorch/optimizers/fused_adam.py`` and
``common/multi_tensor/adam.cu``):

- fp32 states are plain; bf16 states are RNE casts; fp16 states (and fp16 masters) keep one fp32
  multiplier ``s = absmax / 32752`` per tensor and store ``fp16(x * (1/s))`` (``1/s`` -> 0 when s = 0);
  fp8 states are E4M3 codes with ``s = absmax / 448``, ``scale = 1/s``, ``q = satfinite_rne(x * scale)``
  and ``scale_inv = 1/scale`` (two reciprocals, as TE's Float8Quantizer does).
- The kernel's math (``adamw_update_``) is evaluated op by op in fp32 with TE's operand order and
  fp32-rounded hyper-parameters (``hyperparameters``); bias corrections ``1 - beta**step`` come from a
  double ``pow`` on the host, as in ``compute_bias_correction``. The quantization (codes and scales from
  given fp32 values) is exact; bit equality of the math with the GPU is not claimed (docs/numerics.md §8).

The optimizer built on these is `harness.optim.emulated_adam.PrecisionAwareAdamW`.
"""

from __future__ import annotations

import struct

import torch

FP8_MAX = 448.0
FP16_RANGE = torch.finfo(torch.float16).max / 2.0  # TE's dtype_to_range_map: 32752
STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
# bytes per element, and per tensor for the scales as stored here (fp8: quantizer.scale + scale_inv)
ELEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
SCALE_BYTES = {"fp32": 0, "bf16": 0, "fp16": 4, "fp8": 8}


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32, as passing it to a CUDA kernel's ``float`` does."""
    return struct.unpack("f", struct.pack("f", x))[0]


def quantize(x: torch.Tensor, fmt: str, guard: bool = False) -> tuple:
    """Re-quantize an fp32 tensor with a current per-tensor scale, as TE's ``FusedAdam._apply_scale``.

    Returns (stored, fp8 quantizer scale or None, dequant multiplier or None, s). fp16 and fp8 scale
    ``x`` in place (TE does too: it is a temporary). Divisions are tensor by tensor: torch's CPU
    ``scalar / tensor`` is not correctly rounded (docs/numerics.md §0).
    """
    if fmt in ("fp32", "bf16"):
        return x.to(STORAGE[fmt]), None, None, None
    lo, hi = torch.aminmax(x)  # NaN propagates, as in TE
    absmax = torch.maximum(hi, -lo).reshape(1)  # all zeros: +0, so s = +0 and scale = +Inf
    s = torch.div(absmax, torch.full_like(absmax, FP8_MAX if fmt == "fp8" else FP16_RANGE))
    if fmt == "fp16":
        x.mul_(torch.where(s > 0, torch.reciprocal(s), torch.zeros_like(s)))
        return x.to(torch.float16), None, s, s
    scale = torch.reciprocal(s)  # s = 0 -> Inf -> 0 * Inf = NaN codes: TE has no guard here
    if guard:
        scale = torch.where(s == 0, torch.ones_like(s), scale)
    codes = x.mul_(scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # satfinite; NaN kept
    return codes, scale, torch.reciprocal(scale), s


def decode_e4m3_over_256(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 value / 256 for every code but NaN (0x7F/0xFF give +-1.875), via fp16 bits.

    Shifting the 7 exponent-mantissa bits into an fp16 lands every E4M3 number, subnormals included,
    on exactly value * 2^-8; torch's own fp8 -> fp32 cast is several times slower on CPU.
    """
    bits = (codes.view(torch.int8).to(torch.int16) << 7) & -16385  # sign-extended: clear bit 14
    return bits.view(torch.float16).float()


def dequantize(stored: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    """fp32 working copy ``q * scale_inv`` (fp8, fp16), a cast (bf16), or the tensor itself (fp32)."""
    if stored.dtype == torch.float32:
        return stored
    if stored.dtype != torch.float8_e4m3fn:
        x = stored.float()
        return x if scale_inv is None else x.mul_(scale_inv)
    # (q / 256) * (256 * si) rounds once, like q * si; NaN codes exist only when si is 0, Inf or NaN
    si = scale_inv.item()
    if 0.0 < si < float("inf"):
        return decode_e4m3_over_256(stored).mul_(scale_inv * 256.0)
    return stored.float().mul_(scale_inv)


def adamw_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: tuple) -> None:
    """TE's ADAM_MODE_1 ``adam_update`` on fp32 tensors, in place, one rounded op at a time."""
    beta1, beta2, one_minus_beta1, one_minus_beta2, bc1, bc2, lr, eps, wd = hp
    m.mul_(beta1).add_(g * one_minus_beta1)  # m = beta1 * m + (1 - beta1) * g
    t = g * one_minus_beta2
    v.mul_(beta2).add_(t.mul_(g))  # v = beta2 * v + (1 - beta2) * g * g
    torch.div(v, bc2, out=t)
    t.sqrt_().add_(eps)  # denom = sqrt(v / bc2) + eps
    update = torch.div(m, bc1).div_(t)
    if wd != 0.0:
        update.add_(torch.mul(p, wd, out=t))  # + wd * p
    p.sub_(update.mul_(lr))  # p = p - lr * update


def hyperparameters(group: dict) -> tuple:
    """The kernel's float arguments: every value rounded to fp32, bias corrections from double pow."""
    beta1, beta2 = (f32(b) for b in group["betas"])
    bc1, bc2 = f32(1.0 - beta1 ** group["step"]), f32(1.0 - beta2 ** group["step"])
    lr, eps, wd = f32(group["lr"]), f32(group["eps"]), f32(group["weight_decay"])
    return beta1, beta2, f32(1.0 - beta1), f32(1.0 - beta2), bc1, bc2, lr, eps, wd
