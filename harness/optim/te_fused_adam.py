"""TE FusedAdam, and its subclass that (un)scales FP8 moments for all tensors at once.

Transformer Engine is imported when a class is asked for, never at import of this module.
"""

from __future__ import annotations

import torch


def te_fused_adam():
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
    to re-quantize (docs/numerics.md §8; `harness.numerics.adam_states.quantize` is the CPU reference). The
    states, scales and parameters stay bit-identical to TE's (GPU test); the Adam step is TE's kernel,
    and everything outside `step` (state init, state_dict, set_scaled_state) is TE's own code.
    """
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    FusedAdam = te_fused_adam()

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


def fused_adam_one_pass():
    """TE's FusedAdam, whose step runs `harness.optim.adam_kernel` where TE would run
    `multi_tensor_adam_param_remainder` (bf16 parameters, fp32 masters as int16 remainders, fp32
    moments, AdamW): the same arithmetic with a grid that fills the GPU, and the clipping coefficient
    (`grad_scale`, set by `harness.optim.clip_grad`) applied inside instead of a pass of its own.
    The states are TE's own tensors (state init, state_dict and load_state_dict are TE's code); any
    other setup, or a parameter TE would treat otherwise (a DTensor, a quantized or non-bf16 one),
    steps through TE's kernel after the coefficient is applied to the grads."""
    from harness.optim import adam_kernel

    FusedAdam = te_fused_adam()

    class FusedAdamOnePass(FusedAdam):
        grad_scale: torch.Tensor | None = None
        """a one-element fp32 device tensor the next step multiplies every gradient by, then drops"""
        asm: str | None = None
        """another `adam_kernel.arithmetic()` than TE's, for measuring which one TE runs
        (`benchmarks.adam_step --probe`); None: TE's"""

        def _one_pass(self) -> bool:
            fp32 = torch.float32
            if not (
                adam_kernel.available()
                and self.master_weights
                and self.store_param_remainders
                and self.adam_w_mode == 1
                and not self.capturable
                and self.exp_avg_dtype == fp32
                and self.exp_avg_sq_dtype == fp32
            ):
                return False
            for group in self.param_groups:
                if not group["bias_correction"]:
                    return False
                for p in group["params"]:
                    if type(p.data) is not torch.Tensor or p.dtype != torch.bfloat16 or not p.is_cuda:
                        return False
                    grad = self._grad(p)
                    if grad is not None and (grad.dtype != fp32 or not grad.is_contiguous()):
                        return False
            return True

        def kernel(self) -> str:
            """What steps the parameters: this module's one-pass kernel, or TE's own."""
            return "lowp one-pass AdamW (Triton)" if self._one_pass() else "TE FusedAdam"

        def _grad(self, p):
            return getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad

        @torch.no_grad()
        def step(self, closure=None, grad_scaler=None):
            scale, self.grad_scale = self.grad_scale, None
            if grad_scaler is not None or not self._one_pass():
                if scale is not None:
                    grads = [
                        g
                        for grp in self.param_groups
                        for p in grp["params"]
                        if (g := self._grad(p)) is not None
                    ]
                    torch._foreach_mul_(grads, scale)
                return super().step(closure, grad_scaler)
            loss = closure() if closure is not None else None
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1  # TE advances empty groups too
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    state = self.state[p]
                    if len(state) == 0:
                        self.initialize_state(p, True)
                    grad = self._grad(p)
                    if grad is None:
                        continue
                    adam_kernel.step_(
                        grad,
                        p.data,
                        state["exp_avg"],
                        state["exp_avg_sq"],
                        state["master_param"],
                        lr=group["lr"],
                        beta1=beta1,
                        beta2=beta2,
                        eps=group["eps"],
                        weight_decay=group["weight_decay"],
                        step=group["step"],
                        grad_scale=scale,
                        asm=self.asm,
                    )
            return loss

    return FusedAdamOnePass
