"""The model: large presets checked on the meta device (shapes, parameter counts, FLOPs of anchors.md)."""

from __future__ import annotations

import pytest
import torch

from harness.backends import build_backend
from harness.model import count_params, flops_per_token
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
