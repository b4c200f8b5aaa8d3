"""INT4 fake QAT (miles, docs/numerics.md section 9): worked groups and the straight-through gradient."""

from __future__ import annotations

import torch

from harness.numerics import quantize
from harness.numerics.int4 import fake_int4, quantize_int4


def test_worked_group():
    w = torch.tensor([[0.7, -0.35, 0.1, 0.05]])  # one group of 4: s = 0.7/7 = 0.1
    q = quantize_int4(w, 4)
    assert q.scale.tolist() == [[torch.tensor(0.7) / torch.tensor(7.0)]]
    assert q.data.tolist() == [[7, -4, 1, 0]]  # -3.5 -> -4 and 0.5 -> 0: half to even
    want = (q.data.float() * q.scale[0, 0]).bfloat16().float()
    assert torch.equal(q.dequantize(), want)


def test_padding_zero_group_and_group_size():
    w = torch.zeros(2, 6)
    w[0, :3] = torch.tensor([1.0, -2.0, 14.0])
    q = quantize(w, "int4_qat", role="weight", int4_group_size=4)  # in=6 padded to 8: 2 groups
    assert q.scale.shape == (2, 2)
    assert torch.equal(q.scale[1], torch.full((2,), 1e-5))  # zero groups: the 1e-5 floor
    assert q.data.shape == (2, 6) and q.data[0, 2] == 7 and q.data[1].eq(0).all()
    assert q.dequantize().shape == w.shape


def test_straight_through_gradient():
    w = torch.randn(8, 32, requires_grad=True)
    w_hat = fake_int4(w, 16)
    assert w_hat.dtype == torch.bfloat16
    g = torch.randn(8, 32).bfloat16()
    w_hat.backward(g)
    assert torch.equal(w.grad, g.float())
