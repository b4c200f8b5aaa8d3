"""TE's own FP8 quantizers behind one call, giving both copies as plain tensors (needs TE and CUDA).

The fields match lowp's `Quantized` pair: rowwise and columnwise codes (`data_row`, `data_col`) and
their scale_inv (`sinv_row`, `sinv_col`). Per-tensor kinds hold one scale_inv for both copies.
"""

from __future__ import annotations

import torch

KINDS = ("delayed", "current", "block")


def te_quantizer(kind: str, kw: dict, device, scale: torch.Tensor | None):
    """TE 2.20.2's quantizer: Float8Quantizer (delayed, a given scale), Float8CurrentScalingQuantizer
    (current: kw pow2, eps) or Float8BlockQuantizer (block: kw dim 1 or 2, pow2); kw fp8 e4m3/e5m2."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex

    if kind not in KINDS:
        raise ValueError(f"TE quantizer kind {kind!r}: choose one of {KINDS}")
    dtype = tex.DType.kFloat8E4M3 if kw["fp8"] == "e4m3" else tex.DType.kFloat8E5M2
    both = {"rowwise": True, "columnwise": True}
    if kind == "delayed":
        return te.Float8Quantizer(scale.clone(), torch.zeros(1, device=device), dtype, **both)
    if kind == "current":
        pow2, eps = kw.get("pow2", False), kw.get("eps", 0.0)
        return te.Float8CurrentScalingQuantizer(
            dtype, device, **both, force_pow_2_scales=pow2, amax_epsilon=eps
        )
    return te.Float8BlockQuantizer(
        dtype, **both, amax_epsilon=0.0, force_pow_2_scales=kw["pow2"], block_scaling_dim=kw["dim"]
    )


def te_quantize(kind: str, kw: dict, x: torch.Tensor, scale: torch.Tensor | None) -> dict:
    """TE's two copies of `x` as {data_row, data_col, sinv_row, sinv_col} (uint8 / fp32 tensors)."""
    t = te_quantizer(kind, kw, x.device, scale)(x)
    if kind in ("delayed", "current"):
        col = t._transpose if getattr(t, "_transpose", None) is not None else None
        return {"data_row": t._data, "data_col": col, "sinv_row": t._scale_inv, "sinv_col": t._scale_inv}
    return {
        "data_row": t._rowwise_data,
        "data_col": t._columnwise_data,
        "sinv_row": t._rowwise_scale_inv,
        "sinv_col": t._columnwise_scale_inv,
    }
