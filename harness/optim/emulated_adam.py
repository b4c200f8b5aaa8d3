"""AdamW with TE FusedAdam's low-precision state numerics, in plain PyTorch (docs/numerics.md §7-8).

Megatron's ``--use-precision-aware-optimizer`` hands ``--exp-avg-dtype``, ``--exp-avg-sq-dtype`` and
``--main-params-dtype`` to Transformer Engine's ``FusedAdam``; this class reproduces what that optimizer
stores and computes so the emulated backend shows, on a CPU, what the dtypes cost in accuracy and save in
memory. Read from TE's ``pytorch/optimizers/fused_adam.py`` and ``common/multi_tensor/adam.cu``:

The state encodings and the kernel's math are `harness.numerics.adam_states`:

- fp32 states are plain; bf16 states are RNE casts; fp16 states (and fp16 masters) keep one fp32
  multiplier ``s = absmax / 32752`` per tensor and store ``fp16(x * (1/s))`` (``1/s`` -> 0 when s = 0);
  fp8 states are E4M3 codes with ``s = absmax / 448``, ``scale = 1/s``, ``q = satfinite_rne(x * scale)``
  and ``scale_inv = 1/scale`` (two reciprocals, as TE's Float8Quantizer does). Each step dequantizes to
  fp32, runs the fp32 AdamW kernel, and re-quantizes with the new (current) scale.
- The kernel's math is evaluated op by op in fp32 with TE's operand order and fp32-rounded
  hyper-parameters; bias corrections ``1 - beta**step`` come from a double ``pow`` on the host, as in
  ``compute_bias_correction``. Bit equality with the GPU is not claimed for the math: NVCC may contract
  products into FMAs (docs/numerics.md §8), and torch's CPU fp32 sqrt is one ulp off CUDA's correctly
  rounded ``sqrtf`` on ~20% of inputs (a double sqrt fixes that but cost 30% of a step). The
  quantization (codes and scales from given fp32 values) is exact.

lowp's emulated backend keeps fp32 parameters and rounds them to bf16 inside its GEMMs, so with fp32
masters the parameter *is* the master. With fp16 masters the parameter receives the fp32 result of the
update, exactly the value TE casts into its bf16 parameter (``p = PARAM_T(r_p)``) before the master is
re-quantized; the GEMM's bf16 rounding then gives TE's parameter. (TE's Megatron default
``store_param_remainders`` rounds ties away from zero instead of to even; that tie case is ignored.)

Tensors are updated one at a time, not with ``torch._foreach_*``: on a CPU those are loops over the
tensors anyway, and running a tensor's ~20 passes while it sits in cache, with temporaries the allocator
reuses, made a gpt_small step several times faster than list-wide passes with fresh temporaries.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.nn as nn

from harness.numerics.adam_states import (
    ELEM_BYTES,
    SCALE_BYTES,
    STORAGE,
    adamw_update_,
    dequantize,
    hyperparameters,
    quantize,
)


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW whose moments and master weights are stored like TE FusedAdam's (see the module doc).

    State per parameter: ``exp_avg``, ``exp_avg_sq`` (and ``master_param`` for fp16 masters) in their
    storage dtype (fp8 as ``torch.float8_e4m3fn`` codes), ``<name>_scale_inv`` (the dequantization
    multiplier: TE's ``_scales`` entry for fp16, ``Float8Tensor._scale_inv`` for fp8) and, for fp8,
    ``<name>_scale`` (the quantizer's scale). The step count is per group, like TE's ``group["step"]``.

    ``fp8_zero_state_guard``: a state that is all zeros when re-quantized (say the first step of a
    parameter whose gradient is exactly zero, e.g. layers upstream of a zero-initialised projection)
    gives s = 0, scale = Inf and NaN codes in TE, which then poison the parameter. By default this
    optimizer reproduces that faithfully, finishes the step, and raises ``FloatingPointError`` naming
    the hazard so a run does not diverge silently. With the guard on, such a state keeps scale 1 and
    zero codes (its initial encoding), which is what a fixed TE would do.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        exp_avg_dtype: str = "fp32",
        exp_avg_sq_dtype: str = "fp32",
        main_params_dtype: str = "fp32",
        main_grads_dtype: str = "fp32",
        fp8_zero_state_guard: bool = False,
    ):
        for name, value, allowed in (
            ("exp_avg_dtype", exp_avg_dtype, tuple(STORAGE)),
            ("exp_avg_sq_dtype", exp_avg_sq_dtype, tuple(STORAGE)),
            ("main_params_dtype", main_params_dtype, ("fp32", "fp16")),
            ("main_grads_dtype", main_grads_dtype, ("fp32", "bf16")),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {allowed}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        if any(p.dtype != torch.float32 for g in self.param_groups for p in g["params"]):
            raise ValueError("PrecisionAwareAdamW expects fp32 parameters (lowp's emulated backend)")
        self.dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        if main_params_dtype == "fp16":
            self.dtypes["master_param"] = "fp16"
        self.main_params_dtype = main_params_dtype
        self.main_grads_dtype = main_grads_dtype
        self.fp8_zero_state_guard = fp8_zero_state_guard
        self._checked_hooks = False

    def _init_state(self, p: torch.Tensor) -> None:
        """Zero moments with scale 1 (TE's initialize_state); an fp16 master quantized from ``p``."""
        state = self.state[p]
        for name in ("exp_avg", "exp_avg_sq"):
            fmt = self.dtypes[name]
            state[name] = torch.zeros_like(p, dtype=STORAGE[fmt], memory_format=torch.preserve_format)
            if fmt in ("fp16", "fp8"):
                state[name + "_scale_inv"] = torch.ones(1, device=p.device)
            if fmt == "fp8":
                state[name + "_scale"] = torch.ones(1, device=p.device)
        if "master_param" in self.dtypes:
            self._store(state, "master_param", p.detach().float().clone())

    def _store(self, state: dict, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """Quantize the fp32 working value ``x`` into ``state[name]``; returns TE's ``s`` (or None)."""
        stored, scale, scale_inv, s = quantize(x, self.dtypes[name], self.fp8_zero_state_guard)
        state[name] = stored
        if scale_inv is not None:
            state[name + "_scale_inv"] = scale_inv
        if scale is not None:
            state[name + "_scale"] = scale
        return s

    def _load(self, state: dict, name: str) -> torch.Tensor:
        return dequantize(state[name], state.get(name + "_scale_inv"))

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step; the group's step advances even for parameters without grads (TE)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_hooks()
        zero_states = []  # (group, index, name, s) of fp8 states that were all zero
        for gi, group in enumerate(self.param_groups):
            group["step"] = group.get("step", 0) + 1
            hp = hyperparameters(group)
            for i, p in enumerate(group["params"]):
                if not self.state[p]:
                    self._init_state(p)
                if p.grad is not None:
                    zero_states += [(gi, i, name, s) for name, s in self._param_step(p, hp)]
        if zero_states and not self.fp8_zero_state_guard:
            is_zero = (torch.cat([s for *_, s in zero_states]) == 0).tolist()  # one host sync
            hit = [
                f"group {gi} param {i} {name}"
                for (gi, i, name, _), z in zip(zero_states, is_zero, strict=True)
                if z
            ]
            if hit:
                raise FloatingPointError(
                    f"{len(hit)} fp8 optimizer state(s) were all zero when re-quantized ({hit[:3]}): "
                    "TE FusedAdam stores NaN codes for them (scale = 1/0) and so did this step; "
                    "set fp8_zero_state_guard=True to keep zero codes instead (docs/numerics.md §8)"
                )
        return loss

    def _param_step(self, p: torch.Tensor, hp: tuple) -> list:
        """Dequantize, fp32 AdamW, re-quantize one parameter; returns (name, s) of its fp8 states."""
        state = self.state[p]
        fp16_master = "master_param" in self.dtypes
        master = self._load(state, "master_param") if fp16_master else p.data
        exp_avg, exp_avg_sq = self._load(state, "exp_avg"), self._load(state, "exp_avg_sq")
        adamw_update_(master, p.grad.float(), exp_avg, exp_avg_sq, hp)
        if fp16_master:
            p.data.copy_(master)  # before quantize(), which scales its input in place
            self._store(state, "master_param", master)
        out = []
        for name, x in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if self.dtypes[name] != "fp32":
                s = self._store(state, name, x)
                if self.dtypes[name] == "fp8":
                    out.append((name, s))
        return out

    def _check_hooks(self) -> None:
        """Warn once when bf16 main grads were asked for but no parameter rounds its grads."""
        if self._checked_hooks or self.main_grads_dtype != "bf16":
            return
        self._checked_hooks = True
        params = [p for g in self.param_groups for p in g["params"]]
        if not all(getattr(p, "_lowp_main_grads_dtype", None) == "bf16" for p in params):
            warnings.warn(
                "main_grads_dtype=bf16 but install_main_grad_hooks was not called: grads stay fp32",
                stacklevel=3,
            )

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts every floating state to the parameter's dtype on load; cast codes back."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name, fmt in self.dtypes.items():
                if name in state:
                    state[name] = state[name].to(STORAGE[fmt])

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the chosen dtypes occupy in Megatron/TE's layout (fp32 masters: 4 B/elem).

        These are the sizes on the GPU, not this emulation's: here an fp32 master is the parameter
        itself and bf16 main grads are bf16 values held in fp32 ``.grad`` tensors.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        n, count = sum(p.numel() for p in params), len(params)

        def size(fmt: str) -> int:
            return n * ELEM_BYTES[fmt] + count * SCALE_BYTES[fmt]

        return {
            "master_weights": size(self.main_params_dtype),
            "optimizer_states": size(self.dtypes["exp_avg"]) + size(self.dtypes["exp_avg_sq"]),
            "main_grads": size(self.main_grads_dtype),
        }


def install_main_grad_hooks(model: nn.Module, main_grads_dtype: str) -> list:
    """Round ``p.grad`` to bf16 values after every accumulation, like Megatron's bf16 grad buffer.

    The hook runs after autograd has added a micro-batch's gradient to ``.grad``, so each accumulation
    is an fp32 add then one RNE rounding to bf16, as TE's wgrad GEMM accumulating into a bf16
    ``main_grad`` does. The values stay in fp32 tensors (the emulation's storage); ``memory_bytes``
    reports 2 B/elem. Returns the hook handles (none for fp32).
    """
    if main_grads_dtype not in ("fp32", "bf16"):
        raise ValueError(f"main_grads_dtype={main_grads_dtype!r}: expected fp32 or bf16")
    if main_grads_dtype == "fp32":
        return []

    def round_to_bf16(p: torch.Tensor) -> None:
        p.grad.copy_(p.grad.to(torch.bfloat16))

    handles = []
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(round_to_bf16))
            p._lowp_main_grads_dtype = "bf16"
    return handles
