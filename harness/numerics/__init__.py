"""lowp's emulation of Transformer Engine 2.20.2 numerics in pure PyTorch (docs/numerics.md).

Flat modules, one job each: `formats` (E4M3/E5M2/E8M0/E2M1/INT4), `scaling` (amax and scales),
`delayed` (amax histories), `tensorwise`, `blockwise`, `mxfp8`, `nvfp4`, `int4` (quantizers of
one copy), `quantizers` (per-role objects), `custom` (user factories), `context` (the precision
context and update timing), `linear` (the emulated TE Linear), `telemetry`, `api` (`quantize`).
No Hydra, training-loop or logging imports here.
"""

from harness.numerics.api import quantize, resolve_recipe
from harness.numerics.context import NumericsContext
from harness.numerics.linear import QuantizedLinear
from harness.numerics.qtensor import Quantized
from harness.numerics.quantizers import Quantizer, make_quantizer

__all__ = [
    "NumericsContext",
    "Quantized",
    "QuantizedLinear",
    "Quantizer",
    "make_quantizer",
    "quantize",
    "resolve_recipe",
]
