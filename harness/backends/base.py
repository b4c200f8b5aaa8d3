"""The backend seam: build the model for a recipe and provide the one precision context.

A backend is built from the config slices it needs (`BackendSpec`), never from the root config:
the recipe, the stability knobs, the model shape and the optimizer slice, plus the seed.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from harness import recipes
from harness.backends.hooks import make_hook
from harness.config.schema import (
    BackendConfig,
    ModelConfig,
    OptimizerConfig,
    RecipeConfig,
    StabilityConfig,
    TelemetryConfig,
)
from harness.model.plan import PrecisionPlan
from harness.numerics import counterfactual


def uses_main_grads(o: OptimizerConfig) -> bool:
    """Megatron's fp32 main grads (master weights, main_grads_dtype=fp32): TE's block linears then
    write their wgrad GEMM's fp32 output straight into `main_grad` (fuse_wgrad_accumulation), so no
    bf16 weight gradient is ever made; the emulated block linears keep their wgrad fp32 alike."""
    return o.master_weights and o.main_grads_dtype == "fp32"


@dataclass(frozen=True)
class BackendSpec:
    """What a backend is built from: config slices (no root config) and the run's seed."""

    name: str
    """te or emulated (already resolved from backend=auto)."""
    recipe: RecipeConfig
    stability: StabilityConfig
    model: ModelConfig
    optimizer: OptimizerConfig
    seed: int = 0
    options: BackendConfig = field(default_factory=BackendConfig)
    """The backend group's execution options (backend.packed_qkv_grad, ...)."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """What telemetry steps compute beyond the run's own rows (its counterfactual candidates)."""

    @property
    def plan(self) -> PrecisionPlan:
        return PrecisionPlan(self.recipe, self.stability, self.model)

    @property
    def fuse_wgrad_fp32(self) -> bool:
        """Block linears write their wgrad GEMM's fp32 result into fp32 main grads (Megatron's)."""
        return uses_main_grads(self.optimizer)


class Backend(ABC):
    """One per run. `autocast()` is the only precision context the training loop uses."""

    name: str
    emulates = False
    """The recipe's numerics are emulated in PyTorch: its speed is not the recipe's speed."""
    data_parallel_size = 1
    """Ranks of the run's data-parallel group (set by the trainer)."""
    amax_group = None
    """Data parallel: the process group delayed scaling's amaxes are MAX-reduced over (TE's
    amax_reduction_group); None with one process."""

    def __init__(self, spec: BackendSpec, device: torch.device):
        self.spec = spec
        self.device = device
        self.plan = spec.plan
        self.recipe_spec = recipes.get(spec.recipe.name)
        self.hook = make_hook(self.recipe_spec.hook, spec.recipe)
        self.counterfactual = counterfactual.Counterfactual(
            counterfactual.parse(spec.telemetry.candidates), seed=spec.seed
        )

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The GPT for spec.model, on self.device, fp32 master weights."""

    @abstractmethod
    def autocast(self) -> contextlib.AbstractContextManager:
        """The single context under which forward (and loss) run."""

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig):
        """The optimizer for this backend's parameters (harness.optim: where grads and states live)."""
        from harness.optim import build_optimizer

        return build_optimizer(model, cfg, self.device, native=False)

    def describe(self) -> dict:
        """Provenance for run.json: the backend, the recipe's repr, library versions, and how far
        each TE 2.20 recipe option in use is verified (recipes.verification)."""
        return {"backend": self.name, "recipe_repr": repr(self.spec.recipe), **self.verification()}

    def verification(self) -> dict:
        """{"verification": ...} where the run uses TE 2.20 recipe options, else {}."""
        found = recipes.verification(self.spec.recipe, self.spec.stability)
        return {"verification": found} if found else {}

    def verify_active(self, model: nn.Module, step: int) -> None:  # noqa: B027
        """Prove at runtime that the recipe is really applied; raise if it silently is not."""

    def set_amax_reduction(self, group, reducer) -> None:
        """Data parallel: `group` for TE's autocast, `reducer(list of amax tensors)` for the emulator;
        (None, None): amaxes stay local (one process, or tp_only_amax_red without tensor parallel)."""
        self.amax_group = group

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

    def load_state_dict(self, state: dict, scales: bool = True) -> None:  # noqa: B027
        """`scales=False`: only the random generators of `state`, not its scale state (a precision
        schedule's switch to a recipe that starts afresh, a warm start; docs/schedules.md)."""

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
