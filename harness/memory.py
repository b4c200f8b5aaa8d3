"""Where the bytes go: a breakdown that explains the measured peak (summary.json `memory`)."""

from __future__ import annotations

import torch.nn as nn

from harness.optim import Optimizer, quantized_parts, tensor_bytes

GIB = 2**30


def breakdown(model: nn.Module, optimizer: Optimizer, *, peak_bytes: int | None = None) -> dict:
    """GiB per category; activations are what the measured peak leaves unexplained (an estimate)."""
    params = [p for p in model.parameters()]
    plain = sum(tensor_bytes(p) for p in params if not quantized_parts(p))
    quantized = sum(tensor_bytes(p) for p in params if quantized_parts(p))
    opt = optimizer.memory_bytes()
    static = plain + quantized + opt["master_weights"] + opt["optimizer_states"] + opt["main_grads"]
    out = {
        "params_gib": plain / GIB,
        "quantized_copies_gib": quantized / GIB,
        "grads_gib": opt["main_grads"] / GIB,
        "optimizer_states_gib": opt["optimizer_states"] / GIB,
        "master_weights_gib": opt["master_weights"] / GIB,
        "host_offloaded_gib": opt.get("host_bytes", 0) / GIB,
        "static_total_gib": static / GIB,
        "activations_estimate_gib": None,
        "peak_measured_gib": None,
        "how": "weights, grads, optimizer states and quantized weights counted from the tensors as stored; "
        "activations = measured peak minus that static total (null where no device allocator "
        "measures a peak, e.g. on a CPU)",
    }
    if peak_bytes is not None:
        out["peak_measured_gib"] = peak_bytes / GIB
        out["activations_estimate_gib"] = max(0, peak_bytes - static) / GIB
    return out
