"""PrecisionAwareAdamW against torch's AdamW, hand computations of docs/numerics.md §8, and tiny trainings
(the state encodings' exact tests: tests/numerics/test_adam_states.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.numerics.adam_states import FP16_RANGE, dequantize, quantize
from harness.optim import param_groups
from harness.optim.emulated_adam import PrecisionAwareAdamW, install_main_grad_hooks
from tests.numerics.references.e4m3 import e4m3_codes

f32 = np.float32


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def fill_grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-4, 0, (), generator=gen).item()


def make_opt(model: nn.Module, **kw) -> PrecisionAwareAdamW:
    return PrecisionAwareAdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kw)


def test_fp32_matches_torch_adamw():
    ours, ref = mlp(), mlp()
    opt = make_opt(ours)
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(6):
        fill_grads(ours, step)
        fill_grads(ref, step)
        opt.step()
        ref_opt.step()
    assert opt.state_dict()["param_groups"][0]["step"] == 6
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
        for name in ("exp_avg", "exp_avg_sq"):
            ref_state = ref_opt.state[q][name]  # torch's lerp form differs by cancellation near 0
            torch.testing.assert_close(
                opt.state[p][name], ref_state, rtol=1e-6, atol=1e-6 * ref_state.abs().max()
            )


def test_step_from_zero_state_by_hand():
    p = nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    p.grad = torch.tensor([3e-3, -1e-2, 2e-5, 0.0])
    opt = PrecisionAwareAdamW(
        [p],
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        exp_avg_dtype="fp8",
        exp_avg_sq_dtype="fp8",
    )
    opt.step()
    g, p0 = p.grad.numpy(), np.array([0.5, -1.0, 2.0, 0.0], dtype=f32)
    m = (f32(1) - f32(0.9)) * g
    v = (f32(1) - f32(0.95)) * g * g
    bc1, bc2 = f32(1 - float(f32(0.9))), f32(1 - float(f32(0.95)))
    update = (m / bc1) / (np.sqrt(v / bc2) + f32(1e-8)) + f32(0.1) * p0
    np.testing.assert_allclose(p.detach().numpy(), p0 - f32(0.01) * update, rtol=1e-6)
    for name, x in (("exp_avg", m), ("exp_avg_sq", v)):
        scale = f32(1) / (np.abs(x).max() / f32(448))
        assert opt.state[p][name + "_scale"].item() == scale
        assert np.array_equal(opt.state[p][name].view(torch.uint8).numpy(), e4m3_codes(x * scale))
    # step 2 starts from the decoded codes, q * scale_inv, not from the fp32 values above
    st = opt.state[p]
    m1 = st["exp_avg"].float().numpy() * st["exp_avg_scale_inv"].item()
    p.grad = torch.tensor([-1e-3, 5e-3, 0.0, 1e-4])
    opt.step()
    m2 = f32(0.9) * m1 + (f32(1) - f32(0.9)) * p.grad.numpy()
    scale = f32(1) / (np.abs(m2).max() / f32(448))
    assert np.array_equal(st["exp_avg"].view(torch.uint8).numpy(), e4m3_codes(m2 * scale))


def test_fp16_and_bf16_states():
    model = mlp()
    opt = make_opt(model, exp_avg_dtype="bf16", exp_avg_sq_dtype="fp16")
    p = model[0].weight
    fill_grads(model, 0)
    m32 = float(1 - f32(0.9)) * p.grad  # first step from zero: m = (1 - beta1) g in fp32
    v32 = float(1 - f32(0.95)) * p.grad * p.grad
    opt.step()
    st = opt.state[p]
    assert st["exp_avg"].dtype == torch.bfloat16 and torch.equal(st["exp_avg"], m32.bfloat16())
    s = torch.div(v32.abs().max().reshape(1), torch.tensor([FP16_RANGE]))
    assert st["exp_avg_sq"].dtype == torch.float16 and torch.equal(st["exp_avg_sq_scale_inv"], s)
    assert torch.equal(st["exp_avg_sq"], (v32 * torch.reciprocal(s)).half())
    assert st["exp_avg_sq"].float().abs().max().item() == pytest.approx(FP16_RANGE, rel=1e-3)
    torch.testing.assert_close(opt._load(st, "exp_avg_sq"), v32, rtol=1e-3, atol=0)
    # fp16 zero states are guarded in TE (1/s -> 0 when s = 0): zeros, no NaN, no error
    q, _, si, _ = quantize(torch.zeros(3), "fp16")
    assert q.abs().sum().item() == 0 and si.item() == 0 and dequantize(q, si).abs().sum().item() == 0


def test_fp16_master_weights():
    model = mlp()
    opt = make_opt(model, main_params_dtype="fp16")
    fill_grads(model, 0)
    opt.step()
    for p in model.parameters():
        st = opt.state[p]
        master = opt._load(st, "master_param")
        assert st["master_param"].dtype == torch.float16
        assert st["master_param"].float().abs().max().item() == pytest.approx(FP16_RANGE, rel=1e-3)
        torch.testing.assert_close(master, p.detach(), rtol=2**-11, atol=0)  # param = fp32 r_p
    assert opt.memory_bytes()["master_weights"] == sum(2 * p.numel() + 4 for p in model.parameters())


@pytest.mark.parametrize("guard", [False, True])
def test_all_zero_fp8_state(guard):
    model = mlp()
    opt = make_opt(model, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8", fp8_zero_state_guard=guard)
    fill_grads(model, 0)
    dead = model[0].weight
    dead.grad.zero_()
    before = dead.detach().clone()
    if not guard:  # faithful: TE's s = 0 -> scale = Inf -> NaN codes; here also an error
        with pytest.raises(FloatingPointError, match="fp8_zero_state_guard"):
            opt.step()
        st = opt.state[dead]
        assert st["exp_avg_scale"].item() == float("inf") and st["exp_avg_scale_inv"].item() == 0.0
        # 0 * Inf = NaN: code 0x7F on the GPU; x86's default NaN is negative, so 0xFF here
        assert (st["exp_avg"].view(torch.uint8) & 0x7F).unique().tolist() == [0x7F]
        assert bool(torch.isnan(st["exp_avg"].float()).all())
        assert bool(torch.isnan(opt._load(st, "exp_avg")).all())
        return
    opt.step()
    st = opt.state[dead]
    assert st["exp_avg_scale"].item() == 1.0 and st["exp_avg"].view(torch.uint8).sum().item() == 0
    torch.testing.assert_close(dead.detach(), before * (1 - 1e-2 * 0.1))  # only weight decay moved it
    fill_grads(model, 1)
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_main_grad_hooks_round_accumulation_to_bf16():
    model = mlp()
    handles = install_main_grad_hooks(model, "bf16")
    assert len(handles) == 4
    x = torch.randn(2, 16, 8)
    fp32 = mlp()
    for xb in x:
        model(xb).square().sum().backward()
    grads = []
    for xb in x:
        fp32.zero_grad()
        fp32(xb).square().sum().backward()
        grads.append([p.grad.clone() for p in fp32.parameters()])
    for p, g1, g2 in zip(model.parameters(), *grads, strict=True):
        assert torch.equal(p.grad, (g1.bfloat16().float() + g2).bfloat16().float())
    assert install_main_grad_hooks(mlp(), "fp32") == []
    with pytest.warns(UserWarning, match="install_main_grad_hooks"):
        m2 = mlp()
        fill_grads(m2, 0)
        make_opt(m2, main_grads_dtype="bf16").step()


@pytest.mark.parametrize(
    "dtypes",
    [
        {"exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16", "main_params_dtype": "fp16"},
        {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8"},
    ],
)
def test_state_dict_round_trip_continues_bit_identically(dtypes):
    model = mlp()
    opt = make_opt(model, **dtypes)
    for step in range(3):
        fill_grads(model, step)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    twin = mlp(seed=5)
    twin.load_state_dict(saved["model"])
    twin_opt = make_opt(twin, **dtypes)
    twin_opt.load_state_dict(saved["opt"])
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        for k, v in opt.state[a].items():
            assert twin_opt.state[b][k].dtype == v.dtype and torch.equal(twin_opt.state[b][k], v), k
    for step in range(3, 6):
        fill_grads(model, step)
        fill_grads(twin, step)
        opt.step()
        twin_opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
        for k, v in opt.state[a].items():
            assert torch.equal(twin_opt.state[b][k].view(torch.uint8), v.view(torch.uint8)), k


def test_memory_bytes_and_bad_dtypes():
    model = mlp()
    n, count = sum(p.numel() for p in model.parameters()), 4
    assert make_opt(model).memory_bytes() == {
        "master_weights": 4 * n,
        "optimizer_states": 8 * n,
        "main_grads": 4 * n,
    }
    low = make_opt(model, exp_avg_dtype="fp8", exp_avg_sq_dtype="bf16", main_grads_dtype="bf16")
    assert low.memory_bytes() == {
        "master_weights": 4 * n,
        "optimizer_states": n + 8 * count + 2 * n,
        "main_grads": 2 * n,
    }
    with pytest.raises(ValueError, match="main_params_dtype"):
        make_opt(model, main_params_dtype="bf16")
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        make_opt(model, exp_avg_dtype="fp4")
    with pytest.raises(ValueError, match="fp32 parameters"):
        make_opt(mlp().bfloat16())


def gpt_tiny_losses(steps: int, **dtypes) -> list[float]:
    from harness.backends import build_backend
    from harness.train import backend_spec
    from tests.helpers import compose_cfg

    cfg = compose_cfg("model=gpt_tiny", "recipe=bf16")
    torch.manual_seed(0)
    model = build_backend(backend_spec(cfg), torch.device("cpu")).build_model()
    motif = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    data = motif.repeat(1, 5)[:, :65]  # (8, 65): a period-16 sequence per row, learnable in-context
    x, y = data[:, :-1], data[:, 1:]
    install_main_grad_hooks(model, dtypes.get("main_grads_dtype", "fp32"))
    opt = PrecisionAwareAdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, **dtypes)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_min_memory_settings_train_gpt_tiny_like_fp32():
    ref = gpt_tiny_losses(40)
    low = gpt_tiny_losses(
        40, main_grads_dtype="bf16", exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8", main_params_dtype="fp16"
    )
    assert ref[-1] < 0.1 * ref[0] and low[-1] < 0.1 * low[0]
    assert abs(low[-1] - ref[-1]) < 0.25 * ref[-1] + 0.02, (ref[-5:], low[-5:])


def test_min_memory_settings_regression_like_fp32():
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    w = torch.randn(8, 4) * 0.5
    y = torch.sin(x @ w)

    def fit(**dtypes) -> float:
        model = mlp(1)
        install_main_grad_hooks(model, dtypes.get("main_grads_dtype", "fp32"))
        opt = make_opt(model, **dtypes)
        for _ in range(150):
            opt.zero_grad()
            for rows in (slice(0, None, 2), slice(1, None, 2)):  # two micro-batches accumulate
                (F.mse_loss(model(x[rows]), y[rows]) / 2).backward()
            opt.step()
        return F.mse_loss(model(x), y).item()

    first = F.mse_loss(mlp(1)(x), y).item()
    ref = fit()
    low = fit(main_grads_dtype="bf16", exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8")
    assert ref < 0.1 * first
    assert low < 1.25 * ref + 1e-3, (first, ref, low)
