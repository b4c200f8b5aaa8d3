"""Where the bytes go: a breakdown that explains the measured peak (summary.json `memory`)."""

from __future__ import annotations

import torch
import torch.nn as nn

GIB = 2**30


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def breakdown(model: nn.Module, optimizer: torch.optim.Optimizer, *, quantized_bytes: int = 0,
              master_bytes: int = 0, peak_bytes: int | None = None) -> dict:
    """GiB per category; activations are what the measured peak leaves unexplained (an estimate)."""
    params = _bytes(model.parameters())
    # gradients: what one step holds, in the dtype the backward writes (the params' own here)
    grads = _bytes(p for p in model.parameters() if p.requires_grad)
    states = _bytes(v for s in optimizer.state.values() for v in s.values())
    static = params + grads + states + master_bytes + quantized_bytes
    out = {
        "params_gib": params / GIB,
        "grads_gib": grads / GIB,
        "optimizer_states_gib": states / GIB,
        "master_weights_gib": master_bytes / GIB,
        "quantized_copies_gib": quantized_bytes / GIB,
        "static_total_gib": static / GIB,
        "activations_estimate_gib": None,
        "peak_measured_gib": None,
        "how": "params/grads/states/copies counted from tensor sizes; activations = measured peak minus "
               "the static total (null where no device allocator measures a peak, e.g. on a CPU)",
    }
    if peak_bytes is not None:
        out["peak_measured_gib"] = peak_bytes / GIB
        out["activations_estimate_gib"] = max(0, peak_bytes - static) / GIB
    return out
