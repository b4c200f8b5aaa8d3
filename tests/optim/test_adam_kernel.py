"""harness.optim.adam_kernel on the CPU: TE's master split, the reference step's arithmetic, the
Triton kernel under Triton's interpreter, and clip_grad handing its coefficient to the step. The
kernel's bits against TE's own kernel are tests/optim/test_te_fused_adam_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from harness.optim import adam_kernel as K
from tests.helpers import in_triton_interpreter


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


def test_reference_step_is_adamw_with_bias_correction_and_the_clipping_coefficient():
    """Three steps against AdamW written out in float64 (TE's ADAM_MODE_1: decay added to the
    update): the fp32 master agrees to fp32 rounding, and the coefficient scales the gradient."""
    torch.manual_seed(0)
    n, lr, b1, b2, eps, wd = 4096, 1e-3, 0.9, 0.95, 1e-8, 0.1
    master = torch.randn(n) * 0.02
    hi, lo = K.split_master(master)
    param, m, v = hi.view(torch.bfloat16).clone(), torch.zeros(n), torch.zeros(n)
    p64, m64, v64 = master.double(), torch.zeros(n).double(), torch.zeros(n).double()
    for step, coef in ((1, None), (2, 0.25), (3, 1.0)):
        g = torch.randn(n) * 0.1
        scale = None if coef is None else torch.tensor([coef])
        K.reference_step_(g, param, m, v, lo, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step,
                          grad_scale=scale)  # fmt: skip
        g64 = g.double() * (1.0 if coef is None else coef)
        m64 = b1 * m64 + (1 - b1) * g64
        v64 = b2 * v64 + (1 - b2) * g64 * g64
        update = (m64 / (1 - b1**step)) / ((v64 / (1 - b2**step)).sqrt() + eps) + wd * p64
        p64 = p64 - lr * update
    got = K.join_master(param.view(torch.int16), lo).double()
    assert ((got - p64).abs() <= 1e-6 * p64.abs() + 1e-9).all()
    assert torch.allclose(m.double(), m64, rtol=1e-5, atol=1e-9)


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


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_the_kernel_under_triton_s_interpreter_is_the_reference_step():
    """The interpreter computes tl.fma as a product and a sum, two roundings, so the reference runs
    with the same fma here: the moments are equal to the bit, the master (whose steps compound) to a
    few fp32 ulps; the bits against TE's kernel are the GPU test's."""
    in_triton_interpreter(
        """
import torch
from harness.optim import adam_kernel as K
K._fma = lambda a, b, c: a * b + c
torch.manual_seed(0)
n = 5000
master = torch.randn(n) * 0.02
hi, lo = K.split_master(master)
a = [hi.view(torch.bfloat16).clone(), torch.zeros(n), torch.zeros(n), lo.clone()]
b = [t.clone() for t in a]
for step, coef in ((1, None), (2, 0.37), (3, 1.0)):
    g = torch.randn(n) * 0.1
    kw = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
              grad_scale=None if coef is None else torch.tensor([coef]))
    K.step_(g, *a, **kw)
    K.reference_step_(g, *b, **kw)
assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
ma, mb = (K.join_master(x[0].view(torch.int16), x[3]).view(torch.int32) for x in (a, b))
assert int((ma - mb).abs().max()) <= 16, int((ma - mb).abs().max())
"""
    )
