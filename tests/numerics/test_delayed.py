"""Delayed scaling: TE's update rule (kernel_bulk) and its timing (docs/numerics.md section 2)."""

from __future__ import annotations

import pytest
import torch

from harness.numerics import NumericsContext, QuantizedLinear, resolve_recipe
from harness.numerics.delayed import DelayedScalingState
from harness.numerics.formats import E4M3, E5M2

FMAX = torch.finfo(torch.float32).max


def run(state: DelayedScalingState, amaxes):
    out = []
    for a in amaxes:
        if a:
            state.record(0, torch.tensor(a))
        state.update()
        out.append((state.scale.item(), state.amax_history[:, 0].tolist()))
    return out


def test_max_algo_rolls_and_keeps_the_window():
    s = DelayedScalingState([E4M3], 3, "max", 0)
    assert s.scale.item() == 1.0  # step 1 uses scale 1
    steps = run(s, [2.0, 4.0, 1.0, 0.0, 1.0, 1.0])
    assert steps[0] == (224.0, [0.0, 0.0, 2.0])
    assert steps[1] == (112.0, [0.0, 2.0, 4.0])
    assert steps[2] == (112.0, [0.0, 4.0, 1.0])  # max(h[1..], amax) still sees the 4
    assert steps[3] == steps[2]  # zero amax: no roll, scale kept
    assert steps[4] == (112.0, [0.0, 1.0, 1.0])
    assert steps[5] == (448.0, [0.0, 1.0, 1.0])


def test_most_recent_margin_and_formats():
    s = DelayedScalingState([E4M3, E5M2], 4, "most_recent", 2)
    s.record(0, torch.tensor(3.0))
    s.record(0, torch.tensor(7.0))  # several casts in one step: atomic max
    s.record(1, torch.tensor(7.0))
    s.update()
    assert s.scale.tolist() == [112.0 / 7.0, 14336.0 / 7.0]  # fp8max * 2^-2 / amax, IEEE division
    assert s.scale[0].item() == (torch.tensor(112.0) / torch.tensor(7.0)).item()


def test_inf_and_tiny_amax():
    s = DelayedScalingState([E4M3], 2, "max", 0)
    run(s, [float("inf")])
    assert s.scale.item() == 1.0 and s.amax_history[1, 0] == float("inf")  # kept, but rolled
    t = DelayedScalingState([E4M3], 1, "max", 0)
    run(t, [1e-45])
    assert t.scale.item() == FMAX  # 448 / subnormal overflows: FLT_MAX


def test_bad_config():
    with pytest.raises(ValueError, match="fp8_amax_compute_algo"):
        DelayedScalingState([E4M3], 4, "mean", 0)


def make(ctx, name="blocks.0.mlp.fc1", hist=4):
    return QuantizedLinear(name, resolve_recipe("delayed", fp8_amax_history_len=hist), ctx)


def scales(rows, tensor):
    return [r["scale"] for r in rows if r["tensor"] == tensor]


def test_update_timing_across_steps():
    ctx = NumericsContext()
    lin = make(ctx)
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 64, generator=g))
    xs = [torch.randn(16, 64, generator=g) * (i + 1) for i in range(3)]
    dys = [torch.randn(16, 32, generator=g).bfloat16() * (i + 1) for i in range(3)]
    seen = []
    for x, dy in zip(xs, dys, strict=True):
        with ctx.telemetry.collect() as rows:
            with ctx.autocast():
                y = lin.linear(x.requires_grad_(), w, None)
            y.backward(dy)
        seen.append((scales(rows, "input")[0], scales(rows, "grad")[0]))
    amax_x = [x.bfloat16().abs().max().float() for x in xs]
    amax_dy = [dy.abs().max().float() for dy in dys]
    assert seen[0] == (1.0, 1.0)  # step 1: scale 1 everywhere
    # step k uses the amaxes up to step k-1 ("max" over the history)
    assert seen[1][0] == (torch.tensor(448.0) / amax_x[0]).item()
    assert seen[1][1] == (torch.tensor(57344.0) / amax_dy[0]).item()  # HYBRID: grads E5M2
    assert seen[2][0] == (torch.tensor(448.0) / max(amax_x[:2])).item()


def test_no_forward_update_without_grad_or_inside_nesting():
    ctx = NumericsContext()
    lin = make(ctx)
    w = torch.nn.Parameter(torch.randn(8, 16))
    x = torch.randn(4, 16) * 10
    state = ctx.forward_states["blocks.0.mlp.fc1"]
    with torch.no_grad(), ctx.autocast():
        lin.linear(x, w, None)
    assert state.scale.tolist() == [1.0, 1.0] and state.amax_history[0, 0] > 0  # recorded, no update
    with ctx.autocast():
        with ctx.autocast():
            lin.linear(x, w, None)
        assert state.scale.tolist() == [1.0, 1.0]  # inner exit: nothing
    assert state.scale[0] != 1.0  # outermost exit with grad enabled: updated


def test_backward_update_after_the_first_modules_backward():
    ctx = NumericsContext()
    first, second = make(ctx, "blocks.0.attn.qkv"), make(ctx, "blocks.0.attn.proj")
    w1, w2 = torch.nn.Parameter(torch.randn(16, 16)), torch.nn.Parameter(torch.randn(16, 16))
    bwd = ctx.backward_states
    during = {}
    with ctx.autocast():
        h = first.linear(torch.randn(8, 16), w1, None)
        h.register_hook(lambda g: during.update(s=bwd["blocks.0.attn.proj"].scale.item()))
        y = second.linear(h, w2, None)
    y.float().sum().backward()
    assert during["s"] == 1.0  # the second module's backward ran, no update yet
    assert bwd["blocks.0.attn.proj"].scale.item() != 1.0  # updated after the first module's
    assert bwd["blocks.0.attn.qkv"].scale.item() != 1.0


def test_max_algo_ignores_nan_like_fmaxf():
    """kernel_bulk folds fmaxf from 0: a NaN in the history or the new amax never wins the max."""
    s = DelayedScalingState([E4M3], 3, "max", 0)
    s.amax_history[:, 0] = torch.tensor([0.0, float("nan"), 2.0])  # an older NaN, then 2
    run(s, [4.0])
    assert s.scale.item() == 112.0  # 448 / max(2, 4), not NaN -> kept scale 1
    assert s.amax_history[1, 0] == 2.0 and s.amax_history[2, 0] == 4.0
    t = DelayedScalingState([E4M3], 2, "max", 0)
    t.amax_history[:, 0] = torch.tensor([float("nan"), 7.0])  # NaN recorded this step
    t.update()
    assert t.scale.item() == 64.0 and torch.isnan(t.amax_history[1, 0])  # rolled in, skipped by max
    u = DelayedScalingState([E4M3], 2, "max", 0)
    u.amax_history[:, 0] = torch.tensor([float("nan"), 0.0])  # nothing but NaN: amax 0, scale kept
    u.update()
    assert u.scale.item() == 1.0
