"""optimizer.quantize_weights_in_backward: each weight's FP8 copy for the next forward is made right
after the weight's update inside backward (optimizer.step_in_backward), on the update's side stream,
and the next forward reuses it instead of casting the weight on the compute stream.

This is TE's own weight cache, the one it keeps across the micro-batches of one step: with
`is_first_microbatch=False` a te.Linear / LayerNormLinear / LayerNormMLP reuses the FP8 workspace in
its `_fp8_workspaces` (with `True` it recasts it in place first). Here the in-place recast is the
workspace's own `quantize_` (what TE's `quantize_weight` calls on a cache hit), issued from the update
hook instead of the next forward. Under current scaling the cast depends on the weight alone (its
amax, scale and codes), so the copy equals the one the forward would make, bit for bit; validation
allows only that (no delayed scaling, no FP8 parameters). A forward reuses the cache only when every
cached weight was recast after its update in the previous step; otherwise (the first step, after a
checkpoint load) TE recasts them all, as without this option.
"""

from __future__ import annotations

import torch.nn as nn

# TE module class -> its weight parameter -> the `_fp8_workspaces` key TE caches that weight under
_SLOTS = {
    "Linear": {"weight": "weight"},
    "LayerNormLinear": {"weight": "weight"},
    "LayerNormMLP": {"fc1_weight": "fc1_weight", "fc2_weight": "fc2_weight"},
}


class WeightCache:
    """Recasts TE's cached FP8 weights after their updates; says whether the cache is current."""

    def __init__(self, te, model: nn.Module):
        kinds = {getattr(te, name): slots for name, slots in _SLOTS.items()}
        self.slots: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for param_name, key in kinds.get(type(module), {}).items():
                p = getattr(module, param_name, None)
                if isinstance(p, nn.Parameter):
                    self.slots.setdefault(p, []).append((module, key))
        if not self.slots:
            raise RuntimeError("optimizer.quantize_weights_in_backward: the model has no TE GEMM weights")
        self.fresh: set[int] = set()  # ids of the workspaces recast after their weight's last update
        self.recasts = 0

    def workspaces(self) -> list:
        return [
            ws
            for slots in self.slots.values()
            for module, key in slots
            if (ws := module._fp8_workspaces.get(key)) is not None
        ]

    def current(self) -> bool:
        """Every cached FP8 weight was recast after its weight's update (there is a cache at all)."""
        cached = self.workspaces()
        return bool(cached) and all(id(ws) in self.fresh for ws in cached)

    def begin_step(self) -> bool:
        """At the step's first forward: whether it may reuse the cache; the step's recasts start."""
        ok = self.current()
        self.fresh = set()
        return ok

    def invalidate(self) -> None:
        """The weights changed outside the update (a checkpoint load): the next forward recasts."""
        self.fresh = set()

    def refresh(self, p: nn.Parameter) -> None:
        """After p's update, on the stream that updated it: recast p's cached FP8 copies in place,
        with the usages (rowwise data, transpose) the cached copy holds, as the forward would."""
        for module, key in self.slots.get(p, ()):
            ws = module._fp8_workspaces.get(key)
            if ws is None:
                continue
            quantizer = ws._get_quantizer()
            usage = quantizer.rowwise_usage, quantizer.columnwise_usage
            # an eval forward leaves the module's quantizer without columnwise usage; the cached copy
            # keeps what the training forward made it with
            quantizer.set_usage(rowwise=ws._data is not None, columnwise=ws._transpose is not None)
            try:
                ws.quantize_(p.detach())
            finally:
                quantizer.set_usage(rowwise=usage[0], columnwise=usage[1])
            self.fresh.add(id(ws))
            self.recasts += 1
