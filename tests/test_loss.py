"""The fused, chunked LM head + cross entropy against the whole-logits path."""

from __future__ import annotations

import pytest
import torch

from harness.model.loss import chunked_linear_cross_entropy, loss_fn

BF16 = torch.bfloat16


def whole(h, w, t):
    logits = (h.to(BF16).float() @ w.to(BF16).float().t()).to(BF16)  # the LM head's bf16 GEMM
    return loss_fn(logits, t)


@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_chunked_matches_whole_logits(chunks, dtype):
    g = torch.Generator().manual_seed(0)
    n, c, v = 96, 64, 300
    h0 = torch.randn(n, c, generator=g).to(dtype)
    w0 = (torch.randn(v, c, generator=g) * 0.2).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    grads = []
    for fn in (whole, lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunks)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w, t)
        (2.0 * loss).backward()  # a non-unit upstream grad
        grads.append((loss.detach(), h.grad, w.grad))
    (l0, dh0, dw0), (l1, dh1, dw1) = grads
    assert dh1.dtype == dtype and dw1.dtype == dtype
    assert torch.allclose(l0, l1, rtol=1e-6, atol=1e-6)
    # the same bf16 logit gradients and GEMMs; d(W) rounds per chunk before the sum
    assert torch.equal(dh0.float(), dh1.float()) or torch.allclose(
        dh0.float(), dh1.float(), rtol=1e-2, atol=1e-6
    )
    assert torch.allclose(dw0.float(), dw1.float(), rtol=2e-2, atol=1e-5)


def test_chunked_under_no_grad_is_the_loss_only():
    h, w, t = torch.randn(10, 8), torch.randn(20, 8), torch.randint(0, 20, (10,))
    with torch.no_grad():
        assert torch.allclose(chunked_linear_cross_entropy(h, w, t, 4), whole(h, w, t), atol=1e-6)


def test_gpt_trains_with_chunked_loss(tmp_path):
    from harness.train import run
    from tests.helpers import compose_cfg

    common = (
        "model=gpt_tiny",
        "logger=none",
        "data=markov",
        "steps=6",
        "eval_interval=0",
        "checkpoint_interval=-1",
    )
    a = run(compose_cfg(*common), tmp_path / "whole")
    b = run(compose_cfg(*common, "model.lm_head_loss_chunks=4"), tmp_path / "chunked")
    assert b.status == "completed"
    assert abs(a.final_train_loss - b.final_train_loss) < 2e-3 * a.final_train_loss
    assert abs(a.final_eval_loss - b.final_eval_loss) < 2e-3 * a.final_eval_loss
