"""GPU: TE's attention without a causal mask (self_attn_mask_type=no_mask) computes the emulated
bidirectional model's function on the same weights, and a masked-diffusion model trains on TE under
each Hopper recipe with variable-length micro-batches (run on a CUDA machine with TE).

Tolerance as tests/test_hf_te_gpu.py: 3x the emulated model's own distance from its fp32-GEMM
evaluation; the causal TE model must miss it (the mask is really off)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.model.objective import set_causal
from tests.helpers import compose_cfg, needs_cuda, needs_te
from tests.test_hf_te_gpu import T, built, forward, forward_fp32

pytestmark = pytest.mark.gpu


@needs_cuda
@needs_te
def test_te_no_mask_attention_computes_the_emulated_bidirectional_function():
    from harness.interop.hf_weights import load_into

    cfg, emu_b, emu = built("llama3_tiny", "emulated")
    with torch.no_grad():
        for p in emu.parameters():
            p.copy_(p.to(torch.bfloat16).float() * 4)
    sd = {k: v.detach().clone() for k, v in emu.state_dict().items()}
    _, te_b, te = built("llama3_tiny", "te")
    load_into(te, sd)
    set_causal(emu, False)
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (2, T), device="cuda")
    a = forward(emu_b, emu, idx)
    noise = (a - forward_fp32(emu, idx)).abs().max().item()
    assert (forward(te_b, te, idx) - a).abs().max().item() > 5 * noise  # TE still causal: differs
    set_causal(te, False)
    b = forward(te_b, te, idx)
    assert 0 < noise and (a - b).abs().max().item() <= 3 * noise, ((a - b).abs().max().item(), noise)


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["bf16", "delayed", "tensorwise", "blockwise"])
def test_masked_diffusion_trains_on_te(tmp_path, recipe):
    from harness.train import run

    over = ["model=llama3_tiny", "backend=te", "hardware=auto", f"recipe={recipe}", "logger=none", "steps=30"]
    over += ["objective=masked_diffusion", "data.vocab_size=255", "objective.difflm_varilen_prob=0.5"]
    over += ["log_interval=10", "eval_tokens=2048", "micro_batch_size=8", "global_batch_size=8"]
    if recipe == "blockwise":  # TE's block-scaled GEMMs want 128-multiples
        over += ["model.hidden_size=128", "model.ffn_hidden_size=256", "model.kv_channels=32"]
    s = run(compose_cfg(*over), tmp_path)
    assert s.status == "completed" and s.backend == "te"
    assert math.isfinite(s.final_train_loss) and math.isfinite(s.final_eval_loss)
    assert 0 < s.loss_floor < s.final_eval_loss
