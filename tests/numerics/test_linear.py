"""The emulated TE Linear: each GEMM reads the right operand copies (numerics.md section 1)."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_backend
from harness.backends.emulated import Activation, EmulatedLinear
from harness.numerics import NumericsContext, QuantizedLinear, quantize, resolve_recipe
from harness.numerics.linear import _QuantizedLinearFn
from tests.helpers import compose_cfg

BF16 = torch.bfloat16


def operands(seed=0, m=256, k=256, n=128):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over 5 decades inside every block, so that rowwise and columnwise
    # blocks flush different elements (power-of-two block scales are otherwise transparent)
    x = torch.randn(m, k, generator=g) * 10 ** (torch.rand(m, k, generator=g) * 5 - 4)
    w = torch.nn.Parameter(torch.randn(n, k, generator=g) * 0.05)
    b = torch.nn.Parameter(torch.randn(n, generator=g))
    dy = (torch.randn(m, n, generator=g) * 10 ** (torch.rand(m, n, generator=g) * 5 - 7)).to(BF16)
    return x.requires_grad_(), w, b, dy


def deq(t, recipe, role, columnwise=False, generator=None):
    return quantize(t, recipe, role=role, columnwise=columnwise, generator=generator).dequantize()


@pytest.mark.parametrize("name", ["tensorwise", "blockwise", "mxfp8", "nvfp4"])
def test_three_gemms_use_te_operands(name):
    recipe = resolve_recipe(name)
    ctx = NumericsContext()
    lin = QuantizedLinear("blocks.0.mlp.fc1", recipe, ctx)
    x, w, b, dy = operands()
    y = lin.linear(x, w, b)
    sr_state = ctx.generator.get_state()
    y.backward(dy)
    x16, w16 = x.detach().to(BF16), w.detach().to(BF16)
    x_row, w_row = deq(x16, recipe, "input"), deq(w16, recipe, "weight")
    y_ref = torch.addmm(b.detach().to(BF16).float(), x_row, w_row.t()).to(BF16)  # bias in the epilogue
    g = torch.Generator().manual_seed(0)
    g.set_state(sr_state)  # backward draws rowwise, then columnwise
    dy_row, dy_col = deq(dy, recipe, "grad", False, g), deq(dy, recipe, "grad", True, g)
    dx_ref = (dy_row @ deq(w16, recipe, "weight", columnwise=True)).to(BF16).float()
    x_col = deq(x16, recipe, "input", columnwise=True)
    dw_ref = (dy_col.t() @ x_col).to(BF16).float()
    assert torch.equal(y, y_ref)
    assert torch.equal(x.grad, dx_ref)
    assert torch.equal(w.grad, dw_ref)
    assert torch.equal(b.grad, dy.float().sum(0).to(BF16).float())  # dbias: unquantized grad
    if name != "tensorwise":  # copies differ: wgrad really used the columnwise ones
        wrong = (deq(dy, recipe, "grad", False, g).t() @ deq(x16, recipe, "input")).to(BF16).float()
        assert not torch.equal(w.grad, wrong)


def test_high_precision_wgrad():
    ctx = NumericsContext()
    lin = QuantizedLinear("blocks.0.mlp.fc1", resolve_recipe("blockwise"), ctx, fp8_wgrad=False)
    x, w, b, dy = operands()
    lin.linear(x, w, b).backward(dy)
    assert torch.equal(w.grad, (dy.float().t() @ x.detach().to(BF16).float()).to(BF16).float())


def test_weight_quantized_once_per_value(monkeypatch):
    ctx = NumericsContext()
    lin = QuantizedLinear("blocks.0.mlp.fc1", resolve_recipe("mxfp8"), ctx)
    calls = []
    inner = lin.quantizers["weight"].quantize
    monkeypatch.setattr(
        lin.quantizers["weight"], "quantize", lambda t, c=False: calls.append(c) or inner(t, c)
    )
    x, w, b, _ = operands()
    for _ in range(3):  # three micro-batches, one weight value
        lin.linear(x, w, b)
    assert calls == [False, True]
    w.data.add_(1.0)  # an optimizer writing p.data: the version counter does not move
    lin.linear(x, w, b)
    assert calls == [False, True, False, True]


def test_first_last_blocks_and_lm_head_stay_bf16():
    cfg = compose_cfg(
        "model=gpt_tiny",
        "model.num_layers=4",
        "recipe=tensorwise",
        "stability=first_last_bf16",
        "backend=emulated",
        "logger=none",
    )
    backend = build_backend(cfg, torch.device("cpu"))
    model = backend.build_model()
    quant = {n: m.quant for n, m in model.named_modules() if isinstance(m, EmulatedLinear)}
    assert quant["lm_head"] is None
    for name, q in quant.items():
        layer = name.split(".")[1] if name.startswith("blocks.") else None
        assert (q is not None) == (layer in ("1", "2")), name
    desc = backend.describe()
    assert desc["quantized_modules"]["blocks.0.attn.qkv"] == "bf16"
    assert desc["quantized_modules"]["blocks.1.mlp.fc2"] == "tensorwise"
    assert "RecipeConfig(name='tensorwise'" in desc["recipe_repr"]


def test_activation_fp8_input_store():
    x = torch.tensor([[500.0, -3.3, 1e-4, 0.7, 2.0, -600.0, 0.01, 5.0]]).to(BF16).requires_grad_()
    plain, stored = Activation("a", "gelu"), Activation("a", "gelu", fp8_input_store=True)
    y = stored(x)
    assert torch.equal(y, plain(x))  # forward unchanged
    dy = torch.ones_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    x8 = x.detach().to(torch.float8_e4m3fn).to(BF16).requires_grad_()  # unscaled, saturating
    (want,) = torch.autograd.grad(plain(x8), x8, dy)
    assert torch.equal(gx, want)
    (exact,) = torch.autograd.grad(plain(x), x, dy)
    assert not torch.equal(gx, exact)


def test_forward_is_not_an_autograd_leak():
    assert issubclass(_QuantizedLinearFn, torch.autograd.Function)
