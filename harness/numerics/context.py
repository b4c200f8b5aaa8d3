"""The emulator's one precision context and the run-wide numerics state behind it.

`NumericsContext.autocast()` plays TE's `te.autocast`: it decides *when* delayed-scaling state
updates (docs/numerics.md section 2): the forward set when the outermost context exits with grad
enabled, the backward set right after the backward of the first quantized module of that
forward (the last backward to run). It also owns the stochastic-rounding generator and the
telemetry sink, and serialises all of it for checkpoints.
"""

from __future__ import annotations

import contextlib

import torch

from harness.config.schema import RecipeConfig
from harness.numerics.delayed import DelayedScalingState
from harness.numerics.scaling import fp8_format_for
from harness.numerics.telemetry import TelemetrySink


class NumericsContext:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0):
        self.device = torch.device(device)
        self.depth = 0
        self.first_pending = True  # the next quantized forward is the "first FP8 module"
        self.forward_states: dict[str, DelayedScalingState] = {}
        self.backward_states: dict[str, DelayedScalingState] = {}
        # a model built on the meta device (shape checks) draws no random numbers: a CPU generator will do
        self.generator = torch.Generator(device="cpu" if self.device.type == "meta" else self.device)
        self.generator.manual_seed(seed)
        self.telemetry = TelemetrySink()
        # data parallel: in-place MAX of a list of amax tensors over the ranks (TE's reduce_amax in
        # reduce_and_update_fp8_tensors), applied to each set's current amaxes before its update
        self.amax_reducer = None
        # bumped after every optimizer step: the quantized weight copies cached before it are stale
        self.weights_generation = 0

    # -- the precision context -----------------------------------------------------------------
    @contextlib.contextmanager
    def autocast(self):
        if self.depth == 0:
            self.first_pending = True
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0 and torch.is_grad_enabled():
                self.update_forward()

    def weights_changed(self) -> None:
        """The optimizer stepped: every cached weight quantization is stale (QuantizedLinear)."""
        self.weights_generation += 1

    def claim_first(self) -> bool:
        """True for the first quantized module forward since the outermost context was entered."""
        first, self.first_pending = self.first_pending, False
        return first

    # -- delayed scaling ----------------------------------------------------------------------
    def delayed_states(self, name: str, recipe: RecipeConfig, margin: float):
        """Register and return (forward, backward) states of module `name`: [input, weight], [grad]."""
        fwd = DelayedScalingState(
            [fp8_format_for(recipe.fp8, "input"), fp8_format_for(recipe.fp8, "weight")],
            recipe.fp8_amax_history_len,
            recipe.fp8_amax_compute_algo,
            margin,
            self.device,
        )
        bwd = DelayedScalingState(
            [fp8_format_for(recipe.fp8, "grad")],
            recipe.fp8_amax_history_len,
            recipe.fp8_amax_compute_algo,
            margin,
            self.device,
        )
        self.forward_states[name], self.backward_states[name] = fwd, bwd
        return fwd, bwd

    def update_forward(self) -> None:
        self._reduce(self.forward_states.values())
        for state in self.forward_states.values():
            state.update()

    def update_backward(self) -> None:
        self._reduce(self.backward_states.values())
        for state in self.backward_states.values():
            state.update()

    def _reduce(self, states) -> None:
        """TE concatenates the amaxes of one autocast's set and all-reduces them (MAX) in one call."""
        if self.amax_reducer is not None:
            self.amax_reducer([s.amax_history[0] for s in states])

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "delayed": {
                name: {"forward": self.forward_states[name].state_dict(), "backward": bwd.state_dict()}
                for name, bwd in self.backward_states.items()
            },
            "sr_generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        delayed = state.get("delayed", {})
        missing = sorted(set(self.forward_states) - set(delayed))
        if missing:
            raise ValueError(f"checkpoint has no delayed-scaling state for {missing}")
        for name, entry in delayed.items():
            if name not in self.forward_states:
                raise ValueError(f"checkpoint has delayed-scaling state for unknown module {name!r}")
            self.forward_states[name].load_state_dict(entry["forward"])
            self.backward_states[name].load_state_dict(entry["backward"])
        if "sr_generator" in state:
            self.generator.set_state(state["sr_generator"])
