"""model=hf: Hugging Face config.json files (written by transformers itself) into ModelConfig, and
every field lowp does not implement refused in one line."""

from __future__ import annotations

import json

import pytest

from harness.validation.rules import ConfigError
from tests.helpers import compose_cfg, run_main

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, vocab_size=300
)


def save(tmp_path, cls: str, **kw) -> str:
    """config.json as transformers' save_pretrained writes it (this install's version)."""
    config = getattr(transformers, cls)(**{**SMALL, **kw})
    out = tmp_path / cls
    config.save_pretrained(out)
    return str(out)


def model_of(path: str, *overrides: str):
    return compose_cfg("model=hf", f"model.hf_config={path}", *overrides).model


def test_llama_gqa_untied(tmp_path):
    m = model_of(save(tmp_path, "LlamaConfig", num_key_value_heads=2, rope_theta=500000.0))
    assert (m.name, m.num_layers, m.hidden_size, m.num_attention_heads) == ("hf:LlamaConfig", 2, 64, 4)
    assert (m.num_query_groups, m.kv_channels, m.ffn_hidden_size, m.vocab_size) == (2, 16, 160, 300)
    assert (m.normalization, m.activation, m.position_embedding) == ("RMSNorm", "swiglu", "rope")
    assert m.rotary_base == 500000.0 and m.layernorm_epsilon == 1e-6
    assert m.untie_embeddings_and_output_weights and not m.qk_layernorm
    assert not m.add_bias_linear and not m.add_qkv_bias
    assert m.seq_length == 2048  # max_position_embeddings, capped at 4096


def test_qwen3_head_dim_qk_norm_tied_and_qwen2_qkv_bias(tmp_path):
    q3 = model_of(save(tmp_path, "Qwen3Config", head_dim=32, num_key_value_heads=1, tie_word_embeddings=True))
    assert (q3.kv_channels, q3.num_query_groups, q3.qk_layernorm) == (32, 1, True)
    assert not q3.untie_embeddings_and_output_weights and q3.seq_length == 4096
    q2 = model_of(save(tmp_path, "Qwen2Config"))
    assert (q2.add_qkv_bias, q2.add_bias_linear, q2.qk_layernorm, q2.kv_channels) == (True, False, False, 16)
    mistral = model_of(save(tmp_path, "MistralConfig", sliding_window=None))
    assert mistral.name == "hf:MistralConfig" and mistral.num_query_groups == 8


def test_overrides_win_and_the_directory_or_the_file_both_work(tmp_path):
    path = save(tmp_path, "LlamaConfig")
    m = model_of(path + "/config.json", "model.num_layers=1", "model.seq_length=64")
    assert (m.num_layers, m.seq_length, m.hidden_size) == (1, 64, 64)


def test_legacy_rope_fields(tmp_path):
    raw = json.loads(open(save(tmp_path, "LlamaConfig") + "/config.json").read())
    raw.pop("rope_parameters")
    raw.update(rope_theta=1e6, rope_scaling=None)
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert model_of(str(tmp_path / "old.json")).rotary_base == 1e6


REFUSED = [
    (
        "DeepseekV3Config",
        {},
        "kv_lora_rank (DeepSeek's multi-head latent attention, model_type='deepseek",
    ),
    ("MixtralConfig", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1; lowp's router has no input"),
    ("LlamaConfig", {"num_experts": 4}, "num_experts is a mixture-of-experts field in a model_type='llama'"),
    ("MistralConfig", {"sliding_window": 4096}, "sliding_window=4096: sliding-window attention"),
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 64}, "sliding_window=64: sliding"),
    ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("LlamaConfig", {"attention_bias": True}, "attention_bias=True with mlp_bias=False"),
    ("LlamaConfig", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("LlamaConfig", {"pretraining_tp": 2}, "pretraining_tp=2"),
    (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        "RoPE scaling rope_type='linear' is not implemented",
    ),
    ("LlamaConfig", {"some_new_knob": 3}, "field 'some_new_knob' is not known to lowp"),
    (
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
        "RoPE scaling rope_type='yarn' is not implemented",
    ),
]


@pytest.mark.parametrize("cls,kw,needle", REFUSED, ids=[n[:24] for _, _, n in REFUSED])
def test_unsupported_fields_are_refused_in_one_line(tmp_path, cls, kw, needle):
    path = save(tmp_path, cls, **kw)
    if cls == "LlamaConfig" and "some_new_knob" in kw:  # save_pretrained keeps unknown kwargs
        assert "some_new_knob" in open(path + "/config.json").read()
    with pytest.raises(ConfigError) as err:
        from harness.config.store import to_config
        from harness.validation.load import compose

        to_config(compose(["model=hf", f"model.hf_config={path}"]))
    msg = str(err.value)
    assert msg.startswith(f"model.hf_config={path}: ") and needle in msg and "\n" not in msg, msg


def test_cli_exit_code_2_and_one_line(tmp_path, capsys):
    """Through the entry point (`python -m harness.train`'s main, in this process)."""
    from harness.train import main

    bad = save(tmp_path, "MistralConfig", sliding_window=4096)
    run = ["logger=none", "steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_main(capsys, main, "harness.train", "model=hf", f"model.hf_config={bad}", *run)
    assert code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"error: model.hf_config={bad}: sliding_window=4096"), err[-2000:]
    code, err = run_main(capsys, main, "harness.train", "model=hf", *run)
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: model.hf_config: not set; model=hf needs model.hf_config=/path/to/config.json"
    )


def test_llama31_rope_scaling_in_and_out(tmp_path):
    """rope_type llama3 (Llama 3.1) maps to model.rope_scaling and its four parameters, in either
    spelling (rope_scaling, rope_parameters); the export writes it back as transformers reads it."""
    from harness.interop.export import hf_config
    from harness.interop.hf_config import model_fields

    scaling = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
    scaling |= dict(original_max_position_embeddings=8192)
    path = save(tmp_path, "LlamaConfig", rope_theta=500000.0, rope_scaling=scaling)
    m = model_of(path)
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_low_freq_factor) == (True, 32.0, 1.0)
    assert (m.rope_high_freq_factor, m.rope_original_max_position_embeddings) == (4.0, 8192)
    assert m.rotary_base == 500000.0
    assert not model_of(save(tmp_path / "plain", "LlamaConfig")).rope_scaling
    out, _ = hf_config(m, tmp_path)
    back = model_fields(out.to_dict(), "x")
    assert all(back[k] == getattr(m, k) for k in back if k.startswith(("rope", "rotary"))), back
    legacy = json.loads(open(path + "/config.json").read())
    legacy.pop("rope_parameters", None)
    legacy.update(
        rope_theta=500000.0,
        rope_scaling={"type": "llama3", **{k: v for k, v in scaling.items() if k != "rope_type"}},
    )
    fields = model_fields(legacy, "x")
    assert fields["rope_scaling"] and fields["rope_scaling_factor"] == 32.0
    del legacy["rope_scaling"]["low_freq_factor"]
    with pytest.raises(ConfigError, match=r"^x: rope_type='llama3' without 'low_freq_factor'; add it$"):
        model_fields(legacy, "x")
