"""The backend seam: build the model for a recipe and provide the one precision context."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch
import torch.nn as nn

from harness.config.schema import Config
from harness.precision import PrecisionPlan


def uses_main_grads(cfg: Config) -> bool:
    """Megatron's fp32 main grads (master weights, main_grads_dtype=fp32): TE's block linears then
    write their wgrad GEMM's fp32 output straight into `main_grad` (fuse_wgrad_accumulation), so no
    bf16 weight gradient is ever made; the emulated block linears keep their wgrad fp32 alike."""
    o = cfg.optimizer
    return o.master_weights and o.main_grads_dtype == "fp32"


class Backend(ABC):
    """One per run. `autocast()` is the only precision context the training loop uses."""

    name: str

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.plan = PrecisionPlan(cfg.recipe, cfg.stability, cfg.model)

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The GPT for cfg.model, on self.device, fp32 master weights."""

    @abstractmethod
    def autocast(self) -> contextlib.AbstractContextManager:
        """The single context under which forward (and loss) run."""

    def describe(self) -> dict:
        """Provenance for run.json: the backend, the recipe's repr, library versions."""
        return {"backend": self.name, "recipe_repr": repr(self.cfg.recipe)}

    def verify_active(self, model: nn.Module, step: int) -> None:  # noqa: B027
        """Prove at runtime that the recipe is really applied; raise if it silently is not."""

    def prepare(self, model: nn.Module, optimizer) -> None:  # noqa: B027
        """Once, after the optimizer exists (e.g. TE INT4 QAT seeds master weights, then fake-quantizes)."""

    def microbatch(self, index: int | None, count: int) -> None:  # noqa: B027
        """Before each training micro-batch's forward: its index in the accumulation window of
        `count`; None once the window is done (evaluation and the next step start afresh)."""

    def after_optimizer_step(self, model: nn.Module) -> None:  # noqa: B027
        """After every optimizer step (e.g. TE INT4 QAT re-derives the fake-quantized weights)."""

    @contextlib.contextmanager
    def collect_telemetry(self):
        """Yield a list that fills with numerics rows for the forward/backward run inside the block."""
        yield []

    def state_dict(self) -> dict:
        """Recipe scale state (amax histories, scales, stochastic-rounding generators) for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027
        pass

    def canonical_name(self, name: str) -> str:
        """A parameter's name in checkpoints: the emulated GPT's, the same on every backend."""
        return name

    def model_state_dict(self, model: nn.Module) -> dict:
        """The model's tensors under canonical names; modules' opaque extra state is left to
        `state_dict()` (TE pickles its FP8 metadata there, which a safe checkpoint cannot hold)."""
        return {
            self.canonical_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")
        }

    def load_model_state_dict(self, model: nn.Module, state: dict) -> None:
        own = {self.canonical_name(k): k for k in model.state_dict() if not k.endswith("_extra_state")}
        if set(own) != set(state):
            missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise ValueError(
                f"checkpoint model does not match: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        result = model.load_state_dict({own[k]: v for k, v in state.items()}, strict=False)
        assert not result.unexpected_keys, result.unexpected_keys


def resolve_backend_name(cfg: Config) -> str:
    """te or emulated, from backend.name (auto: te where it can run the recipe natively)."""
    if cfg.backend.name != "auto":
        return cfg.backend.name
    from harness.backends.capability import te_recipe_available

    ok, _ = te_recipe_available(cfg.recipe.name)
    return "te" if ok else "emulated"


def build_backend(cfg: Config, device: torch.device) -> Backend:
    name = resolve_backend_name(cfg)
    if name == "te":
        from harness.backends.te import TEBackend

        return TEBackend(cfg, device)
    from harness.backends.emulated import EmulatedBackend

    return EmulatedBackend(cfg, device)
