"""GPU: the Llama/Qwen architecture on TE (GQA via num_gqa_groups, kv_channels, QK RMSNorm before
RoPE, rotary_base, tied head, Qwen2's QKV-only bias, Llama 3.1's RoPE scaling) computes the emulated
model's function on the same weights, and the llama3/qwen3/qwen2 tiny presets train under each Hopper
recipe (run on a CUDA machine with TE).

The emulated model is checked against transformers on the CPU (tests/test_hf_weights.py), so
TE == emulated closes the loop without transformers on the GPU node. Tolerance: both run bf16
GEMMs with fp32 accumulation but different attention kernels and norm/RoPE rounding points, so
they agree to bf16 noise; the bound is 3x the emulated model's own distance from its fp32-GEMM
evaluation (the same noise measured), and a control with q and k rows swapped must miss it."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import compose_cfg, needs_cuda, needs_te

pytestmark = pytest.mark.gpu
T = 64


def built(preset: str, backend: str):
    from harness.backends import build_backend
    from harness.train import backend_spec

    cfg = compose_cfg(f"model={preset}", f"backend={backend}", "hardware=auto", f"model.seq_length={T}")
    b = build_backend(backend_spec(cfg), torch.device("cuda"))
    return cfg, b, b.build_model()


def forward(backend, model, idx):
    with torch.no_grad(), backend.autocast():
        return model(idx).float()


@needs_cuda
@needs_te
@pytest.mark.parametrize("preset", ["llama3_tiny", "qwen3_tiny", "qwen2_tiny", "llama31_tiny"])
def test_te_computes_the_emulated_models_function(preset):
    from harness.interop.hf_weights import fuse_qkv, load_into, split_qkv

    cfg, emu_b, emu = built(preset, "emulated")
    with torch.no_grad():  # bf16-valued weights, so both models hold them exactly
        for p in emu.parameters():
            p.copy_(p.to(torch.bfloat16).float() * 4)  # larger than init so attention shapes the logits
        for name, p in emu.named_parameters():  # zero at init: give Qwen2's QKV bias values to carry
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)).bfloat16().float())
    sd = {k: v.detach().clone() for k, v in emu.state_dict().items()}
    _, te_b, te = built(preset, "te")
    load_into(te, sd)  # every TE parameter gets one tensor: QKV bias and no other bias on qwen2_tiny
    if cfg.model.add_qkv_bias:
        assert sum(n.endswith(".bias") for n, _ in te.named_parameters()) == cfg.model.num_layers
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (2, T), device="cuda")
    a, b = forward(emu_b, emu, idx), forward(te_b, te, idx)
    noise = (a - forward_fp32(emu, idx)).abs().max().item()  # the same weights, fp32 GEMMs
    assert 0 < noise and (a - b).abs().max().item() <= 3 * noise, ((a - b).abs().max().item(), noise)
    for i in range(cfg.model.num_layers):  # control: q and k swapped must be seen
        q, k, v = split_qkv(sd[f"blocks.{i}.attn.qkv.weight"], cfg.model)
        if q.shape == k.shape:
            sd[f"blocks.{i}.attn.qkv.weight"] = fuse_qkv(k, q, v, cfg.model)
        else:
            sd[f"blocks.{i}.attn.qkv.weight"] = fuse_qkv(q, v, k, cfg.model)
    load_into(te, sd)
    assert (forward(te_b, te, idx) - a).abs().max().item() > 5 * noise


def forward_fp32(model, idx):
    """The emulated model with every GEMM in fp32 (bf16 rounding of operands and outputs off): the
    yardstick of how far bf16 rounding alone moves these logits."""
    import harness.backends.emulated as em

    torch.backends.cuda.matmul.allow_tf32 = False
    saved = em.bf16_linear
    em.bf16_linear = lambda x, w, b, wgrad_fp32=False: torch.nn.functional.linear(x.float(), w.float(), b)
    try:
        with torch.no_grad():
            return model(idx).float()
    finally:
        em.bf16_linear = saved


@needs_cuda
@needs_te
@pytest.mark.parametrize("preset", ["llama3_tiny", "qwen3_tiny", "qwen2_tiny"])
@pytest.mark.parametrize("recipe", ["bf16", "delayed", "tensorwise", "blockwise"])
def test_presets_train_on_te(tmp_path, preset, recipe):
    from harness.train import run

    over = [f"model={preset}", "backend=te", "hardware=auto", f"recipe={recipe}", "logger=none", "steps=50"]
    over += ["log_interval=10", "eval_tokens=2048", "micro_batch_size=8", "global_batch_size=8"]
    if recipe == "blockwise":  # TE's block-scaled GEMMs want 128-multiples
        over += ["model.hidden_size=128", "model.ffn_hidden_size=256", "model.kv_channels=32"]
    s = run(compose_cfg(*over), tmp_path)
    assert s.status == "completed" and s.backend == "te"
    assert math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
