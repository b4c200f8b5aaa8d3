"""The optimizer package: the training loop's `Optimizer`, its schedule and clipping (optimizer.py),
Megatron's fp32 main grads (main_grads.py), CPU offload (offload.py), TE FusedAdam (te_fused_adam.py)
and its one-pass AdamW kernel (adam_kernel.py), the step inside backward (in_backward.py) and the
pure-PyTorch precision-aware AdamW of the emulated backend (emulated_adam.py)."""

from harness.optim.main_grads import MainGrads
from harness.optim.offload import CpuOffloadAdamW
from harness.optim.optimizer import (
    TORCH_DTYPES,
    Optimizer,
    build_optimizer,
    clip_grad,
    lr_at,
    param_groups,
    quantized_parts,
    set_lr,
    tensor_bytes,
)
from harness.optim.te_fused_adam import fused_adam_batched_fp8_states, fused_adam_one_pass, te_fused_adam

__all__ = [
    "TORCH_DTYPES",
    "CpuOffloadAdamW",
    "MainGrads",
    "Optimizer",
    "build_optimizer",
    "clip_grad",
    "fused_adam_batched_fp8_states",
    "fused_adam_one_pass",
    "lr_at",
    "param_groups",
    "quantized_parts",
    "set_lr",
    "te_fused_adam",
    "tensor_bytes",
]
