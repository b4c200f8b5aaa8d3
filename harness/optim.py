"""AdamW with warm-up and cosine decay, gradient clipping, and the precision-aware variants.

One `Optimizer` wrapper hides where gradients live (``p.grad``, or Megatron-style fp32 main grads
accumulated by hooks) and what the states are made of:

- emulated backend: fp32 parameters are the master weights; torch AdamW, or the pure-PyTorch
  `PrecisionAwareAdamW` that reproduces TE FusedAdam's low-precision state numerics;
- te backend: bf16 parameters; TE FusedAdam with fp32 (or fp16) master weights and
  fp32/fp16/bf16/fp8 moments (Megatron's precision-aware optimizer), fp32 main grads by default;
  `master_weights=false` is the anchor script's setup (torch fused AdamW on the bf16 parameters);
  `optimizer_cpu_offload` keeps master weights, states and the step on the host.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from harness.config.schema import OptimizerConfig

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


def _tensor_bytes(t) -> int:
    """Storage bytes, also for TE's quantized tensors (whose nominal dtype is not their storage)."""
    inner = quantized_parts(t)
    if inner:
        return sum(x.numel() * x.element_size() for x in inner)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class MainGrads:
    """Megatron's fp32 gradient buffer, one persistent fp32 `main_grad` per parameter. TE layers built
    with fuse_wgrad_accumulation write their weight grads into it inside the wgrad GEMM (their `.grad`
    stays None, so no hook fires); every other parameter's bf16 grad is added by a hook and freed."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        for p in params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.register_post_accumulate_grad_hook(self._accumulate)

    @staticmethod
    def _accumulate(p: nn.Parameter) -> None:
        if p.grad is not None:  # None where TE's wgrad GEMM already wrote into main_grad
            p.main_grad.add_(p.grad)
            p.grad = None

    def grads(self) -> list[torch.Tensor]:
        return [p.main_grad for p in self.params]

    def zero(self) -> None:
        torch._foreach_zero_(self.grads())

    def nbytes(self) -> int:
        return sum(g.numel() * 4 for g in self.grads())


class Optimizer:
    """The training loop's view of any optimizer: grads(), step(), zero_grad(), memory_bytes()."""

    def __init__(
        self, inner, params: list[nn.Parameter], main_grads: MainGrads | None = None, decoupled: bool = False
    ):
        self.inner, self.params, self.main_grads, self.decoupled = inner, params, main_grads, decoupled

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
                    master += _tensor_bytes(value)
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    states += _tensor_bytes(value)
        grads = (
            self.main_grads.nbytes()
            if self.main_grads is not None
            else sum(p.numel() * p.element_size() for p in self.params)
        )
        return {"master_weights": master, "optimizer_states": states, "main_grads": grads}


