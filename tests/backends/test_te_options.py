"""The TE options on a CPU: their validation (TE 2.20.2's rules), the packed-QKV autograd node, and
what the fused loss says off a GPU."""

from __future__ import annotations

import pytest
import torch

from harness.backends.te_qkv import split_packed_qkv
from harness.validation import prepare
from harness.validation.rules import ConfigError, validate
from tests.helpers import compose_cfg
from tests.test_validate import error_of, warnings_of

H200_TE = ("hardware=h200", "backend=te")
B200_TE = ("hardware=b200", "backend=te")


def test_fp8_attention_is_a_field_of_the_families_te_runs_it_for():
    validate(compose_cfg(*H200_TE, "recipe=delayed", "recipe.fp8_dpa=true"))
    validate(compose_cfg(*H200_TE, "recipe=delayed", "recipe.fp8_dpa=true", "recipe.fp8_mha=true"))
    for recipe in ("tensorwise", "mxfp8"):  # TE's current-scaling and MXFP8 FP8 attention: sm100
        validate(compose_cfg(*B200_TE, f"recipe={recipe}", "recipe.fp8_dpa=true"))


def test_current_scaling_fp8_attention_on_hopper_is_refused():
    msg = error_of(*H200_TE, "recipe=tensorwise", "recipe.fp8_dpa=true")
    assert msg.startswith(
        "recipe.fp8_dpa=true with recipe=tensorwise on hardware=h200 (compute capability 9.0)"
    )
    assert "from compute capability 10.0" in msg and msg.endswith(
        "use recipe=delayed recipe.fp8_dpa=true on this GPU"
    )


@pytest.mark.parametrize("recipe", ["blockwise", "bf16", "int4_qat"])
def test_fp8_attention_refused_where_te_has_none(recipe):
    msg = error_of(*B200_TE, f"recipe={recipe}", "recipe.fp8_dpa=true")
    assert msg.startswith(f"recipe.fp8_dpa=true with recipe={recipe}: TE 2.20 has no FP8 attention for")
    assert "use recipe=delayed" in msg


def test_fp8_mha_needs_fp8_dpa():
    msg = error_of(*H200_TE, "recipe=delayed", "recipe.fp8_mha=true")
    assert "recipe.fp8_mha=true needs recipe.fp8_dpa=true" in msg


def test_fp8_attention_needs_backend_te():
    msg = error_of("backend=emulated", "recipe=delayed", "recipe.fp8_dpa=true")
    assert "backend=te" in msg and "attention" in msg


def test_fp8_attention_warns_it_has_no_passed_loss_check():
    """FP8 attention has not passed lowp's loss check: every run that turns it on is told so in one
    line that points to the RESULTS.md section (no figures copied)."""
    (msg,) = [w for w in warnings_of(*H200_TE, "recipe=delayed", "recipe.fp8_dpa=true") if "fp8_dpa" in w]
    assert "benchmarks/RESULTS.md, 'Loss checks of the TE options" in msg
    assert not [w for w in warnings_of(*H200_TE, "recipe=delayed") if "fp8_dpa" in w]


def test_fused_loss_rules():
    msg = error_of("backend=emulated", "model.cross_entropy_loss_fusion=true")
    assert "model.cross_entropy_loss_fusion=true" in msg and "backend=te" in msg
    msg = error_of(*H200_TE, "model.cross_entropy_loss_fusion=true", "model.lm_head_loss_chunks=4")
    assert "choose one" in msg


def test_options_that_do_nothing_warn():
    notes = warnings_of(*H200_TE, "backend.packed_qkv_grad=true", "model.position_embedding=rope")
    assert any("packed_qkv_grad=true has no effect with RoPE" in n for n in notes)
    notes = warnings_of("backend=emulated", "backend.packed_qkv_grad=true")
    assert any("packed_qkv_grad=true has no effect on a backend other than te" in n for n in notes)
    assert not any("packed_qkv_grad" in n for n in warnings_of(*H200_TE, "backend.packed_qkv_grad=true"))


def test_fast_accumulation_is_a_tensorwise_field_on_te():
    cfg = compose_cfg(*H200_TE, "recipe=tensorwise", "recipe.fp8_fast_accumulation=all")
    validate(cfg)
    msg = error_of(
        "hardware=h200", "backend=emulated", "recipe=tensorwise", "recipe.fp8_fast_accumulation=all"
    )
    assert msg.startswith("recipe.fp8_fast_accumulation=all with a backend other than te")
    assert "accumulates every GEMM exactly in fp32" in msg and msg.endswith("use backend=te")


