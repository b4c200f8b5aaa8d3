"""The emulator on CUDA tensors gives the CPU's codes (device-independent numerics)."""

from __future__ import annotations

import pytest
import torch

from harness.numerics import NumericsContext, QuantizedLinear, quantize, resolve_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [
    ("tensorwise", "input", {}),
    ("tensorwise", "grad", {}),
    ("delayed", "grad", {"scale": 3.0}),
    ("blockwise", "input", {}),
    ("blockwise", "weight", {"power_2_scales": False}),
    ("mxfp8", "input", {}),
    ("mxfp8", "grad", {"fp8": "hybrid"}),
    ("nvfp4", "input", {}),
    ("nvfp4", "weight", {}),
    ("int4_qat", "weight", {}),
]


@pytest.mark.parametrize(("recipe", "role", "kw"), CASES)
@pytest.mark.parametrize("columnwise", [False, True])
def test_cuda_matches_cpu(recipe, role, kw, columnwise):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 384, generator=g) * torch.logspace(-5, 3, 384)).bfloat16()
    cpu = quantize(x, recipe, role=role, columnwise=columnwise, **kw)
    gpu = quantize(x.cuda(), recipe, role=role, columnwise=columnwise, **kw)
    assert torch.equal(gpu.data.cpu(), cpu.data)
    if cpu.scale_inv is not None:
        assert torch.equal(gpu.scale_inv.cpu().view(torch.uint8), cpu.scale_inv.view(torch.uint8))
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())


@pytest.mark.parametrize("recipe", ["delayed", "blockwise", "mxfp8", "nvfp4"])
def test_linear_runs_on_cuda(recipe):
    ctx = NumericsContext("cuda")
    lin = QuantizedLinear("blocks.0.mlp.fc1", resolve_recipe(recipe), ctx)
    x = torch.randn(64, 128, device="cuda", requires_grad=True)
    w = torch.nn.Parameter(torch.randn(96, 128, device="cuda") * 0.05)
    with ctx.autocast():
        y = lin.linear(x, w, None)
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
