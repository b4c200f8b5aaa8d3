"""GPU test of harness.optim's FusedAdam subclass: its batched FP8 state scaling is TE's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import needs_cuda, needs_te

pytestmark = pytest.mark.gpu


@needs_cuda
@needs_te
@pytest.mark.parametrize("states", [("fp8", "fp8"), ("fp8", "fp16")])
def test_batched_fp8_state_scaling_is_bit_identical_to_fused_adam(states):
    """harness.optim's FusedAdam subclass (un)scales FP8 moments for all tensors at once; TE's own
    FusedAdam does it tensor by tensor. Same grads, 6 steps: every state, scale and parameter equal."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    from harness.optim import TORCH_DTYPES, fused_adam_batched_fp8_states

    torch.manual_seed(0)
    shapes = [(256, 128), (128,), (64, 64, 3), (512,), (32, 16)]
    init = [torch.randn(s, device="cuda").bfloat16() for s in shapes]
    grads = [[torch.randn(s, device="cuda").bfloat16() * 10.0 ** -(i % 4) for i, s in enumerate(shapes)]]
    for _ in range(5):
        grads.append([g * 0.5 + torch.randn_like(g) * 1e-3 for g in grads[-1]])
    for gs in grads:
        gs[3].zero_()  # an all-zero moment: scale 1/0, NaN codes in TE; the batched path must agree

    def train(cls):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = cls(
            [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}],
            lr=1e-2,
            adam_w_mode=True,
            master_weights=True,
            exp_avg_dtype=TORCH_DTYPES[states[0]],
            exp_avg_sq_dtype=TORCH_DTYPES[states[1]],
        )
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return params, opt

    def same(a, b):  # bit-equal, NaN payloads aside
        a, b = a.float(), b.float()
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(
            torch.where(nan, 0.0, a).view(torch.int32), torch.where(nan, 0.0, b).view(torch.int32)
        )

    ref_params, ref = train(FusedAdam)
    params, opt = train(fused_adam_batched_fp8_states())
    assert type(opt).__name__ == "FusedAdamBatchedFP8States"
    for i, (p0, p1) in enumerate(zip(ref_params, params)):
        assert same(p0, p1), i
        s0, s1 = ref.state[p0], opt.state[p1]
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            a, b = s0[name], s1[name]
            if hasattr(a, "_data"):
                codes = [t._data.view(torch.float8_e4m3fn) for t in (a, b)]
                assert same(*codes), (i, name)
                assert same(a._scale_inv, b._scale_inv) and same(a._quantizer.scale, b._quantizer.scale)
            else:
                assert same(a, b), (i, name)
        for name, sc in ref._scales[p0].items():
            assert same(sc, opt._scales[p1][name]), (i, name)
    assert torch.isnan(ref.state[ref_params[3]]["exp_avg"].dequantize()).all()  # the zero-moment case ran
