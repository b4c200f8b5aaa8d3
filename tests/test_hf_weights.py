"""init_from: small random Llama (also with Llama 3.1's RoPE scaling), Qwen3 and Qwen2 models built
and saved by transformers, loaded into lowp's emulated GPT, whose logits must match transformers' own.

Tolerance: both models compute the same function at bf16 precision (bf16 weights and GEMM
operands, fp32 accumulation), but round in different places (HF rounds RoPE's cos/sin and the norm
output to bf16, lowp applies RoPE in fp32; their attention kernels differ). So neither equals the
other bit for bit; each differs from the exact function -- transformers in fp32 over the same bf16
weights -- by bf16 rounding noise. The test measures transformers' own bf16 error `e_hf` on each
case and requires lowp's error against the fp32 reference to be at most 2 * e_hf, and lowp vs
transformers-bf16 at most 3 * e_hf. A layout mistake (q/k/v rows, gate/up order, the QK norm, RoPE
theta) moves the logits by far more: the scrambled control shows it."""

from __future__ import annotations

import json

import pytest
import torch

from harness.backends import build_backend
from harness.interop.hf_weights import (
    fuse_qkv,
    hf_to_lowp,
    load_into,
    lowp_to_hf,
    read_safetensors,
    split_qkv,
)
from harness.train import backend_spec
from tests.helpers import compose_cfg

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    initializer_range=0.08,  # larger than 0.02 so that attention, not only the embedding, sets the logits
)
LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA31 |= dict(original_max_position_embeddings=16)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    # Llama 3.1's RoPE scaling; an original context of 16 (8192 in Llama 3.1) so it acts within T
    "llama31": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=LLAMA31)),
}
T = 32


def save_hf(out, case: str, **save_kw):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**SHAPE, **extra)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, **save_kw)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return request.param, out, save_hf(out, request.param)


def lowp_model(path, *overrides):
    cfg = compose_cfg(
        "model=hf", f"model.hf_config={path}", f"model.seq_length={T}", "backend=emulated", *overrides
    )
    backend = build_backend(backend_spec(cfg), torch.device("cpu"))
    return cfg, backend, backend.build_model()


def logits(backend, model, idx):
    with torch.no_grad(), backend.autocast():
        return model(idx).float()


