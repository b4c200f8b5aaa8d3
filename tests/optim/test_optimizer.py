"""Optimizer plumbing that runs on a CPU: clipping on whatever holds the grads, CPU offload numerics."""

from __future__ import annotations

import torch
import torch.nn as nn

from harness.optim import CpuOffloadAdamW, MainGrads, Optimizer, clip_grad, param_groups
from tests.helpers import compose_cfg


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _step(model, opt, x):
    model(x).pow(2).mean().backward()
    clip_grad(opt, 1.0)
    opt.step()
    opt.zero_grad()


def test_cpu_offload_matches_adamw():
    cfg = compose_cfg("optimizer.lr=1e-2").optimizer
    a, b = _model(), _model()
    ref = Optimizer(
        torch.optim.AdamW(param_groups(a, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps),
        list(a.parameters()),
    )
    groups = param_groups(b, cfg.weight_decay)
    off = Optimizer(CpuOffloadAdamW(groups, cfg), [p for g in groups for p in g["params"]])
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        _step(a, ref, x)
        _step(b, off, x)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert off.memory_bytes()["host_bytes"] > 0


def test_main_grads_accumulate_in_fp32_and_clip_there():
    model = _model().to(torch.bfloat16)
    params = list(model.parameters())
    mg = MainGrads(params)
    opt = Optimizer(torch.optim.SGD(params, lr=0.0), params, mg)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for _ in range(3):  # three micro-batches accumulate into the fp32 buffer; p.grad stays empty
        model(x).float().pow(2).mean().backward()
    assert all(p.grad is None for p in params)
    assert all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in opt.grads())
    norm = clip_grad(opt, 1e-3)
    assert norm > 1e-3
    torch.testing.assert_close(
        torch.nn.utils.get_total_norm(opt.grads()), torch.tensor(1e-3), rtol=1e-3, atol=0
    )
    opt.zero_grad()
    assert all(g.abs().sum() == 0 for g in opt.grads())
