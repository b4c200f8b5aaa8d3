"""The Llama/Qwen architecture fields: presets, parameter counts, validation, Megatron flags, and
short trainings under quantized recipes on the emulated backend."""

from __future__ import annotations

import json

import pytest
import torch

from harness.backends import build_backend
from harness.interop.megatron import megatron_args
from harness.model.gpt import count_params
from harness.train import backend_spec
from harness.validation import prepare
from harness.validation.rules import ConfigError
from tests.helpers import compose_cfg

PRESETS = [
    "llama3_tiny",
    "llama3_1b",
    "llama3_8b_slice",
    "qwen3_tiny",
    "qwen3_1b",
    "qwen3_8b_slice",
    "qwen2_tiny",
]


def expected_params(m) -> int:
    """Count from the shapes alone: embeddings, per block (norms, QKV, out proj, QK norms, MLP)."""
    H, G = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    D = m.kv_channels or m.hidden_size // H
    h, f, V = m.hidden_size, m.ffn_hidden_size, m.vocab_size
    block = 2 * h + (H + 2 * G) * D * h + H * D * h + 3 * h * f + (2 * D if m.qk_layernorm else 0)
    block += (H + 2 * G) * D if m.add_qkv_bias else 0
    head = 0 if not m.untie_embeddings_and_output_weights else V * h
    return V * h + m.num_layers * block + h + head


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_validate_and_count(preset):
    cfg = compose_cfg(f"model={preset}", "backend=emulated")
    prepare(cfg)
    m = cfg.model
    assert (m.normalization, m.activation, m.position_embedding) == ("RMSNorm", "swiglu", "rope")
    if not preset.endswith("tiny"):
        return  # the big shapes are counted on meta tensors below
    model = build_backend(backend_spec(cfg), torch.device("cpu")).build_model()
    assert sum(p.numel() for p in model.parameters()) == expected_params(m)


@pytest.mark.parametrize(
    "preset,layers,billions",
    [
        ("llama3_1b", 16, 1.24),
        ("qwen3_1b", 28, 1.72),
        ("llama3_8b_slice", 32, 8.03),
        ("qwen3_8b_slice", 36, 8.19),
    ],
)
def test_big_shapes_have_their_models_sizes(preset, layers, billions):
    """Llama-3.2-1B 1.24B, Qwen3-1.7B 1.72B, Llama-3-8B 8.03B, Qwen3-8B 8.19B: the slices are those
    models' layers, so at full depth they count as the released models."""
    m = compose_cfg(f"model={preset}", f"model.num_layers={layers}").model
    assert expected_params(m) / 1e9 == pytest.approx(billions, abs=0.01)


def test_tied_head_is_the_embedding_and_counts_as_lm_head():
    cfg = compose_cfg("model=qwen3_tiny", "backend=emulated")
    model = build_backend(backend_spec(cfg), torch.device("cpu")).build_model()
    assert model.lm_head.weight is model.wte.weight
    n = count_params(model)
    assert n["non_embedding"] == n["total"]  # the shared matrix is the LM head's GEMM: in 6*N
    untied = build_backend(backend_spec(compose_cfg("model=llama3_tiny")), torch.device("cpu")).build_model()
    nu = count_params(untied)
    assert nu["total"] - nu["non_embedding"] == untied.wte.weight.numel()


@pytest.mark.parametrize(
    "overrides,start",
    [
        (["model.num_query_groups=3"], "model.num_query_groups=3: must divide model.num_attention_heads=4"),
        (["model.kv_channels=15"], "model.position_embedding=rope needs an even head size, not 15"),
        (["model.hidden_size=66"], "model.hidden_size=66 is not divisible by model.num_attention_heads=4"),
        (["model.rope_scaling=true", "model.rope_scaling_factor=0.5"], "model.rope_scaling_factor=0.5: must"),
        (["model.rope_scaling=true", "model.rope_high_freq_factor=1"], "model.rope_low_freq_factor=1.0, "),
        (
            ["model.rope_scaling=true", "model.position_embedding=learned"],
            "model.rope_scaling=true needs model.position_embedding=rope",
        ),
    ],
)
def test_shape_errors_are_one_line(overrides, start):
    cfg = compose_cfg("model=llama3_tiny", *overrides)
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)
    compose_cfg("model=llama3_tiny", "model.hidden_size=66", "model.kv_channels=16")  # kv_channels frees h


def flags(*overrides):
    argv, _ = megatron_args(compose_cfg(*overrides))
    return " ".join(argv)


def test_megatron_flags():
    llama = flags("model=llama3_8b_slice")
    assert "--group-query-attention --num-query-groups 8" in llama and "--rotary-base 500000" in llama
    assert "--untie-embeddings-and-output-weights" in llama and "--qk-layernorm" not in llama
    qwen = flags("model=qwen3_tiny")
    assert "--kv-channels 32" in qwen and "--qk-layernorm" in qwen and "--rotary-base 1000000" in qwen
    assert "--untie-embeddings-and-output-weights" not in qwen  # tied: Megatron's default
    assert "--add-qkv-bias" in flags("model=llama3_tiny", "model.add_qkv_bias=true")
    scaled = flags("model=llama31_tiny", "model.rope_original_max_position_embeddings=8192")
    assert "--use-rope-scaling --rope-scaling-factor 8.0" in scaled
    assert "--use-rope-scaling" not in llama
    with pytest.raises(ValueError, match=r"Megatron-LM fixes them at \(1.0, 4.0, 8192\)"):
        flags("model=llama31_tiny")  # its original context of 32 has no Megatron flag
    gpt = flags("model=gpt_tiny")
    assert not any(f in gpt for f in ("--num-query-groups", "--kv-channels", "--rotary-base", "--qk-layer"))


# qwen3 under nvfp4 and llama3 under tensorwise also train 50 steps in tests/test_hf_export.py
@pytest.mark.parametrize("preset,recipe", [("llama3_tiny", "tensorwise"), ("qwen3_tiny", "int4_qat")])
def test_trains_under_quantized_recipes(tmp_path, preset, recipe):
    from harness.train import run

    cfg = compose_cfg(
        f"model={preset}",
        f"recipe={recipe}",
        "backend=emulated",
        "logger=none",
        "steps=30",
        "log_interval=10",
        "eval_tokens=512",
        "micro_batch_size=4",
        "global_batch_size=4",
        "data.num_tokens=20000",
    )
    s = run(cfg, tmp_path)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss/train"]
    assert first > 5.4 and s.status == "completed"  # ln(256) = 5.55 from a fresh init
    assert s.final_eval_loss < first - 0.15, (first, s.final_eval_loss)  # it learns under the recipe
