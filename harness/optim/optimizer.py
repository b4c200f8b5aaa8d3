"""AdamW with warm-up and cosine decay, gradient clipping, and the precision-aware variants.

One `Optimizer` wrapper hides where gradients live (``p.grad``, or Megatron-style fp32 main grads
accumulated by hooks) and what the states are made of:

- emulated backend: fp32 parameters are the master weights; torch AdamW, or the pure-PyTorch
  `PrecisionAwareAdamW` that reproduces TE FusedAdam's low-precision state numerics;
- te backend: bf16 parameters; TE FusedAdam with fp32 (or fp16) master weights and
  fp32/fp16/bf16/fp8 moments (Megatron's precision-aware optimizer), fp32 main grads by default;
  `master_weights=false` is the anchor script's setup (torch fused AdamW on the bf16 parameters);
  `optimizer_cpu_offload` keeps master weights, states and the step on the host.

`step_in_backward` runs a torch AdamW's update per parameter inside backward (in_backward.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from harness.config.schema import OptimizerConfig
from harness.optim.in_backward import StepInBackward
from harness.optim.main_grads import MainGrads
from harness.optim.offload import CpuOffloadAdamW
from harness.optim.te_fused_adam import fused_adam_batched_fp8_states, fused_adam_one_pass

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (and embeddings, as nanoGPT does); never biases or norm weights."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


_QUANTIZED_PARTS = (
    "_data",
    "_transpose",
    "_rowwise_data",
    "_columnwise_data",
    "_scale_inv",
    "_rowwise_scale_inv",
    "_columnwise_scale_inv",
)


def quantized_parts(t) -> list[torch.Tensor]:
    """The storage tensors of a TE quantized tensor (FP8 data, transposes, scales); [] for a plain one."""
    parts = [getattr(t, a, None) for a in _QUANTIZED_PARTS]
    return [x for x in parts if isinstance(x, torch.Tensor)]


def tensor_bytes(t) -> int:
    """Storage bytes, also for TE's quantized tensors (whose nominal dtype is not their storage)."""
    inner = quantized_parts(t)
    if inner:
        return sum(x.numel() * x.element_size() for x in inner)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class Optimizer:
    """The training loop's view of any optimizer: grads(), step(), zero_grad(), memory_bytes()."""

    def __init__(
        self,
        inner,
        params: list[nn.Parameter],
        main_grads: MainGrads | None = None,
        decoupled: bool = False,
        in_backward: StepInBackward | None = None,
    ):
        self.inner, self.params, self.main_grads, self.decoupled = inner, params, main_grads, decoupled
        self.in_backward = in_backward  # set: backward itself steps (step() is never called)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def grads(self) -> list[torch.Tensor]:
        if self.main_grads is not None:
            return self.main_grads.grads()
        return [p.grad for p in self.params if p.grad is not None]

    def step(self) -> None:
        if self.main_grads is not None:
            for p in self.params:  # FusedAdam reads the fp32 buffer as its "decoupled" grad
                p.decoupled_grad = p.main_grad
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)
        if self.main_grads is not None:
            self.main_grads.zero()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def memory_bytes(self) -> dict:
        """Bytes of master weights, moment states and main grads as stored."""
        if hasattr(self.inner, "memory_bytes"):
            return self.inner.memory_bytes()
        master = states = 0
        for st in self.inner.state.values():
            for key, value in st.items():
                if key == "master_param":
                    master += tensor_bytes(value)
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    states += tensor_bytes(value)
        grads = (
            self.main_grads.nbytes()
            if self.main_grads is not None
            else sum(p.numel() * p.element_size() for p in self.params)
        )
        return {"master_weights": master, "optimizer_states": states, "main_grads": grads}


def build_optimizer(
    model: nn.Module,
    cfg: OptimizerConfig,
    device: torch.device,
    *,
    native: bool = False,
    full_master: bool = False,
) -> Optimizer:
    """The backend asks for its optimizer (Backend.build_optimizer). `native`: the parameters are
    TE's bf16 ones (TE FusedAdam keeps the masters); else they are fp32 masters themselves.
    `full_master`: keep whole fp32 master weights (no bf16 + remainder trick), for TE INT4 QAT,
    whose bf16 parameters hold the fake-quantized weights rather than bf16(master)."""
    groups = param_groups(model, cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    hp = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if not native:
        if cfg.use_precision_aware_optimizer:
            from harness.optim.emulated_adam import PrecisionAwareAdamW, install_main_grad_hooks

            install_main_grad_hooks(model, cfg.main_grads_dtype)
            inner = PrecisionAwareAdamW(
                groups,
                weight_decay=cfg.weight_decay,
                exp_avg_dtype=cfg.exp_avg_dtype,
                exp_avg_sq_dtype=cfg.exp_avg_sq_dtype,
                main_params_dtype=cfg.main_params_dtype,
                main_grads_dtype=cfg.main_grads_dtype,
                **hp,
            )
            return Optimizer(inner, params)
        return _torch_adamw(groups, params, cfg, device, fused=device.type == "cuda", **hp)
    if not cfg.master_weights:  # the anchor script's setup: bf16 parameters, no fp32 copy
        return _torch_adamw(groups, params, cfg, device, fused=True, **hp)
    main_grads = MainGrads(params) if cfg.main_grads_dtype == "fp32" else None
    if cfg.optimizer_cpu_offload:
        return Optimizer(CpuOffloadAdamW(groups, cfg), params, main_grads)
    fp8_states = "fp8" in (cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype)
    inner = (fused_adam_batched_fp8_states() if fp8_states else fused_adam_one_pass())(
        groups,
        weight_decay=cfg.weight_decay,
        adam_w_mode=True,
        master_weights=True,
        master_weight_dtype=TORCH_DTYPES[cfg.main_params_dtype],
        exp_avg_dtype=TORCH_DTYPES[cfg.exp_avg_dtype],
        exp_avg_sq_dtype=TORCH_DTYPES[cfg.exp_avg_sq_dtype],
        use_decoupled_grad=main_grads is not None,
        # TE's FP8-state and FP8-param kernels cannot read int16 remainders
        store_param_remainders=cfg.main_params_dtype == "fp32"
        and not full_master
        and not cfg.fp8_param
        and not fp8_states,
        **hp,
    )
    return Optimizer(inner, params, main_grads)


def _torch_adamw(groups, params, cfg: OptimizerConfig, device, **kw) -> Optimizer:
    inner = torch.optim.AdamW(groups, **kw)
    stepper = StepInBackward(inner, params, device) if cfg.step_in_backward else None
    return Optimizer(inner, params, in_backward=stepper)


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Linear warm-up to lr over warmup_steps, then cosine decay to min_lr at total_steps."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad(optimizer: Optimizer, max_norm: float) -> torch.Tensor:
    """Global grad norm as a device tensor (no host sync); clipped in place when max_norm > 0."""
    grads = optimizer.grads()
    norm = torch.nn.utils.get_total_norm(grads)
    if max_norm > 0:
        # same as torch's clip_grads_with_norm_, on the tensors themselves (they may be main grads)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if hasattr(optimizer.inner, "grad_scale"):  # the optimizer's step multiplies the grads by it
            optimizer.inner.grad_scale = coef
        else:
            torch._foreach_mul_(grads, coef)
    return norm
