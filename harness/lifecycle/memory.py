"""Where the bytes go: a breakdown that explains the measured peak (summary.json `memory`)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from harness.optim import Optimizer, quantized_parts, tensor_bytes

GIB = 2**30


class SavedTensors:
    """Bytes autograd keeps for backward while its context is open: every tensor saved by an op or a
    custom Function (TE's included), each storage counted once, leaving out `exclude` (the
    parameters: counted as params already). `.bytes` after the forward."""

    def __init__(self, exclude=()):
        self.storages: dict[int, int] = {}
        self.skip = {
            p.untyped_storage().data_ptr() for p in exclude if type(p) in (torch.Tensor, nn.Parameter)
        }

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        parts = quantized_parts(t)  # a TE quantized tensor: its data, transpose and scales
        for x in parts or [t]:
            try:
                storage = x.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # a wrapper without storage of its own
                key, size = id(x), tensor_bytes(x)
            if key not in self.skip:
                self.storages.setdefault(key, size)
        return t

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


def breakdown(
    model: nn.Module,
    optimizer: Optimizer,
    *,
    peak_bytes: int | None = None,
    saved_bytes: int | None = None,
) -> dict:
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
        "measures a peak, e.g. on a CPU); of those, saved_for_backward = every tensor autograd "
        "holds for backward (counted once per storage over one micro-batch), transient_at_peak = "
        "the rest (logits and loss buffers, backward's temporaries, allocator rounding)",
    }
    if peak_bytes is not None:
        out["peak_measured_gib"] = peak_bytes / GIB
        out["activations_estimate_gib"] = max(0, peak_bytes - static) / GIB
    if saved_bytes is not None:
        # of those activations: what autograd holds for backward (SavedTensors), the rest is the
        # transient peak (logits and loss buffers, backward's temporaries, allocator rounding)
        out["saved_for_backward_gib"] = saved_bytes / GIB
        if peak_bytes is not None:
            out["transient_at_peak_gib"] = max(0, peak_bytes - static - saved_bytes) / GIB
    return out