def test_logits_match_transformers(checkpoint):
    case, path, hf = checkpoint
    cfg, backend, model = lowp_model(path)
    load_into(model, hf_to_lowp(read_safetensors(str(path)), cfg.model))
    idx = torch.randint(0, SHAPE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = getattr(transformers, CASES[case][1]).from_pretrained(path, dtype=torch.float32)(idx).logits
        hf16 = hf(idx).logits.float()
    lo = logits(backend, model, idx)
    e_hf = (hf16 - ref).abs().max().item()
    assert 0 < e_hf < 0.05 * ref.abs().max().item()  # bf16 noise, not a different model
    assert (lo - ref).abs().max().item() <= 2 * e_hf
    assert (lo - hf16).abs().max().item() <= 3 * e_hf
    assert (lo.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95

    # control: k and v rows of every group swapped -- the test must see a wrong layout
    sd = hf_to_lowp(read_safetensors(str(path)), cfg.model)
    for i in range(cfg.model.num_layers):
        q, k, v = split_qkv(sd[f"blocks.{i}.attn.qkv.weight"], cfg.model)
        sd[f"blocks.{i}.attn.qkv.weight"] = fuse_qkv(q, v, k, cfg.model)
    load_into(model, sd)
    assert (logits(backend, model, idx) - ref).abs().max().item() > 5 * e_hf


def test_round_trip_names_and_layouts(checkpoint):
    case, path, _ = checkpoint
    cfg, _, model = lowp_model(path)
    hf_sd = read_safetensors(str(path))
    back = lowp_to_hf(hf_to_lowp(hf_sd, cfg.model), cfg.model)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    tied = case == "qwen3"
    assert ("lm_head.weight" not in hf_sd) == tied
    load_into(model, hf_to_lowp(hf_sd, cfg.model))
    assert (model.lm_head.weight is model.wte.weight) == tied


def test_sharded_checkpoint(tmp_path):
    save_hf(tmp_path / "one", "llama")
    save_hf(tmp_path / "many", "llama", max_shard_size="40KB")
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    one, many = read_safetensors(str(tmp_path / "one")), read_safetensors(str(tmp_path / "many"))
    assert sorted(one) == sorted(many) and all(torch.equal(one[k], many[k]) for k in one)
    (tmp_path / "many" / sorted(set(index["weight_map"].values()))[0]).unlink()
    with pytest.raises(ValueError, match=r"^init_from=.*model.safetensors.index.json: shard .* missing$"):
        read_safetensors(str(tmp_path / "many"))


def test_init_from_trains_and_mismatches_are_one_line(tmp_path):
    from harness.train import run
    from harness.validation.rules import ConfigError

    save_hf(tmp_path / "q3", "qwen3")
    base = ["model=hf", f"model.hf_config={tmp_path / 'q3'}", f"init_from={tmp_path / 'q3'}", "logger=none"]
    base += [f"model.seq_length={T}", "steps=3", "log_interval=1", "eval_tokens=256", "data=synthetic"]
    base += ["micro_batch_size=2", "global_batch_size=2", "backend=emulated", "data.vocab_size=256"]
    s = run(compose_cfg(*base, "recipe=tensorwise"), tmp_path / "run")
    assert s.status == "completed"
    prov = json.loads((tmp_path / "run" / "run.json").read_text())["provenance"]
    # 8 tensors a block, wte and ln_f; tied, wte is also the LM head
    assert prov["init"]["files"] == ["model.safetensors"] and prov["init"]["tensors"] == 2 * 8 + 2
    # the run started from the checkpoint: step 1's loss is the loaded model's on the first batch
    from harness.data import build_data

    cfg, backend, model = lowp_model(tmp_path / "q3", "recipe=tensorwise")
    load_into(model, hf_to_lowp(read_safetensors(str(tmp_path / "q3")), cfg.model))
    data = build_data(compose_cfg(*base).data, vocab_size=cfg.model.vocab_size, seq_length=T)
    x, y = next(data.train_batches(2, seed=0))
    with torch.no_grad(), backend.autocast():
        want = model.loss(x, y).item()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss/train"] == pytest.approx(want, rel=1e-6)

    with pytest.raises(ConfigError) as err:  # the checkpoint's shape is not gpt_tiny's
        run(
            compose_cfg("model=gpt_tiny", f"init_from={tmp_path / 'q3'}", "logger=none", "steps=1"),
            tmp_path / "x",
        )
    msg = str(err.value)
    assert msg.startswith("init_from: the checkpoint has no ") and "model=hf model.hf_config=" in msg
    assert "\n" not in msg
    with pytest.raises(ConfigError, match=r"^init_from=/nonexistent: no such file or directory; "):
        run(compose_cfg(*base[:2], "init_from=/nonexistent", "logger=none", "steps=1"), tmp_path / "y")


def test_llama31_rope_scaling_is_transformers_and_matters(tmp_path):
    """lowp's scaled RoPE frequencies are transformers' own bit for bit; turning the scaling off
    moves the logits far outside the tolerance, so the logit check above does see it."""
    path = tmp_path / "llama31"
    save_hf(path, "llama31")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from harness.model.gpt import rope_inv_freq

    cfg, backend, model = lowp_model(path)
    m = cfg.model
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position_embeddings) == (True, 8.0, 16)
    hf_config = transformers.AutoConfig.from_pretrained(path)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    assert torch.equal(rope_inv_freq(m), want)
    plain = rope_inv_freq(
        compose_cfg("model=hf", f"model.hf_config={path}", "model.rope_scaling=false").model
    )
    assert not torch.equal(plain, want)

    sd = hf_to_lowp(read_safetensors(str(path)), m)
    idx = torch.randint(0, SHAPE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)(idx).logits
        e_hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)(idx).logits - ref
    e_hf = e_hf.abs().max().item()
    _, b2, unscaled = lowp_model(path, "model.rope_scaling=false")
    load_into(unscaled, sd)
    assert (logits(b2, unscaled, idx) - ref).abs().max().item() > 5 * e_hf
