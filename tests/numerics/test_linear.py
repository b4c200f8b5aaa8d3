"""The emulated TE Linear: each GEMM reads the right operand copies (docs/numerics.md section 1)."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_backend
from harness.backends.emulated import Activation, EmulatedLinear
from harness.numerics import NumericsContext, QuantizedLinear, quantize, resolve_recipe
from harness.numerics.linear import _QuantizedLinearFn
from harness.train import backend_spec
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


def test_weight_quantized_once_per_optimizer_step_or_write(monkeypatch):
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
    w.data.add_(1.0)  # an optimizer writing p.data: the version counter does not move ...
    ctx.weights_changed()  # ... but the backend says the optimizer stepped
    lin.linear(x, w, b)
    assert calls == [False, True, False, True]
    with torch.no_grad():
        w.add_(1.0)  # an in-place write through the parameter between steps (load_state_dict, a user)
    lin.linear(x, w, b)
    assert calls == [False, True, False, True, False, True]
    lin.linear(x, w, b)  # unchanged since: no host sync, no comparison, the cached copies
    assert len(calls) == 6


def test_wgrad_fp32_keeps_the_wgrad_gemm_unrounded():
    """Megatron's fp32 main grads: TE's fused wgrad accumulation writes the GEMM's fp32 result."""
    recipe = resolve_recipe("tensorwise")
    x, w, b, dy = operands()
    QuantizedLinear("blocks.0.mlp.fc1", recipe, NumericsContext(), wgrad_fp32=True).linear(x, w, b).backward(
        dy
    )
    x_col = deq(x.detach().to(BF16), recipe, "input", columnwise=True)
    dw_ref = deq(dy, recipe, "grad", True).t() @ x_col
    assert torch.equal(w.grad, dw_ref)
    assert not torch.equal(w.grad, dw_ref.to(BF16).float())  # really not rounded to bf16
    dx_bf16, db_bf16 = x.grad.clone(), b.grad.clone()
    x.grad = w.grad = b.grad = None
    QuantizedLinear("blocks.0.mlp.fc1", recipe, NumericsContext()).linear(x, w, b).backward(dy)
    assert torch.equal(w.grad, dw_ref.to(BF16).float())  # the default rounds it
    assert torch.equal(x.grad, dx_bf16) and torch.equal(b.grad, db_bf16)  # dx, db unchanged


def test_bf16_linear_wgrad_fp32_matches_autograd_but_unrounded():
    x, w, b, dy = operands()
    y = EmulatedLinear("blocks.0.attn.proj", 256, 128, True, wgrad_fp32=True)
    with torch.no_grad():
        y.weight.copy_(w), y.bias.copy_(b)
    out = y(x)
    out.backward(dy)
    ref = EmulatedLinear("blocks.0.attn.proj", 256, 128, True)
    with torch.no_grad():
        ref.weight.copy_(w), ref.bias.copy_(b)
    x2 = x.detach().clone().requires_grad_()
    out_ref = ref(x2)
    out_ref.backward(dy)
    assert torch.equal(out, out_ref)
    assert torch.equal(x.grad, x2.grad) and torch.equal(y.bias.grad, ref.bias.grad)
    exact = dy.float().t() @ x.detach().to(BF16).float()
    assert torch.equal(y.weight.grad, exact)
    assert torch.equal(ref.weight.grad, exact.to(BF16).float())


@pytest.mark.parametrize(
    "overrides, fp32",
    [
        ([], True),  # the default: master weights, fp32 main grads
        (["optimizer=bf16_params"], False),
        (["optimizer.use_precision_aware_optimizer=true", "optimizer.main_grads_dtype=bf16"], False),
    ],
)
def test_block_wgrads_are_fp32_exactly_when_te_fuses_them(overrides, fp32):
    cfg = compose_cfg("model=gpt_tiny", "recipe=tensorwise", "backend=emulated", "logger=none", *overrides)
    backend = build_backend(backend_spec(cfg), torch.device("cpu"))
    model = backend.build_model()
    x = torch.randint(0, cfg.model.vocab_size, (2, 32))
    with backend.autocast():
        model.loss(x, x).backward()
    for name, p in model.named_parameters():
        if p.grad is None or p.dim() != 2 or name.startswith(("wte", "wpe")):
            continue
        bf16_valued = torch.equal(p.grad.to(BF16).float(), p.grad.float())
        assert bf16_valued == (not fp32 or name == "lm_head.weight"), name


def test_first_last_blocks_and_lm_head_stay_bf16():
    cfg = compose_cfg(
        "model=gpt_tiny",
        "model.num_layers=4",
        "recipe=tensorwise",
        "stability=first_last_bf16",
        "backend=emulated",
        "logger=none",
    )
    backend = build_backend(backend_spec(cfg), torch.device("cpu"))
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