class CpuOffloadAdamW:
    """Optimizer CPU offload: fp32 master weights and AdamW states in host memory, step on the CPU."""

    def __init__(self, groups: list[dict], cfg: OptimizerConfig):
        self.params = [p for g in groups for p in g["params"]]
        pin = (lambda t: t.pin_memory()) if torch.cuda.is_available() else (lambda t: t)  # noqa: E731
        self.master = [pin(p.detach().float().cpu()) for p in self.params]
        self.host_grads = [pin(torch.zeros_like(m)) for m in self.master]
        it = iter(self.master)
        host_groups = [{**g, "params": [next(it) for _ in g["params"]]} for g in groups]
        self.inner = torch.optim.AdamW(host_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def step(self) -> None:
        for p, m, h in zip(self.params, self.master, self.host_grads):
            h.copy_(p.main_grad if hasattr(p, "main_grad") else p.grad, non_blocking=True)
            m.grad = h
        if self.params and self.params[0].is_cuda:
            torch.cuda.synchronize()  # the host step needs the grads
        self.inner.step()
        for p, m in zip(self.params, self.master):
            p.data.copy_(m, non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "master": self.master}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        for m, saved in zip(self.master, state["master"]):
            m.copy_(saved)

    def memory_bytes(self) -> dict:
        # everything lives in host memory: nothing of it counts against the GPU
        return {
            "master_weights": 0,
            "optimizer_states": 0,
            "main_grads": 0,
            "host_bytes": sum(m.numel() * 4 * 3 for m in self.master),
        }


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
            from harness.precision_adam import PrecisionAwareAdamW, install_main_grad_hooks

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
        return Optimizer(torch.optim.AdamW(groups, fused=device.type == "cuda", **hp), params)
    if not cfg.master_weights:  # the anchor script's setup: bf16 parameters, no fp32 copy
        return Optimizer(torch.optim.AdamW(groups, fused=True, **hp), params)
    main_grads = MainGrads(params) if cfg.main_grads_dtype == "fp32" else None
    if cfg.optimizer_cpu_offload:
        return Optimizer(CpuOffloadAdamW(groups, cfg), params, main_grads)
    fp8_states = "fp8" in (cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype)
    inner = (fused_adam_batched_fp8_states() if fp8_states else _te_fused_adam())(
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


def _te_fused_adam():
    from transformer_engine.pytorch.optimizers import FusedAdam

    return FusedAdam


_FP8_STATE_MAX = 448.0  # TE's dtype_to_range_map[torch.uint8]


def fused_adam_batched_fp8_states():
    """TE's FusedAdam, with its FP8 states (un)scaled for all tensors at once.

    TE unscales every FP8 moment to fp32 and re-quantizes it after the Adam kernel one tensor at a
    time in Python (`get_unscaled_state`, `_apply_scale`: a dequantize, an aminmax, four small ops and
    a quantize each). On the 1.4B shape that is about 1,200 quantizer calls and 200 ms of host time a
    step against 19 ms of GPU work, so the GPU waits. This subclass does the same arithmetic with
    foreach ops over all tensors: codes * scale_inv to unscale; absmax = max(-min, max),
    s = absmax / 448, quantizer scale = 1 / s, codes = satfinite_e4m3(x * scale), scale_inv = 1 / scale
    to re-quantize (numerics.md §8; `harness.precision_adam.quantize` is the CPU reference). The
    states, scales and parameters stay bit-identical to TE's (GPU test); the Adam step is TE's kernel,
    and everything outside `step` (state init, state_dict, set_scaled_state) is TE's own code.
    """
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    FusedAdam = _te_fused_adam()

    class FusedAdamBatchedFP8States(FusedAdam):
        _unscaled: dict | None = None
        _pending: list | None = None

        def step(self, closure=None, grad_scaler=None):
            self._unscaled, self._pending = self._unscale_all(), []
            try:
                loss = super().step(closure, grad_scaler)
                self._rescale_all(self._pending)
            finally:
                self._unscaled = self._pending = None
            return loss

        def _fp8_states(self):
            for group in self.param_groups:
                for p in group["params"]:
                    for name, value in self.state[p].items():
                        if isinstance(value, Float8Tensor):
                            yield p, name, value

        @torch.no_grad()
        def _unscale_all(self) -> dict:
            found = list(self._fp8_states())
            if not found:
                return {}
            states = [v for _, _, v in found]
            out = [torch.empty(v.shape, dtype=torch.float32, device=v.device) for v in states]
            torch._foreach_copy_(out, [v._data.view(torch.float8_e4m3fn) for v in states])
            torch._foreach_mul_(out, [v._scale_inv for v in states])  # TE: float(code) * scale_inv
            return {(id(p), name): x for (p, name, _), x in zip(found, out)}

        def get_unscaled_state(self, param, state_name, skip_unscale=False):
            hit = self._unscaled.get((id(param), state_name)) if self._unscaled else None
            return hit if hit is not None else super().get_unscaled_state(param, state_name, skip_unscale)

        def _apply_scale(self, state_name, unscaled_state, scaled_state, scale):
            if self._pending is None or not isinstance(scaled_state, Float8Tensor):
                return super()._apply_scale(state_name, unscaled_state, scaled_state, scale)
            self._pending.append((unscaled_state, scaled_state, scale))

        @torch.no_grad()
        def _rescale_all(self, pending: list) -> None:
            if not pending:
                return
            xs = [x for x, _, _ in pending]
            lo_hi = torch.stack([torch.stack(torch.aminmax(x)) for x in xs])  # NaN propagates, as in TE
            absmax = torch.maximum(-lo_hi[:, 0], lo_hi[:, 1])
            s = absmax / torch.full_like(absmax, _FP8_STATE_MAX)
            q = torch.reciprocal(s)  # s = 0 gives an infinite scale and NaN codes, as in TE
            qs = list(q.reshape(-1, 1).unbind())
            torch._foreach_copy_([sc for _, _, sc in pending], list(s.reshape(-1, 1).unbind()))
            torch._foreach_copy_([t._quantizer.scale for _, t, _ in pending], qs)
            torch._foreach_mul_(xs, qs)
            torch._foreach_clamp_min_(xs, -_FP8_STATE_MAX)  # satfinite; NaN stays NaN
            torch._foreach_clamp_max_(xs, _FP8_STATE_MAX)
            torch._foreach_copy_([t._data.view(torch.float8_e4m3fn) for _, t, _ in pending], xs)
            sinv = list(torch.reciprocal(q).reshape(-1, 1).unbind())
            torch._foreach_copy_([t._scale_inv for _, t, _ in pending], sinv)
            # not updated: the states' quantizer amax, a running max that nothing reads

    return FusedAdamBatchedFP8States


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
        torch._foreach_mul_(grads, coef)
    return norm
