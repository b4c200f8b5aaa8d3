"""The model: large presets checked on the meta device (shapes, parameter counts, FLOPs of anchors.md)."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_backend
from harness.model.gpt import count_params, flops_per_token
from harness.train import backend_spec
from tests.helpers import compose_cfg

# parameter counts of anchors.md's models (anchor_gpt.py printed params_M 1418.4 and 1636.9 on the H200)
ANCHOR_PARAMS = {"gpt_1b": 1_418_399_744, "gpt_8b_slice": 1_636_933_632}


@pytest.mark.parametrize("preset", ["gpt_125m", "gpt_350m", "gpt_1b", "gpt_8b_slice"])
def test_large_presets_build_on_meta(preset):
    cfg = compose_cfg(f"model={preset}", "backend=emulated")
    with torch.device("meta"):  # allocate nothing: the 1.6B presets would take minutes to init on a CPU
        model = build_backend(backend_spec(cfg), torch.device("meta")).build_model()
    n = count_params(model)
    assert all(p.device.type == "meta" for p in model.parameters())
    if preset in ANCHOR_PARAMS:
        assert n["total"] == ANCHOR_PARAMS[preset]
    m = cfg.model
    emb = m.vocab_size * m.hidden_size + m.seq_length * m.hidden_size
    assert n["non_embedding"] == n["total"] - emb


def test_flops_per_token_matches_anchor_formula():
    cfg = compose_cfg("model=gpt_1b")
    n_nonemb = ANCHOR_PARAMS["gpt_1b"] - 50304 * 2048 - 2048 * 2048
    m = cfg.model
    want = 6 * n_nonemb + 12 * m.num_layers * m.hidden_size * m.seq_length / 2
    assert flops_per_token(m, n_nonemb) == want


def test_forward_shapes_and_causality():
    cfg = compose_cfg("model=gpt_tiny", "backend=emulated")
    torch.manual_seed(0)
    model = build_backend(backend_spec(cfg), torch.device("cpu")).build_model()
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    idx2 = idx.clone()
    idx2[:, 10:] = (idx2[:, 10:] + 1) % 256  # the future must not change the past
    torch.testing.assert_close(model(idx2)[:, :10].float(), logits[:, :10].float())


@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float32])
def test_fused_residual_add_has_the_unfused_values_and_gradients(y_dtype):
    """The CUDA path's autograd Function (run eagerly here) against bf16_values(x + y) and autograd."""
    from harness.model.gpt import _BF16Residual, bf16_values

    g = torch.Generator().manual_seed(0)
    x0 = bf16_values(torch.randn(64, 96, generator=g) * 3)
    y0 = (torch.randn(64, 96, generator=g) * 1e-3).to(y_dtype)
    grad = torch.randn(64, 96, generator=g)
    outs = []
    for fused in (False, True):
        x, y = x0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
        out = _BF16Residual.apply(x, y) if fused else bf16_values(x + y)
        out.backward(grad)
        outs.append((out.detach(), x.grad, y.grad))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(
    "recipe, ln1_bf16, ln2_bf16",
    [("bf16", True, True), ("mxfp8", True, True), ("delayed", False, False), ("int4_qat", True, True)],
)
def test_norms_hand_over_bf16_only_where_their_linear_rounds_to_bf16(recipe, ln1_bf16, ln2_bf16):
    """TE fuses delayed scaling's qkv/fc1 input casts into the norm (from fp32): those norms keep fp32."""
    cfg = compose_cfg("model=gpt_tiny", "backend=emulated", f"recipe={recipe}")
    model = build_backend(backend_spec(cfg), torch.device("cpu")).build_model()
    for block in model.blocks:
        assert (block.ln1.bf16_output, block.ln2.bf16_output) == (ln1_bf16, ln2_bf16)
