"""Every recipe trains gpt_tiny through the emulated backend; telemetry and checkpoint state."""

from __future__ import annotations

import math

import pytest
import torch

from harness.backends import build_backend
from harness.model.loss import loss_fn
from harness.train import backend_spec
from tests.helpers import compose_cfg

RECIPES = ["bf16", "delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "int4_qat", "custom"]
FACTORY = "recipe.quantizer_factory=harness.numerics.custom:tensorwise_factory"


def setup(recipe: str, *extra: str):
    over = ["model=gpt_tiny", f"recipe={recipe}", "backend=emulated", "logger=none", *extra]
    if recipe == "custom":
        over.append(FACTORY)
    backend = build_backend(backend_spec(compose_cfg(*over)), torch.device("cpu"))
    torch.manual_seed(0)
    model = backend.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # a low-entropy source (16 symbols in a cycle with noise) so a few steps visibly learn
    g = torch.Generator().manual_seed(1)
    tokens = (torch.arange(65).repeat(4, 1) + torch.randint(0, 16, (4, 1), generator=g)) % 16
    return backend, model, opt, tokens


def step(backend, model, opt, tokens) -> float:
    with backend.autocast():
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:].contiguous())
    loss.backward()
    opt.step()
    backend.after_optimizer_step(model)  # as the Trainer does: cached weight copies are stale
    opt.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains(recipe):
    backend, model, opt, tokens = setup(recipe)
    losses = [step(backend, model, opt, tokens) for _ in range(6)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    backend.verify_active(model, 6)


@pytest.mark.parametrize("recipe", ["delayed", "nvfp4", "blockwise"])
def test_telemetry_rows(recipe):
    backend, model, opt, tokens = setup(recipe)
    step(backend, model, opt, tokens)
    assert backend.numerics.telemetry.rows is None  # off outside the context
    with backend.collect_telemetry() as rows:
        step(backend, model, opt, tokens)
    assert backend.numerics.telemetry.rows is None
    linears = {f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert {(r["layer"], r["tensor"]) for r in rows} == {
        (n, t) for n in linears for t in ("input", "weight", "grad")
    }
    for r in rows:
        assert r["amax"] > 0 and r["scale"] > 0
        assert 0 <= r["underflow"] <= 1 and 0 <= r["saturation"] <= 1
        assert 5 < r["sqnr_db"] < 60, r


def test_checkpoint_state_round_trip():
    backend, model, opt, tokens = setup("delayed")
    for _ in range(2):
        step(backend, model, opt, tokens)
    state = backend.state_dict()
    assert set(state["delayed"]) == set(backend.numerics.forward_states)
    fresh, *_ = setup("delayed")
    fresh.load_state_dict(state)
    for name, st in backend.numerics.forward_states.items():
        assert torch.equal(fresh.numerics.forward_states[name].amax_history, st.amax_history)
        assert torch.equal(
            fresh.numerics.backward_states[name].scale, backend.numerics.backward_states[name].scale
        )
    other, *_ = setup("tensorwise")
    with pytest.raises(ValueError, match="unknown module"):
        other.load_state_dict(state)


def test_sr_generator_state_resumes():
    backend, model, opt, tokens = setup("nvfp4")
    saved = backend.state_dict()
    a = torch.rand(3, generator=backend.numerics.generator)
    backend.load_state_dict(saved)
    assert torch.equal(torch.rand(3, generator=backend.numerics.generator), a)


def test_describe_lists_numerics():
    backend, *_ = setup("nvfp4")
    desc = backend.describe()
    assert desc["backend"] == "emulated" and "nvfp4" in desc["recipe_repr"]
    assert desc["quantized_modules"]["lm_head"] == "bf16"
    assert "NVFP4(16x16" in desc["numerics"]["blocks.0.mlp.fc1"]
