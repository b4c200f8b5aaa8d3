"""The emulated -> TE weight copy of scripts/te_vs_emulated.py, checked without TE.

TE's names and layouts come from TE 2.20.2's sources: te.TransformerLayer(fuse_qkv_params=True)
holds `self_attention.layernorm_qkv.{layer_norm_weight, layer_norm_bias, weight, bias}` (one fused
QKV weight, qkv_weight_interleaved=True: MultiheadAttention views its output as (..., heads, 3,
head_dim)), `self_attention.proj.{weight, bias}` and `layernorm_mlp.{layer_norm_weight,
layer_norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias}` (gated activations gate the first half
of fc1's output, as lowp's SwiGLU does).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from scripts.te_vs_emulated import (
    criterion,
    load_into_te,
    qkv_interleave,
    round_to_bf16_,
    te_state_from_emulated,
)
from tests.helpers import compose_cfg


def te_names(n_layers: int, c: int, f: int, bias: bool, norm_bias: bool = True) -> dict:
    """TEGPT's parameter names and shapes, written down from TE's module sources."""
    out = {
        "wte.weight": (256, c),
        "wpe.weight": (64, c),
        "ln_f.weight": (c,),
        "ln_f.bias": (c,),
        "lm_head.weight": (256, c),
    }
    for i in range(n_layers):
        p = f"blocks.{i}.layer."
        out |= {
            p + "self_attention.layernorm_qkv.layer_norm_weight": (c,),
            p + "self_attention.layernorm_qkv.weight": (3 * c, c),
            p + "self_attention.proj.weight": (c, c),
            p + "layernorm_mlp.layer_norm_weight": (c,),
            p + "layernorm_mlp.fc1_weight": (f, c),
            p + "layernorm_mlp.fc2_weight": (c, f),
        }
        if norm_bias:
            out |= {
                p + "self_attention.layernorm_qkv.layer_norm_bias": (c,),
                p + "layernorm_mlp.layer_norm_bias": (c,),
            }
        if bias:
            out |= {
                p + "self_attention.layernorm_qkv.bias": (3 * c,),
                p + "self_attention.proj.bias": (c,),
                p + "layernorm_mlp.fc1_bias": (f,),
                p + "layernorm_mlp.fc2_bias": (c,),
            }
    return out


def fake_te_model(shapes: dict) -> nn.Module:
    """A module tree holding bf16 parameters under exactly these qualified names."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)))
    return root


def emulated_model(*overrides: str):
    from harness.backends.emulated import EmulatedBackend
    from harness.train import backend_spec

    cfg = compose_cfg("model=gpt_tiny", "logger=none", *overrides)
    return EmulatedBackend(backend_spec(cfg), torch.device("cpu")).build_model(), cfg.model


def test_qkv_interleave_puts_each_heads_q_k_v_together():
    n_head, d, c = 3, 4, 5
    s, h, dd = torch.meshgrid(torch.arange(3), torch.arange(n_head), torch.arange(d), indexing="ij")
    label = (100 * s + 10 * h + dd).reshape(-1)  # lowp row (s, h, d) at index s*H*D + h*D + d
    w = label[:, None].float().expand(-1, c)
    te = qkv_interleave(w, n_head)[:, 0].long()
    for hh in range(n_head):  # TE row h*3D + s*D + d holds lowp's (s, h, d)
        for ss in range(3):
            rows = te[hh * 3 * d + ss * d : hh * 3 * d + (ss + 1) * d]
            assert rows.tolist() == [100 * ss + 10 * hh + k for k in range(d)]
    assert torch.equal(qkv_interleave(label, n_head), te)  # a bias (1-D) is interleaved alike


def test_interleaved_weights_give_the_same_heads():
    """q, k, v per head from a [q; k; v] layout (view 3, H, D) equal the per-head one (view H, 3, D)."""
    n_head, d, c = 4, 8, 32
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(3 * c, c, generator=gen), torch.randn(3 * c, generator=gen)
    x = torch.randn(5, c, generator=gen)
    lowp = (x @ w.t() + b).view(5, 3, n_head, d)
    te = (x @ qkv_interleave(w, n_head).t() + qkv_interleave(b, n_head)).view(5, n_head, 3, d)
    assert torch.equal(lowp, te.transpose(1, 2))


@pytest.mark.parametrize("bias", [False, True])
def test_emulated_state_maps_onto_te_names_and_shapes(bias):
    model, m = emulated_model(f"model.add_bias_linear={bias}")
    mapped = te_state_from_emulated(model.state_dict(), m.num_attention_heads)
    want = te_names(m.num_layers, m.hidden_size, m.ffn_hidden_size, bias)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == want


def test_load_into_te_copies_bf16_weights_exactly():
    model, m = emulated_model()
    round_to_bf16_(model)
    sd = model.state_dict()
    te = fake_te_model(te_names(m.num_layers, m.hidden_size, m.ffn_hidden_size, False))
    assert load_into_te(te, sd, m.num_attention_heads) == len(sd)
    got = dict(te.named_parameters())
    for i in range(m.num_layers):
        qkv = got[f"blocks.{i}.layer.self_attention.layernorm_qkv.weight"].float()
        assert torch.equal(qkv, sd[f"blocks.{i}.attn.qkv.weight"])  # same per-head layout: a plain copy
        fc2 = got[f"blocks.{i}.layer.layernorm_mlp.fc2_weight"].float()
        assert torch.equal(fc2, sd[f"blocks.{i}.mlp.fc2.weight"])
    assert torch.equal(got["lm_head.weight"].float(), sd["lm_head.weight"])


def test_load_into_te_refuses_missing_or_extra_names():
    model, m = emulated_model()
    shapes = te_names(m.num_layers, m.hidden_size, m.ffn_hidden_size, False)
    with pytest.raises(KeyError, match="without a source"):
        load_into_te(fake_te_model({**shapes, "blocks.0.layer.extra": (3,)}), model.state_dict(), 2)
    shapes.pop("lm_head.weight")
    with pytest.raises(KeyError, match="unused"):
        load_into_te(fake_te_model(shapes), model.state_dict(), 2)


def test_criterion_compares_each_logged_step_with_the_seed_spread():
    curve = lambda *v: {"train": [[s, x] for s, x in zip((1, 10, 20), v, strict=True)]}  # noqa: E731
    seeds = [curve(5.0, 4.0, 3.0), curve(5.1, 4.1, 3.1)]
    ok = criterion(curve(5.0, 4.0, 3.0), curve(5.0, 4.01, 3.02), seeds, "train")
    assert ok["holds"] and ok["violating_steps"] == [] and ok["holds_vs_mean_pairwise"]
    bad = criterion(curve(5.0, 4.0, 3.0), curve(5.2, 4.0, 3.0), seeds, "train")
    assert not bad["holds"] and bad["violating_steps"] == [1]
    # seeds 0 and 1 cross at step 20; the mean over three seeds' pairs is (0 + .3 + .3) / 3 = .2
    crossing = [curve(5.0, 4.0, 3.0), curve(5.1, 4.1, 3.0), curve(5.2, 4.2, 3.3)]
    c = criterion(curve(5.0, 4.0, 3.0), curve(5.0, 4.0, 3.1), crossing, "train")
    assert c["violating_steps"] == [20] and c["holds_vs_mean_pairwise"]
    assert c["rows"][2] == [20, pytest.approx(0.1), 0.0, pytest.approx(0.2)]
