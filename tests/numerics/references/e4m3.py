"""An independent E4M3 encoder for the exact tests of the optimizer-state encodings (docs/numerics.md
section 8): saturate to 448, nearest E4M3 value, ties to the even code. No lowp code is used."""

from __future__ import annotations

import numpy as np
import torch

FP8_MAX = 448.0
ALL_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
E4M3_POSITIVE = ALL_CODES.float()[:127].numpy()  # codes 0x00..0x7E, increasing, 0 .. 448


def e4m3_codes(x: np.ndarray) -> np.ndarray:
    """Independent encoder: saturate to 448, nearest E4M3 value, ties to the even code."""
    a = np.minimum(np.abs(x), np.float32(FP8_MAX))
    hi = np.clip(np.searchsorted(E4M3_POSITIVE, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - E4M3_POSITIVE[lo], E4M3_POSITIVE[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)
