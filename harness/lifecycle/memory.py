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
    parameters: counted as params already). `.bytes` after the forward; `.inside` the part saved
    while one of the `inside` modules ran its forward (an MoE model's routed experts: the permuted
    tokens' activations)."""

    def __init__(self, exclude=(), inside: list[nn.Module] | tuple = ()):
        self.storages: dict[int, int] = {}
        self.inside_keys: set[int] = set()
        self.modules, self._depth = list(inside), 0
        self.skip = {
            p.untyped_storage().data_ptr() for p in exclude if type(p) in (torch.Tensor, nn.Parameter)
        }

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def inside(self) -> int:
        return sum(self.storages[k] for k in self.inside_keys)

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
            if key not in self.skip and key not in self.storages:
                self.storages[key] = size
                if self._depth:
                    self.inside_keys.add(key)
        return t

    def _enter(self, *_):
        self._depth += 1

    def _leave(self, *_):
        self._depth -= 1

    @contextlib.contextmanager
    def counting(self):
        hooks = [m.register_forward_pre_hook(self._enter) for m in self.modules]
        hooks += [m.register_forward_hook(self._leave) for m in self.modules]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in hooks:
                h.remove()


def breakdown(
    model: nn.Module,
    optimizer: Optimizer,
    *,
    peak_bytes: int | None = None,
    saved_bytes: int | None = None,
    experts: list[nn.Module] | tuple = (),
    experts_saved_bytes: int | None = None,
) -> dict:
    """GiB per category; activations are what the measured peak leaves unexplained (an estimate).
    An MoE model's routed `experts` (harness.model.moe.Routing.experts) get their own share of each:
    `expert_params_gib` of params_gib, `expert_activations_saved_gib` (their `experts_saved_bytes`:
    SavedTensors.inside, what autograd holds of the permuted tokens inside them) of saved_for_backward_gib."""
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
    if experts:
        out["how"] += (
            "; expert_params and expert_activations_saved: the routed experts' share of params and of "
            "saved_for_backward (the permuted tokens' activations)"
        )
        out["expert_params_gib"] = sum(tensor_bytes(p) for m in experts for p in m.parameters()) / GIB
        if experts_saved_bytes is not None:
            out["expert_activations_saved_gib"] = experts_saved_bytes / GIB
    return out
