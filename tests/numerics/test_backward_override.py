"""recipe.backward_override: the backward GEMMs on TE's operands (docs/numerics.md "backward_override").

Two layers. The emulator against its own definition, for every quantizing recipe but delayed, on
both GEMM paths: dy unquantized bf16; high_precision: dgrad on bf16(W), wgrad on bf16(x);
dequantized: on the rowwise forward copies dequantized to bf16; no columnwise copy made. And the
emulator against TE 2.20.2 on an H200 (`python -m benchmarks.te_backward_override`, files in
tests/assets/te_backward_override/): forward codes and scales equal at atol=0, each backward GEMM's
operands equal TE's at atol=0, and dx, dW, db equal to TE's within one bf16 ulp plus the
accumulation-order bound (fp32 for the bf16 backward GEMMs of an override; Hopper's FP8 tensor-core
accumulation for the FP8 GEMMs); under an override lowp's dx and dW are exactly bf16 of the fp32 GEMM
on the recorded operands. Missing assets fail these tests: they are the kernel check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.numerics import NumericsContext, QuantizedLinear, quantize, resolve_recipe
from harness.numerics.linear import _FastQuantizedLinearFn

BF16 = torch.bfloat16
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "te_backward_override"
RECIPES = ["tensorwise", "blockwise", "mxfp8", "nvfp4"]
OVERRIDES = ["high_precision", "dequantized"]


def operands(seed=0, m=64, k=64, n=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 10 ** (torch.rand(m, k, generator=g) * 4 - 2)
    w = torch.nn.Parameter(torch.randn(n, k, generator=g) * 0.05)
    b = torch.nn.Parameter(torch.randn(n, generator=g))
    dy = (torch.randn(m, n, generator=g) * 1e-3).to(BF16)
    return x.requires_grad_(), w, b, dy


def _run(recipe, x, w, b, dy, *, fast: bool, name="blocks.0.mlp.fc1", ctx=None):
    ctx = ctx or NumericsContext()
    lin = QuantizedLinear(name, recipe, ctx, fast_gemm=fast, fused_input_cast=True, fp32_output=True)
    x = x.detach().clone().requires_grad_()
    w = torch.nn.Parameter(w.detach().clone())
    b = torch.nn.Parameter(b.detach().clone())
    # the fast GEMMs called directly: casts stay eager (fused ones compile: test_fast_path.py)
    y = _FastQuantizedLinearFn.apply(x, w, b, lin) if fast else lin.linear(x, w, b)
    y.backward(dy)
    return lin, y, x.grad, w.grad, b.grad


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("name", RECIPES)
def test_backward_gemms_take_the_override_s_operands(name, override):
    recipe = resolve_recipe(name, backward_override=override)
    x, w, b, dy = operands()
    lin, y, dx, dw, db = _run(recipe, x, w, b, dy, fast=False)
    assert not (lin.fused_input_cast or lin.fused_grad_cast or lin.fp32_output)  # LayerNormLinear + Linear
    x16, w16 = x.detach().to(BF16), w.detach().to(BF16)
    if override == "high_precision":
        x_op, w_op = x16, w16
    else:  # the rowwise forward copies, dequantized to the activation dtype
        x_op = quantize(x16, recipe, role="input").dequantize().to(BF16)
        w_op = quantize(w16, recipe, role="weight").dequantize().to(BF16)
    assert y.dtype == BF16  # no fp32 storage for an activation fused with a cast
    assert torch.equal(dx, (dy.float() @ w_op.float()).to(BF16).float())  # dy: bf16, not quantized
    assert torch.equal(dw, (dy.float().t() @ x_op.float()).to(BF16).float())
    assert torch.equal(db, dy.float().sum(0).to(BF16).float())
    # the fast GEMMs (CUDA's path, run here on the CPU) read the same bf16 backward operands; their
    # forward differs for tensorwise/nvfp4 by the folded scales (tests/numerics/test_fast_path.py)
    _, _, dx_f, dw_f, db_f = _run(recipe, x, w, b, dy, fast=True)
    for ours, fast in ((dx, dx_f), (dw, dw_f), (db, db_f)):
        assert torch.equal(ours, fast)


def test_override_quantizes_no_grad_and_makes_no_columnwise_copy():
    recipe = resolve_recipe("blockwise", backward_override="dequantized")
    x, w, b, dy = operands()
    ctx = NumericsContext()
    with ctx.telemetry.collect() as rows:
        lin, *_ = _run(recipe, x, w, b, dy, fast=False, ctx=ctx)
    assert lin._weight_cache[1] is None  # no columnwise weight copy (TE: columnwise_usage=False)
    assert {row["tensor"] for row in rows} == {"input", "weight"}  # no grad row: dy is bf16
    assert "backward=dequantized" in repr(lin)


def test_without_override_the_backward_is_unchanged():
    """backward_override=None is the quantized backward (the field's default = lowp before it)."""
    x, w, b, dy = operands()
    base = _run(resolve_recipe("tensorwise"), x, w, b, dy, fast=False)
    none = _run(resolve_recipe("tensorwise", backward_override=None), x, w, b, dy, fast=False)
    for a, c in zip(base[1:], none[1:]):
        assert torch.equal(a, c)
    hp = _run(resolve_recipe("tensorwise", backward_override="high_precision"), x, w, b, dy, fast=False)
    assert not torch.equal(base[2], hp[2])


# ---- against TE 2.20.2 on an H200 ------------------------------------------------------------------


def _codes(op: dict, columnwise: bool) -> torch.Tensor:
    names = ("_transpose", "_columnwise_data") if columnwise else ("_data", "_rowwise_data")
    return next(op[n] for n in names if n in op)


def _scales(op: dict, columnwise: bool) -> torch.Tensor:
    names = ("_scale_inv", "_columnwise_scale_inv") if columnwise else ("_scale_inv", "_rowwise_scale_inv")
    return next(op[n] for n in names if n in op)


def _same_copy(ours, op: dict, columnwise: bool) -> None:
    """Codes equal; scales equal on TE's valid region (its 128x128 scale grids pad the last dim)."""
    assert op["kind"] == "quantized", op.get("kind")
    assert torch.equal(ours.data, _codes(op, columnwise))
    te_s, our_s = _scales(op, columnwise), ours.scale_inv.float()
    assert te_s.numel() == our_s.numel()
    our_s = our_s.reshape(te_s.shape)
    if op.get("_is_2D_scaled") == "True":
        cols = -(-ours.data.shape[-1] // 128)
        te_s, our_s = te_s[:, :cols], our_s[:, :cols]
    assert torch.equal(our_s, te_s)


def _gemm(case: dict, layout: str) -> dict:
    (call,) = [c for c in case["gemms"] if c["layout"] == layout]
    return call


def _plain(op: dict) -> torch.Tensor:
    assert op["kind"] == "plain" and op["dtype"] == "torch.bfloat16", (op.get("kind"), op.get("dtype"))
    return op["values"]


def _gemm_close(ours, te, a, b, fp8: bool = False) -> None:
    """The same GEMM a @ b accumulated in another order (and, for tensorwise, scaled in cuBLAS's
    epilogue), each rounded to bf16: apart by at most one bf16 ulp of either result plus the
    accumulation's bound: fp32's k * 2^-23 * (|a| @ |b|) for bf16 operands (the backward GEMMs under
    an override), 2^-12 * (|a| @ |b|) for an FP8 GEMM on Hopper, whose tensor cores keep partial sums
    in fewer bits than fp32 (largest seen on the H200 capture: 2^-13.8)."""
    ours, te = ours.float().reshape(te.shape), te.float()
    scale = 2.0**-12 if fp8 else a.shape[-1] * 2.0**-23
    acc = (scale * (a.abs() @ b.abs())).reshape(te.shape)
    bound = torch.maximum(ours.abs(), te.abs()) * 2.0**-7 + acc
    assert torch.all((ours - te).abs() <= bound), (ours - te).abs().max()


def _te_blob(recipe_name: str) -> dict:
    path = ASSETS / f"te_backward_override_{recipe_name}.pt"
    if not path.is_file():
        pytest.fail(
            f"{path} is missing: run `python -m benchmarks.te_backward_override --out DIR` on an H200 "
            "with TE 2.20.2 and copy its .pt files there (this is the kernel check, it does not skip)"
        )
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("override", [None, *OVERRIDES])
@pytest.mark.parametrize("name", ["tensorwise", "blockwise"])
def test_linear_matches_te_on_h200(name, override):
    blob = _te_blob(name)
    case = blob["cases"][f"linear/{override or 'none'}"]
    inp = blob["inputs"]
    recipe = resolve_recipe(name, backward_override=override)
    x16, w16, dy = inp["x"], inp["w"], inp["dy"]
    xr, wr = quantize(x16, recipe, role="input"), quantize(w16, recipe, role="weight")
    fprop, dgrad, wgrad = _gemm(case, "TN"), _gemm(case, "NN"), _gemm(case, "NT")
    _same_copy(wr, fprop["A"], False)  # y = x W^T: TE's A is W, B is x
    _same_copy(xr, fprop["B"], False)
    if override is None:
        _same_copy(quantize(w16, recipe, role="weight", columnwise=True), dgrad["A"], True)
        _same_copy(quantize(x16, recipe, role="input", columnwise=True), wgrad["A"], True)
        assert dgrad["B"]["kind"] == "quantized" and wgrad["B"]["kind"] == "quantized"
    else:
        x_op, w_op = (
            (x16, w16)
            if override == "high_precision"
            else (xr.dequantize().to(BF16), wr.dequantize().to(BF16))
        )
        assert torch.equal(_plain(dgrad["A"]), w_op)
        assert torch.equal(_plain(wgrad["A"]), x_op)
        assert torch.equal(_plain(dgrad["B"]), dy) and torch.equal(_plain(wgrad["B"]), dy)
    # lowp's emulator on the same x, W, b, dy (the proj linear: no fused cast in any recipe)
    ctx = NumericsContext()
    lin = QuantizedLinear("blocks.0.attn.proj", recipe, ctx, fast_gemm=False)
    x = x16.float().requires_grad_()
    w = torch.nn.Parameter(w16.float())
    b = torch.nn.Parameter(inp["b"].float())
    y = lin.linear(x, w, b)
    y.backward(dy)
    xq, wq = xr.dequantize().float(), wr.dequantize().float()
    ones = torch.ones(x16.shape[0], 1)
    bias_col = inp["b"].float()[:, None]
    _gemm_close(y, case["y"], torch.cat([xq, ones], 1), torch.cat([wq, bias_col], 1).t(), fp8=True)
    dy_a = dy.float() if override else quantize(dy, recipe, role="grad").dequantize().float()
    dy_b = dy.float() if override else quantize(dy, recipe, role="grad", columnwise=True).dequantize().float()
    w_b = (
        w16.float()
        if override
        else quantize(w16, recipe, role="weight", columnwise=True).dequantize().float()
    )
    x_b = (
        x16.float() if override else quantize(x16, recipe, role="input", columnwise=True).dequantize().float()
    )
    _gemm_close(x.grad, case["dx"], dy_a, w_b.abs() + wq.abs(), fp8=override is None)
    _gemm_close(w.grad, case["d_weight"], dy_b.t(), x_b.abs() + xq.abs(), fp8=override is None)
    _gemm_close(b.grad, case["d_bias"], dy.float().t(), torch.ones(dy.shape[0], 1))
    if override is not None:  # lowp: exactly bf16 of the fp32 GEMM on TE's recorded operands
        assert torch.equal(x.grad, (dy.float() @ _plain(dgrad["A"]).float()).to(BF16).float())
        assert torch.equal(w.grad, (dy.float().t() @ _plain(wgrad["A"]).float()).to(BF16).float())


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("name", ["tensorwise", "blockwise"])
def test_layernorm_linear_quantizes_the_bf16_norm_output_on_h200(name, override):
    """With an override TE's LayerNormLinear writes the norm output in bf16 and quantizes that
    (no fused norm+cast); high_precision's wgrad reads that bf16 output (ln_out_hp)."""
    blob = _te_blob(name)
    case = blob["cases"][f"layernorm_linear/{override}"]
    recipe = resolve_recipe(name, backward_override=override)
    fprop, wgrad = _gemm(case, "TN"), _gemm(case, "NT")
    hp = blob["cases"]["layernorm_linear/high_precision"]
    ln_out = _plain(_gemm(hp, "NT")["A"])  # the bf16 norm output TE saved
    xr = quantize(ln_out, recipe, role="input")
    _same_copy(xr, fprop["B"], False)
    want = ln_out if override == "high_precision" else xr.dequantize().to(BF16)
    assert torch.equal(_plain(wgrad["A"]), want)
