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


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ in their bits (bf16/fp32/int16 alike)."""
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum())


def _one_pass_pair(shapes, steps, clip_coefs, weight_decay=0.1, lr=3e-4):
    """TE's FusedAdam (grads multiplied by the clipping coefficient first, as clip_grad did) and the
    one-pass subclass (the coefficient handed to its step), from the same bf16 parameters, over the
    same fp32 decoupled grads; returns both (params, optimizer)."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    from harness.optim import fused_adam_one_pass

    torch.manual_seed(1)
    init = [(torch.randn(s, device="cuda") * 0.02).bfloat16() for s in shapes]
    # magnitudes from 1 to 1e-4, and 1e-21 for the third tensor: its squares are fp32 denormals,
    # which TE's fast-math kernel flushes
    mags = [10.0 ** -(i % 5) if i != 2 else 1e-21 for i in range(len(shapes))]
    grads = [[torch.randn(s, device="cuda") * mags[i] for i, s in enumerate(shapes)] for _ in range(steps)]

    def train(cls, hand_over):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = cls(
            [
                {"params": params[:-1], "weight_decay": weight_decay},
                {"params": params[-1:], "weight_decay": 0.0},
            ],
            lr=lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            adam_w_mode=True,
            master_weights=True,
            master_weight_dtype=torch.float32,
            use_decoupled_grad=True,
            store_param_remainders=True,
        )
        for gs, coef in zip(grads, clip_coefs):
            for p, g in zip(params, gs):
                p.decoupled_grad = g.clone()
            scale = torch.tensor(coef, device="cuda") if coef is not None else None
            if scale is not None and hand_over:
                opt.grad_scale = scale
            elif scale is not None:
                torch._foreach_mul_([p.decoupled_grad for p in params], scale)
            opt.step()
        return params, opt

    return train(FusedAdam, False), train(fused_adam_one_pass(), True)


@needs_cuda
@needs_te
def test_one_pass_adam_is_te_fused_adam_bit_for_bit():
    """The one-pass kernel against TE's multi_tensor_adam_param_remainder: 6 steps over tensors of
    odd sizes (one under a block, one over many), clipped and unclipped steps, weight decay on and
    off, a tensor whose squared grads are denormals: every parameter, remainder and moment has the
    same bits."""
    shapes = [(4096, 1536), (333,), (7, 129, 5), (2049,), (1,), (4096,)]
    (ref_params, ref), (params, opt) = _one_pass_pair(shapes, 6, [None, 0.37, 1.0, 0.05, None, 0.999])
    assert opt.kernel() == "lowp one-pass AdamW (Triton)"
    for i, (p0, p1) in enumerate(zip(ref_params, params)):
        assert _bits_equal(p0.data, p1.data) == 0, (i, "param")
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            assert _bits_equal(ref.state[p0][name], opt.state[p1][name]) == 0, (i, name)
    assert [g["step"] for g in ref.param_groups] == [g["step"] for g in opt.param_groups]


@needs_cuda
@needs_te
def test_one_pass_adam_state_dict_resumes_in_te_fused_adam():
    """The states are TE's own tensors: a one-pass optimizer's state_dict loads into TE's FusedAdam
    (and back), and the next steps match TE's uninterrupted run."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    from harness.optim import fused_adam_one_pass

    shapes = [(256, 96), (96,)]
    (ref_params, ref), (params, opt) = _one_pass_pair(shapes, 3, [0.5, None, None])
    other = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True, master_weights=True)
    kw |= dict(master_weight_dtype=torch.float32, use_decoupled_grad=True, store_param_remainders=True)
    groups = lambda ps: [{"params": ps[:-1], "weight_decay": 0.1}, {"params": ps[-1:], "weight_decay": 0.0}]  # noqa: E731
    te_opt = FusedAdam(groups(other), **kw)
    te_opt.load_state_dict(opt.state_dict())
    back = fused_adam_one_pass()(groups(params), **kw)
    back.load_state_dict(opt.state_dict())
    g = [torch.randn(s, device="cuda") for s in shapes]
    for ps, o in ((ref_params, ref), (other, te_opt), (params, back)):
        for p, gi in zip(ps, g):
            p.decoupled_grad = gi.clone()
        o.step()
    for a, b, c in zip(ref_params, other, params):
        assert _bits_equal(a.data, b.data) == 0 and _bits_equal(a.data, c.data) == 0


@needs_cuda
@needs_te
def test_a_te_run_records_the_optimizer_kernel(tmp_path):
    """A TE run with Megatron's default optimizer steps on the one-pass kernel and says so in
    run.json; INT4 QAT's whole fp32 masters (no remainders) step on TE's kernel."""
    import json

    from harness.train import run
    from tests.helpers import TINY, compose_cfg

    for recipe, want in (("bf16", "lowp one-pass AdamW (Triton)"), ("int4_qat", "TE FusedAdam")):
        out = tmp_path / recipe
        s = run(compose_cfg(*TINY, "backend=te", "hardware=auto", f"recipe={recipe}", "steps=4"), out)
        assert s.status == "completed", recipe
        opts = json.loads((out / "run.json").read_text())["provenance"]["speed_options"]
        assert opts["optimizer_kernel"] == want, recipe
