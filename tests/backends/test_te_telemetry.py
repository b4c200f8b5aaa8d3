"""The TE telemetry's pure parts (no TE needed): the activation derivative it recomputes fc1's
gradient with is autograd's of the emulated activation."""

from __future__ import annotations

import pytest
import torch

from harness.backends.emulated import _act
from harness.backends.te_telemetry import _act_backward


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_activation_backward_matches_autograd(kind):
    gen = torch.Generator().manual_seed(0)
    width = 64 if kind == "swiglu" else 32
    h = (3 * torch.randn(128, width, generator=gen, dtype=torch.float64)).requires_grad_(True)
    dy = torch.randn(128, 32, generator=gen, dtype=torch.float64)
    (want,) = torch.autograd.grad(_act(h, kind), h, dy)
    torch.testing.assert_close(_act_backward(h.detach(), dy, kind), want, rtol=1e-12, atol=1e-12)