@pytest.mark.parametrize(
    ("recipe", "words"),
    [
        (
            "delayed",
            "only TE's Float8CurrentScaling sets the accumulation per GEMM and delayed builds DelayedScaling",
        ),
        ("blockwise", "blockwise builds Float8BlockScaling; use recipe=tensorwise"),
        ("bf16", "bf16 builds no TE recipe (BF16 GEMMs)"),
    ],
)
def test_fast_accumulation_refused_where_te_has_no_per_gemm_setting(recipe, words):
    msg = error_of(*H200_TE, f"recipe={recipe}", "recipe.fp8_fast_accumulation=all")
    assert msg.startswith(f"recipe.fp8_fast_accumulation=all with recipe={recipe}: ") and words in msg, msg


def test_fast_accumulation_names_its_values():
    msg = error_of(*H200_TE, "recipe=tensorwise", "recipe.fp8_fast_accumulation=dgrad")
    assert msg == "recipe.fp8_fast_accumulation=dgrad: unknown; choose one of ['fprop', 'all']"


def test_fast_accumulation_without_fp8_backward_warns_it_does_nothing():
    fast = ("recipe=tensorwise", "recipe.fp8_fast_accumulation=all")
    # an all-MoE model: TE's LayerNormMLP refuses the high-precision backward fp8_wgrad=false maps to
    notes = warnings_of(*H200_TE, *fast, "stability.fp8_wgrad=false", "model=mixtral_tiny")
    (msg,) = [n for n in notes if "fp8_fast_accumulation" in n]
    assert "stability.fp8_wgrad=false" in msg and msg.endswith(
        "use recipe.fp8_fast_accumulation=fprop for that run"
    )
    assert not [n for n in warnings_of(*H200_TE, *fast) if "fp8_fast_accumulation" in n]


def test_an_override_runs_its_own_fields_under_the_same_rules():
    fast = (
        "+stability.overrides=[{pattern:'blocks.1.*',recipe:tensorwise,fields:{fp8_fast_accumulation:all}}]"
    )
    cfg = prepare(compose_cfg(*H200_TE, "recipe=tensorwise", "model=gpt_tiny", fast))
    (ov,) = cfg.stability.overrides
    assert ov.resolved.fp8_fast_accumulation == "all" and cfg.recipe.fp8_fast_accumulation == "fprop"
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg("backend=emulated", "recipe=tensorwise", "model=gpt_tiny", fast))
    msg = str(err.value)
    assert msg.startswith(
        "stability.overrides pattern=blocks.1.*: recipe.fp8_fast_accumulation=all with a backend"
    )


def _selected(x: torch.Tensor, dim: int):
    return [x.select(dim, i) for i in range(x.shape[dim])]


@pytest.mark.parametrize("dim", [-2, -3])
def test_split_packed_qkv_matches_select(dim):
    x = torch.randn(2, 5, 4, 3, 8) if dim == -2 else torch.randn(2, 5, 3, 4, 8)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = (1.0, -2.0, 0.5)
    sum(w * (t**2).sum() for w, t in zip(weights, split_packed_qkv(a, dim))).backward()
    sum(w * (t**2).sum() for w, t in zip(weights, _selected(b, dim))).backward()
    views = split_packed_qkv(a.detach(), dim)
    assert all(v.data_ptr() == s.data_ptr() for v, s in zip(views, _selected(a.detach(), dim)))
    assert torch.equal(a.grad, b.grad)


class _PackedGrads(torch.autograd.Function):
    """Stands in for cuDNN's backward: dq, dk, dv as slices of one packed buffer."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q + 2 * k + 3 * v

    @staticmethod
    def backward(ctx, g):
        _PackedGrads.buffer = torch.stack([g, 2 * g, 3 * g], dim=-2)
        return tuple(_PackedGrads.buffer.unbind(-2))


def test_split_packed_qkv_hands_back_the_packed_buffer_without_a_copy():
    x = torch.randn(2, 5, 4, 3, 8, requires_grad=True)
    _PackedGrads.apply(*split_packed_qkv(x, -2)).sum().backward()
    assert x.grad.data_ptr() == _PackedGrads.buffer.data_ptr()
    assert torch.equal(x.grad, _PackedGrads.buffer)
    y = x.detach().clone().requires_grad_()  # grads not tiling a buffer: stacked, same numbers
    q, k, v = split_packed_qkv(y, -2)
    (q + 2 * k + 3 * v).sum().backward()
    assert torch.equal(y.grad, _PackedGrads.buffer) and y.grad.data_ptr() != _PackedGrads.buffer.data_ptr()


def test_split_packed_qkv_with_an_unused_slice():
    x = torch.randn(2, 3, 3, 4, requires_grad=True)
    q, k, v = split_packed_qkv(x, -2)
    q.sum().backward()
    assert torch.equal(x.grad[..., 0, :], torch.ones(2, 3, 4)) and not x.grad[..., 1:, :].any()


def test_fused_loss_needs_a_gpu():
    from harness.model.loss import loss_fn

    with pytest.raises(ValueError, match="model.cross_entropy_loss_fusion=true needs the logits on a CUDA"):
        loss_fn(torch.randn(2, 3, 10), torch.zeros(2, 3, dtype=torch.long), fused=True)