@pytest.mark.parametrize(
    "recipe,act,expect",
    [  # (qkv input, fc1 input, fc2 input, fc1 grad, fc1 fp32 output)
        ("delayed", "gelu", (True, True, True, True, True)),
        ("delayed", "swiglu", (True, True, True, False, True)),
        ("mxfp8", "gelu", (False, False, True, True, True)),
        ("tensorwise", "gelu", (False,) * 5),
        ("blockwise", "gelu", (False,) * 5),
        ("nvfp4", "gelu", (False,) * 5),
    ],
)
def test_fused_cast_table_follows_te(recipe, act, expect):
    from harness.backends.emulated import fused_casts

    f = {leaf: fused_casts(f"blocks.3.x.{leaf}", recipe, act) for leaf in ("qkv", "proj", "fc1", "fc2")}
    got = (
        f["qkv"]["fused_input_cast"],
        f["fc1"]["fused_input_cast"],
        f["fc2"]["fused_input_cast"],
        f["fc1"]["fused_grad_cast"],
        f["fc1"]["fp32_output"],
    )
    assert got == expect
    assert not any(f["proj"].values())  # the attention output arrives in bf16 under every recipe


def _block0_operands(recipe: str, monkeypatch) -> dict:
    """The tensors block 0's QKV and fc1 hand to their quantizers in one training step, and the
    norm outputs they came from."""
    cfg = compose_cfg("model=gpt_tiny", f"recipe={recipe}", "backend=emulated", "logger=none")
    backend = build_backend(backend_spec(cfg), torch.device("cpu"))
    model = backend.build_model()
    seen: dict = {}
    blk = model.blocks[0]
    blk.ln1.register_forward_hook(lambda m, i, o: seen.setdefault("ln1", o.detach()))
    for name in ("qkv", "fc1"):
        q = (blk.attn.qkv if name == "qkv" else blk.mlp.fc1).quant
        orig_in, orig_grad = q.quantize_input, q.quantize_grad
        monkeypatch.setattr(
            q, "quantize_input", lambda x, c, n=name, f=orig_in: (seen.setdefault(n, x), f(x, c))[1]
        )
        monkeypatch.setattr(
            q,
            "quantize_grad",
            lambda d, r, c, n=name, f=orig_grad: (seen.setdefault(n + "_grad", d), f(d, r, c))[1],
        )
    idx = torch.randint(
        0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(0)
    )
    with backend.autocast():
        logits = model(idx)
    logits.float().square().mean().backward()
    return seen


def test_delayed_quantizes_norm_output_and_dgelu_from_fp32(monkeypatch):
    """TE's fused LayerNorm+cast and dbias_dgelu+cast under delayed scaling: no bf16 rounding first."""
    seen = _block0_operands("delayed", monkeypatch)
    ln = seen["ln1"].reshape(-1, seen["ln1"].shape[-1])
    assert seen["qkv"].dtype == torch.float32 and torch.equal(seen["qkv"], ln)
    assert not torch.equal(ln, ln.to(BF16).float())  # the fp32 values really are finer than bf16
    g = seen["fc1_grad"]
    assert g.dtype == torch.float32 and not torch.equal(g, g.to(BF16).float())


def test_tensorwise_quantizes_bf16_norm_output(monkeypatch):
    seen = _block0_operands("tensorwise", monkeypatch)
    ln = seen["ln1"].reshape(-1, seen["ln1"].shape[-1])
    assert seen["qkv"].dtype == BF16 and torch.equal(seen["qkv"], ln.to(BF16))
    assert seen["fc1_grad"].dtype == BF16


def test_residual_stream_and_norm_parameters_hold_bf16_values():
    from harness.model.gpt import bf16_values

    cfg = compose_cfg("model=gpt_tiny", "recipe=bf16", "backend=emulated", "logger=none")
    model = build_backend(backend_spec(cfg), torch.device("cpu")).build_model()
    outs = []
    for blk in model.blocks:
        blk.register_forward_hook(lambda m, i, o: outs.append(o.detach()))
    with torch.no_grad():
        model.blocks[0].ln1.weight.add_(1e-4 * torch.randn_like(model.blocks[0].ln1.weight))  # not bf16-exact
        model(torch.zeros(1, 16, dtype=torch.long))
        x = torch.randn(1, 16, cfg.model.hidden_size)
        ln = model.blocks[0].ln1
        ref = torch.nn.functional.layer_norm(
            x, ln.normalized_shape, bf16_values(ln.weight), bf16_values(ln.bias)
        )
        assert torch.equal(ln(x), ref)
    assert outs and all(o.dtype == torch.float32 and torch.equal(o, bf16_values(o)) for o in outs)
