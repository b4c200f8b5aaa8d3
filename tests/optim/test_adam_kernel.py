"""harness.optim.adam_kernel on the CPU: TE's master split, its bias corrections, the kernel's PTX
arithmetic, and clip_grad handing its coefficient to the step. The kernel's bits against TE's own
kernel are tests/optim/test_te_fused_adam_gpu.py's (Triton's interpreter cannot run inline PTX)."""

from __future__ import annotations

import pytest
import torch

from harness.optim import adam_kernel as K


def test_split_and_join_of_the_master_are_exact_and_round_the_bf16_half_to_nearest():
    torch.manual_seed(0)
    x = torch.cat(
        [torch.randn(10_000) * 10.0 ** torch.randint(-8, 4, (10_000,)), torch.tensor([0.0, -0.0, 1.0])]
    )
    hi, lo = K.split_master(x)
    assert hi.dtype == lo.dtype == torch.int16
    assert torch.equal(K.join_master(hi, lo).view(torch.int32), x.view(torch.int32))
    bf16 = hi.view(torch.bfloat16).float()
    ulp = (x.abs().view(torch.int32) >> 16 << 16).view(torch.float32) * 2.0**-7
    assert ((bf16 - x).abs() <= ulp / 2 * (1 + 1e-6)).all()  # to nearest, not truncated


def test_bias_corrections_are_te_s_double_pow_of_the_fp32_betas():
    """TE's host code takes beta as a float and evaluates 1 - std::pow(beta, step) in double."""
    import numpy as np

    bc1, bc2 = K.bias_corrections(0.9, 0.95, 7)
    b1, b2 = float(np.float32(0.9)), float(np.float32(0.95))
    assert (bc1, bc2) == (1.0 - b1**7, 1.0 - b2**7)
    assert bc1 != 1.0 - 0.9**7  # the fp32 beta, not the Python double


def test_the_arithmetic_is_te_s_fast_math_instructions_and_writes_its_outputs_last():
    """TE's kernel (built with --use_fast_math): every op flushes denormals, divisions are a
    reciprocal and a multiply, the square root is approximate; the IEEE variants exist to measure
    that on the device. The outputs are written only after every input was read (the asm's output
    registers may share the inputs')."""
    te = K.arithmetic(**K.TE_ARITHMETIC)
    ops = [op.split()[0] for op in te.strip("{} ").split(";")[1:] if op.strip()]
    assert ops.count("rcp.approx.ftz.f32") == 3 and ops.count("sqrt.approx.ftz.f32") == 1
    assert ops.count("fma.rn.ftz.f32") == 4 and "div.rn.f32" not in te
    assert all(".ftz" in op for op in ops if not op.startswith("mov"))
    assert te.index("mov.f32 $0") > max(te.rindex(f"${i}") for i in range(3, 14))
    ieee = K.arithmetic(div="rn", sqrt="rn", ftz=False)
    assert "div.rn.f32" in ieee and "sqrt.rn.f32" in ieee and ".ftz" not in ieee and "rcp" not in ieee
    with pytest.raises(ValueError, match="div='fast'"):
        K.arithmetic(div="fast")


def test_clip_grad_hands_its_coefficient_to_an_optimizer_that_scales_in_its_step():
    """With an inner optimizer that has `grad_scale` (the one-pass FusedAdam), clip_grad leaves the
    grads as they are and sets the coefficient; with any other it multiplies the grads."""
    from harness.optim.optimizer import Optimizer, clip_grad

    class ScalesInStep(torch.optim.SGD):
        grad_scale = None

    for cls in (ScalesInStep, torch.optim.SGD):
        params = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
        for p in params:
            p.grad = torch.full((4,), 3.0)  # norm 6 * sqrt(2)... clipped to 1
        opt = Optimizer(cls(params, lr=0.1), params)
        norm = clip_grad(opt, 1.0)
        coef = 1.0 / (float(norm) + 1e-6)
        if cls is ScalesInStep:
            assert all(torch.equal(p.grad, torch.full((4,), 3.0)) for p in params)
            assert abs(float(opt.inner.grad_scale) - coef) < 1e-7
        else:
            assert all(torch.allclose(p.grad, torch.full((4,), 3.0 * coef)) for p in params)
