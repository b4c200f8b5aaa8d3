"""The TE speed options on a CPU: their validation (TE 2.20.2's rules), the NVTE_DPA_* switch, the
packed-QKV autograd node, and what the fused loss says off a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from harness.backends import te_env
from harness.backends.te_attention import dpa_env, split_packed_qkv
from harness.config.schema import RecipeConfig
from tests.helpers import compose_cfg
from tests.test_validate import error_of, warnings_of

H200_TE = ("hardware=h200", "backend=te")


def test_tensorwise_fp8attn_is_valid_on_hopper_and_sets_the_attention_switch():
    from harness.config.validate import validate

    cfg = compose_cfg(*H200_TE, "recipe=tensorwise_fp8attn")
    validate(cfg)
    env = te_env.wanted(cfg.recipe)
    assert env["NVTE_DPA_FP8_RECIPE"] == "DelayedScaling" and env["NVTE_DPA_FP8_RECIPE_DPA"] == "1"
    assert env["NVTE_DPA_FP8_RECIPE_MHA"] == "0" and env["NVTE_DPA_FP8DS_AMAX_HISTLEN"] == "1"
    validate(compose_cfg(*H200_TE, "recipe=delayed_fp8attn"))
    assert "NVTE_DPA_FP8_RECIPE" not in te_env.wanted(compose_cfg("recipe=delayed_fp8attn").recipe)


def test_current_scaling_fp8_attention_on_hopper_needs_the_delayed_switch():
    msg = error_of(*H200_TE, "recipe=tensorwise_fp8attn", "recipe.fp8_dpa_recipe=null")
    assert "compute capability 9.0" in msg and "recipe.fp8_dpa_recipe=delayed" in msg
    # Blackwell has the fused current-scaling kernel
    from harness.config.validate import validate

    validate(
        compose_cfg("hardware=b200", "backend=te", "recipe=tensorwise_fp8attn", "recipe.fp8_dpa_recipe=null")
    )


def test_fp8_attention_refused_where_te_has_none():
    msg = error_of(*H200_TE, "recipe=blockwise", "recipe.fp8_dpa=true")
    assert "recipe.fp8_dpa=true with recipe=blockwise" in msg and "tensorwise_fp8attn" in msg
    msg = error_of(*H200_TE, "recipe=tensorwise", "recipe.fp8_mha=true")
    assert "recipe.fp8_mha=true needs recipe.fp8_dpa=true" in msg
    msg = error_of(*H200_TE, "recipe=tensorwise_fp8attn", "recipe.fp8_dpa_recipe=current")
    assert "recipe.fp8_dpa_recipe=current" in msg


@pytest.mark.parametrize("recipe", ["tensorwise_fp8attn", "delayed_fp8attn"])
def test_fp8_attention_recipes_need_backend_te(recipe):
    msg = error_of("backend=emulated", f"recipe={recipe}")
    assert "backend=te" in msg and "attention" in msg


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
    notes = warnings_of(*H200_TE, "recipe=tensorwise", "recipe.fp8_dpa_recipe=delayed")
    assert any("fp8_dpa_recipe=delayed has no effect" in n for n in notes)
    assert not any("packed_qkv_grad" in n for n in warnings_of(*H200_TE, "backend.packed_qkv_grad=true"))


def test_dpa_env_only_with_a_switch():
    assert dpa_env(False, False, "delayed") == {} and dpa_env(True, False, None) == {}
    assert dpa_env(True, True, "delayed")["NVTE_DPA_FP8_RECIPE_MHA"] == "1"


def test_an_earlier_jobs_attention_switch_is_unset_for_the_next(monkeypatch):
    for var in list(os.environ):
        if var.startswith("NVTE_DPA_"):
            monkeypatch.delenv(var)
    monkeypatch.setattr(te_env, "LOWP_SET_NVTE", {})
    fp8attn = RecipeConfig(name="tensorwise_fp8attn", fp8="hybrid", fp8_dpa=True, fp8_dpa_recipe="delayed")
    te_env.set_nvte_env(fp8attn)
    assert os.environ["NVTE_DPA_FP8_RECIPE"] == "DelayedScaling"
    te_env.set_nvte_env(RecipeConfig(name="tensorwise", fp8="hybrid"))
    assert "NVTE_DPA_FP8_RECIPE" not in os.environ and "NVTE_DPA_FP8_RECIPE_DPA" not in os.environ
    # a user's own value is never touched, and a contradicting one is refused by validation
    monkeypatch.setenv("NVTE_DPA_FP8_RECIPE", "F16")
    assert any("NVTE_DPA_FP8_RECIPE=F16 contradicts" in e for e in te_env.conflicts(fp8attn))
    te_env.set_nvte_env(RecipeConfig(name="tensorwise", fp8="hybrid"))
    assert os.environ["NVTE_DPA_FP8_RECIPE"] == "F16"


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
    from harness.loss import loss_fn

    with pytest.raises(ValueError, match="model.cross_entropy_loss_fusion=true needs the logits on a CUDA"):
        loss_fn(torch.randn(2, 3, 10), torch.zeros(2, 3, dtype=torch.long), fused=True)


def test_cuda_graphs_rules():
    from harness.config.validate import validate

    validate(compose_cfg(*H200_TE, "backend.cuda_graphs=true"))
    msg = error_of(*H200_TE, "backend.cuda_graphs=true", "global_batch_size=16", "micro_batch_size=8")
    assert "one micro-batch a step (2 here)" in msg
    msg = error_of(*H200_TE, "backend.cuda_graphs=true", "stability=first_last_bf16", "model.num_layers=4")
    assert "one recipe" in msg
    assert "learned positions" in error_of(
        *H200_TE, "backend.cuda_graphs=true", "model.position_embedding=rope"
    )
    assert "backend=te" in error_of("backend=emulated", "backend.cuda_graphs=true")


@pytest.mark.parametrize("recipe", ["tensorwise_fp8head", "tensorwise_fp8attn_fp8head"])
def test_fp8_lm_head_recipes_are_valid_on_hopper_with_te(recipe):
    cfg = compose_cfg(*H200_TE, f"recipe={recipe}")
    assert cfg.recipe.fp8_lm_head is True
    assert cfg.recipe.fp8_dpa is (recipe == "tensorwise_fp8attn_fp8head")
    msg = error_of("hardware=h200", "backend=emulated", f"recipe={recipe}")
    assert "fp8_lm_head" in msg or "backend other than te" in msg


def test_fp8_lm_head_is_never_folded_into_another_recipe():
    msg = error_of(*H200_TE, "recipe=tensorwise", "recipe.fp8_lm_head=true")
    assert "recipe.fp8_lm_head=true with recipe=tensorwise" in msg and "recipe=tensorwise_fp8head" in msg
    msg = error_of(*H200_TE, "recipe=delayed", "recipe.fp8_lm_head=true")
    assert "recipe.fp8_lm_head=true with recipe=delayed: only" in msg


@pytest.mark.parametrize("recipe", ["tensorwise_fp8headbwd", "tensorwise_fp8headbwd_fastacc"])
def test_fp8_head_backward_recipes_are_valid_on_hopper_with_te(recipe):
    from harness.config.validate import validate

    cfg = compose_cfg(*H200_TE, f"recipe={recipe}")
    assert cfg.recipe.fp8_lm_head is True and cfg.recipe.fp8_lm_head_fprop is False
    assert cfg.recipe.fp8_fast_accumulation == ("all" if recipe.endswith("_fastacc") else "fprop")
    validate(cfg)
    msg = error_of("hardware=h200", "backend=emulated", f"recipe={recipe}")
    assert "TE's FP8 GEMMs in its backward: use backend=te" in msg
    # it failed its own loss check (RESULTS.md), not the FP8-logits head's: its own warning
    (msg,) = [w for w in warnings_of(*H200_TE, f"recipe={recipe}") if "fp8_lm_head" in w]
    assert msg.startswith("recipe.fp8_lm_head_fprop=false: the LM head's FP8 backward")
    assert "RESULTS.md" in msg


@pytest.mark.parametrize(
    ("recipe", "field", "words"),
    [
        ("tensorwise", "recipe.fp8_lm_head_fprop=false", "use recipe=tensorwise_fp8headbwd"),
        ("tensorwise_fp8head", "recipe.fp8_lm_head_fprop=false", "use recipe=tensorwise_fp8headbwd"),
        ("tensorwise_fp8headbwd", "recipe.fp8_lm_head_fprop=true", "use recipe=tensorwise_fp8head"),
        ("tensorwise_fp8headbwd", "recipe.fp8_lm_head=false", "use recipe=tensorwise for a BF16 head"),
        ("delayed", "recipe.fp8_lm_head_fprop=false", "only ['tensorwise_fp8headbwd'"),
    ],
)
def test_fp8_head_backward_is_never_folded_into_another_recipe(recipe, field, words):
    msg = error_of(*H200_TE, f"recipe={recipe}", field)
    assert words in msg, msg


def test_fp8_head_grad_format_rules():
    from harness.config.validate import validate

    validate(
        compose_cfg(*H200_TE, "recipe=tensorwise_fp8headbwd_fastacc", "recipe.fp8_lm_head_grad_format=e4m3")
    )
    msg = error_of(*H200_TE, "recipe=tensorwise_fp8head", "recipe.fp8_lm_head_grad_format=e4m3")
    assert "only the FP8-backward head takes it" in msg
    msg = error_of(*H200_TE, "recipe=tensorwise_fp8headbwd", "recipe.fp8_lm_head_grad_format=x")
    assert msg == "recipe.fp8_lm_head_grad_format=x: unknown; choose one of ['e4m3', 'e5m2']"


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model=llama3_1b"], "untie_embeddings_and_output_weights=true"),
        (["model.lm_head_loss_chunks=4"], "lm_head_loss_chunks=4"),
        (["model.vocab_size=50257"], "divisible by 16"),
    ],
)
def test_fp8_lm_head_rules(overrides, words):
    msg = error_of(*H200_TE, "recipe=tensorwise_fp8head", *overrides)
    assert "recipe=tensorwise_fp8head (recipe.fp8_lm_head=true)" in msg and words in msg, msg


@pytest.mark.parametrize("recipe", ["tensorwise_fp8attn", "delayed_fp8attn", "tensorwise_fp8attn_fp8head"])
def test_fp8_attention_warns_of_its_measured_loss_check(recipe):
    """FP8 attention failed lowp's 300-step loss check on the 8B slice (RESULTS.md): every run that
    turns it on is told so in one line, with where the measurement is."""
    (msg,) = [w for w in warnings_of(*H200_TE, f"recipe={recipe}") if "fp8_dpa" in w]
    assert "left the BF16 loss band" in msg and "benchmarks/RESULTS.md" in msg
    assert not [w for w in warnings_of(*H200_TE, "recipe=tensorwise") if "fp8_dpa" in w]


@pytest.mark.parametrize(
    "recipe", ["tensorwise_fp8head", "tensorwise_fp8head_fastacc", "tensorwise_fp8attn_fp8head"]
)
def test_fp8_lm_head_warns_of_its_measured_loss_check(recipe):
    """The FP8 LM head failed lowp's 300-step loss check on the 8B slice at every seed (RESULTS.md);
    fast accumulation alone (tensorwise_fastacc) held, so it gets no such warning."""
    (msg,) = [w for w in warnings_of(*H200_TE, f"recipe={recipe}") if "fp8_lm_head" in w]
    assert "left the BF16 loss band" in msg and "benchmarks/RESULTS.md" in msg
    for clean in ("tensorwise", "tensorwise_fastacc"):
        assert not [w for w in warnings_of(*H200_TE, f"recipe={clean}") if "loss band" in w]


FASTACC = ("tensorwise_fastacc", "tensorwise_fp8head_fastacc")


@pytest.mark.parametrize("recipe", FASTACC)
def test_fast_accumulation_recipes_are_valid_on_hopper_with_te_only(recipe):
    from harness.config.validate import validate

    cfg = compose_cfg(*H200_TE, f"recipe={recipe}")
    assert cfg.recipe.fp8_fast_accumulation == "all"
    assert cfg.recipe.fp8_lm_head is (recipe == "tensorwise_fp8head_fastacc")
    validate(cfg)
    msg = error_of("hardware=h200", "backend=emulated", "recipe=tensorwise_fastacc")
    assert msg.startswith("recipe=tensorwise_fastacc (recipe.fp8_fast_accumulation=all) with a backend other")
    assert "accumulates every GEMM exactly in fp32" in msg and msg.endswith("use backend=te")


@pytest.mark.parametrize(
    ("recipe", "words"),
    [
        ("tensorwise", "changes numerics, so it is a recipe of its own; use recipe=tensorwise_fastacc"),
        ("tensorwise_fp8head", "use recipe=tensorwise_fp8head_fastacc"),
        ("tensorwise_fp8attn", "use recipe=tensorwise_fp8attn_fastacc"),
        (
            "tensorwise_fp8attn_fp8head",
            "only ['tensorwise_fastacc', 'tensorwise_fp8attn_fastacc', 'tensorwise_fp8head_fastacc', "
            "'tensorwise_fp8headbwd_fastacc']",
        ),
        (
            "delayed",
            "only TE's Float8CurrentScaling sets the accumulation per GEMM and delayed builds DelayedScaling",
        ),
        ("blockwise", "blockwise builds Float8BlockScaling; use one of ['tensorwise_fastacc'"),
        ("bf16", "bf16 builds no TE recipe (BF16 GEMMs)"),
    ],
)
def test_fast_accumulation_is_never_folded_into_another_recipe(recipe, words):
    msg = error_of(*H200_TE, f"recipe={recipe}", "recipe.fp8_fast_accumulation=all")
    assert msg.startswith(f"recipe.fp8_fast_accumulation=all with recipe={recipe}: ") and words in msg, msg


def test_fast_accumulation_names_its_values():
    msg = error_of(*H200_TE, "recipe=tensorwise_fastacc", "recipe.fp8_fast_accumulation=dgrad")
    assert msg == "recipe.fp8_fast_accumulation=dgrad: unknown; choose one of ['fprop', 'all']"


def test_fast_accumulation_without_fp8_backward_warns_it_does_nothing():
    notes = warnings_of(*H200_TE, "recipe=tensorwise_fastacc", "stability.fp8_wgrad=false")
    (msg,) = [n for n in notes if "fp8_fast_accumulation" in n]
    assert "stability.fp8_wgrad=false" in msg and msg.endswith("use recipe=tensorwise for that run")
    assert not [n for n in warnings_of(*H200_TE, "recipe=tensorwise_fastacc") if "fp8_fast_accumulation" in n]


def test_a_te_only_recipe_without_its_te_option_names_backend_te():
    """The TE-only recipes whose option is on say why in that option's rule (above, and the LM head's);
    one with its option set back still runs on TE only, in one line that does not blame attention."""
    msg = error_of("backend=emulated", "recipe=tensorwise_fastacc", "recipe.fp8_fast_accumulation=fprop")
    assert msg == "recipe=tensorwise_fastacc with a backend other than te: a TE-only recipe; use backend=te"
    msg = error_of("backend=emulated", "recipe=tensorwise_fp8head")
    assert msg.startswith(
        "recipe=tensorwise_fp8head (recipe.fp8_lm_head=true): the LM head becomes a te.Linear"
    )
