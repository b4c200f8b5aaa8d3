"""Quantized results: what `quantize` returns, with `.dequantize()`, `.data` and `.scale_inv`.

Each result keeps the codes in x's orientation (padded to whole blocks) and one dequantization
multiplier per block; TE's storage layouts (`.data`, `.scale_inv`) are built lazily on access,
so the training path pays only for `.dequantize()`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from harness.numerics.formats import fp8_to_float


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """(..., K) -> (M, K), the matrix TE's kernels see."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def pad2d(x2: torch.Tensor, rmult: int, cmult: int) -> torch.Tensor:
    """Zero-pad a matrix to whole blocks (zeros never raise an amax)."""
    m, k = x2.shape
    pr, pc = (-m) % rmult, (-k) % cmult
    return F.pad(x2, (0, pc, 0, pr)) if pr or pc else x2


def block_view(xp: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """(Mp, Kp) -> (Mp/br, br, Kp/bc, bc): 1xb rows, bx1 columns and bxb tiles alike."""
    mp, kp = xp.shape
    return xp.view(mp // br, br, kp // bc, bc)


def pad_last(t: torch.Tensor, mult: int, value: float = 0) -> torch.Tensor:
    """Pad the last dim to a multiple (TE pads scale tensors for cuBLAS)."""
    p = (-t.shape[-1]) % mult
    return F.pad(t, (0, p), value=value) if p else t


def round_up(n: int, mult: int) -> int:
    return math.ceil(n / mult) * mult


class Quantized:
    """Common interface. Subclasses set `shape`, `columnwise` and implement `_dequantize`."""

    shape: torch.Size
    columnwise: bool = False
    amax: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    _deq: torch.Tensor | None = None
    _gop: tuple | None = None
    _source: Quantized | None = None  # set on a twin copy that shares another's codes

    def dequantize(self) -> torch.Tensor:
        """float32 values in x's shape and orientation (cached: GEMMs read it twice)."""
        if self._deq is None:
            src = self._source
            self._deq = src.dequantize() if src is not None else self._dequantize().reshape(self.shape)
        return self._deq

    def _dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def gemm_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values, post_scale) for the fast GEMM (harness.numerics.fast): values in x's shape and
        orientation, exact in their dtype (bf16 where every dequantized value is), post_scale a
        one-element fp32 tensor or None; values @ B * post_scale is this copy's GEMM (cached)."""
        if self._gop is None:
            src = self._source
            self._gop = src.gemm_operand() if src is not None else self._gemm_operand()
        return self._gop

    def _gemm_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.dequantize(), None

    @property
    def data(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def scale_inv(self) -> torch.Tensor | None:
        return None

    # telemetry hooks (numerics/telemetry.py)
    def saturated_count(self) -> torch.Tensor:
        """Elements whose code is +-max of the element format."""
        raise NotImplementedError

    def telemetry_scale(self) -> torch.Tensor:
        """The scale applied to the largest-magnitude element (per-tensor: the tensor's scale)."""
        raise NotImplementedError


class BlockQuantized(Quantized):
    """Codes in x's orientation on a grid of (br x bc) blocks, with one fp32 multiplier per block.

    `elems` holds the element codes, padded to whole blocks: a float8 tensor (FP8 formats) or
    fp32 values on the E2M1 grid (FP4; bf16 from the CUDA kernel, the same values). `dec`
    (Mp/br, Kp/bc) multiplies them back.
    """

    def __init__(self, elems, dec, block, shape, columnwise, has_nan=False):
        self.elems, self.dec, self.block = elems, dec, block
        self.shape, self.columnwise, self.has_nan = torch.Size(shape), columnwise, has_nan
        self.m = math.prod(self.shape[:-1])
        self.k = self.shape[-1]

    def _values(self) -> tuple[torch.Tensor, float]:
        """(element values / factor, factor): FP8 decoding may defer a power-of-two factor."""
        if self.elems.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return fp8_to_float(self.elems, self.has_nan)
        return self.elems, 1.0

    def _dequantize(self) -> torch.Tensor:
        vals, factor = self._values()
        blocks = block_view(vals, *self.block)  # (Mp/br, br, Kp/bc, bc)
        dec = self.dec if factor == 1.0 else self.dec * factor
        dec = dec[:, None, :, None]
        out = blocks.mul_(dec) if vals is not self.elems else blocks * dec  # in place when fresh
        return out.view(self.elems.shape)[: self.m, : self.k]

    exact_bf16 = True  # every dequantized value is exact in bf16 (power-of-two block scales)

    def _gemm_operand(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.exact_bf16:
            return self.dequantize(), None
        deq = self._deq if self._deq is not None else self._dequantize().reshape(self.shape)
        return deq.to(torch.bfloat16), None

    def _codes_2d(self) -> torch.Tensor:
        """Element codes as uint8 (M, K), unpadded, x's orientation."""
        return self.elems[: self.m, : self.k].view(torch.uint8)

    def _transposed_shape(self) -> tuple[int, ...]:
        return (self.shape[-1], *self.shape[:-1])
