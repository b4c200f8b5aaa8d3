"""Numerics telemetry: how a quantized tensor compares with its high-precision source.

Rows are computed only inside `collect()` (the backend's `collect_telemetry()`); outside it the
quantizers never call into this module, so telemetry costs nothing when off.
"""

from __future__ import annotations

import contextlib
import math

import torch

# the columns of a telemetry row (numerics.jsonl; analysis/keys.py repeats them, test_contract checks)
LAYER, TENSOR = "layer", "tensor"
TENSORS = ("input", "weight", "grad")
AMAX, SCALE, UNDERFLOW, SATURATION, SQNR_DB = "amax", "scale", "underflow", "saturation", "sqnr_db"
STATS = (AMAX, SCALE, UNDERFLOW, SATURATION, SQNR_DB)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's compute_error); inf when exact."""
    x64, y64 = x.double(), y.double()
    signal = float(x64.square().sum())
    noise = float((x64 - y64).square().sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def tensor_row(layer: str, tensor: str, x: torch.Tensor, q) -> dict:
    """One row: amax, scale, underflow (non-zeros flushed to zero), saturation (codes at +-max), SQNR."""
    x = x.float().reshape(-1)
    deq = q.dequantize().reshape(-1)
    nonzero = x != 0
    n_nonzero = int(nonzero.sum())
    flushed = int((nonzero & (deq == 0)).sum())
    sat = getattr(q, "saturated_count", None)
    scale = getattr(q, "telemetry_scale", None)
    return {
        LAYER: layer,
        TENSOR: tensor,
        AMAX: float(x.abs().max()) if x.numel() else 0.0,
        SCALE: float(scale()) if scale is not None else None,
        UNDERFLOW: flushed / n_nonzero if n_nonzero else 0.0,
        SATURATION: float(sat()) / x.numel() if sat is not None and x.numel() else None,
        SQNR_DB: sqnr_db(x, deq),
    }


class TelemetrySink:
    """Where rows go while collecting; `rows is None` means off."""

    def __init__(self):
        self.rows: list[dict] | None = None

    @property
    def active(self) -> bool:
        return self.rows is not None

    def add(self, layer: str, tensor: str, x: torch.Tensor, q) -> None:
        if self.rows is not None:
            with torch.no_grad():
                self.rows.append(tensor_row(layer, tensor, x, q))

    @contextlib.contextmanager
    def collect(self):
        """`with sink.collect() as rows:` fills `rows` with one dict per quantized operand."""
        rows: list[dict] = []
        previous, self.rows = self.rows, rows
        try:
            yield rows
        finally:
            self.rows = previous
