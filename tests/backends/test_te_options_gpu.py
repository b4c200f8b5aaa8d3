"""GPU tests of the TE backend's options: the packed QKV gradient changes no number, FP8 attention
and fast accumulation run as TE's recipe fields and train (skipped without CUDA and TE)."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from tests.helpers import GPU_TINY, compose_cfg, needs_cuda, needs_te

pytestmark = pytest.mark.gpu

# Head size 128 and a sequence of 256, the head size of the 8B-slice rows whose FP8 attention ran on
# the H200; at head size 64 / sequence 128 TE found no FP8 attention backend there (2026-12-01).
FP8_ATTN_SHAPE = ("model.hidden_size=256", "model.num_attention_heads=2", "model.seq_length=256")


def _grads_after_one_step(cfg):
    """Loss and every parameter's gradient (main grad or .grad) of one forward/backward."""
    from harness.train import Trainer

    trainer = Trainer(cfg, tempfile.mkdtemp(prefix="lowp-te-options-"))
    x, y = trainer._next_batch()
    with trainer.backend.autocast():
        loss = trainer.model.loss(x, y)
    loss.backward()
    grads = {}
    for name, p in trainer.model.named_parameters():
        g = getattr(p, "main_grad", None) if p.grad is None else p.grad
        grads[name] = g.detach().float().clone()
    return loss.detach().float(), grads, trainer


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_packed_qkv_grad_changes_no_number(recipe):
    common = (*GPU_TINY, "backend=te", f"recipe={recipe}", "seed=3")
    loss_a, ga, _ = _grads_after_one_step(compose_cfg(*common))
    loss_b, gb, trainer = _grads_after_one_step(compose_cfg(*common, "backend.packed_qkv_grad=true"))
    assert trainer.backend.describe()["speed_options"]["packed_qkv_grad"] is True
    assert torch.equal(loss_a, loss_b)
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


@needs_cuda
@needs_te
def test_packed_qkv_grad_removes_select_backward():
    from torch.profiler import ProfilerActivity, profile

    common = (*GPU_TINY, "backend=te", "recipe=bf16")
    counts = {}
    for on in ("false", "true"):
        _, _, trainer = _grads_after_one_step(compose_cfg(*common, f"backend.packed_qkv_grad={on}"))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(1)
        counts[on] = sum(e.count for e in prof.key_averages() if e.key == "SelectBackward0")
    assert counts["false"] > 0 and counts["true"] == 0, counts


@needs_cuda
@needs_te
def test_fp8_attention_trains(tmp_path):
    import json

    from harness.train import run

    fields = ("recipe=delayed", "recipe.fp8_dpa=true")
    cfg = compose_cfg(*GPU_TINY, *FP8_ATTN_SHAPE, "backend=te", *fields, "steps=50")
    s = run(cfg, tmp_path)
    assert s.status == "completed" and math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    assert s.recipe == "delayed" and s.recipe_label == "delayed + FP8 attention"
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert "fp8_dpa=True" in run_json["provenance"]["recipe_repr"]


@needs_cuda
@needs_te
def test_fp8_attention_really_quantizes_attention():
    """The FP8 attention path runs: DotProductAttention's fused FP8 backend, and the loss differs from
    delayed's (whose attention is bf16) on the same batch."""
    common = (*GPU_TINY, *FP8_ATTN_SHAPE, "backend=te", "recipe=delayed", "seed=7")
    loss_d, _, _ = _grads_after_one_step(compose_cfg(*common))
    loss_fa, _, trainer = _grads_after_one_step(compose_cfg(*common, "recipe.fp8_dpa=true"))
    assert math.isfinite(float(loss_fa)) and not torch.equal(loss_d, loss_fa)
    dpa = trainer.model.blocks[0].layer.self_attention.core_attention
    assert dpa.fp8_meta["recipe"].fp8_dpa


@needs_cuda
@needs_te
def test_fast_accumulation_changes_the_backward_only_and_trains(tmp_path):
    """recipe.fp8_fast_accumulation=all: TE builds Float8CurrentScaling with fast accumulation in dgrad
    and wgrad, the forward (fast accumulation in fprop either way) gives tensorwise's loss to the bit,
    some gradient differs (TE's modules read fp8_gemm_dgrad/fp8_gemm_wgrad), and 50 steps train."""
    import json

    from harness.train import run

    common = (*GPU_TINY, "backend=te", "recipe=tensorwise", "seed=9")
    fast = "recipe.fp8_fast_accumulation=all"
    loss_tw, g_tw, _ = _grads_after_one_step(compose_cfg(*common))
    loss_fa, g_fa, trainer = _grads_after_one_step(compose_cfg(*common, fast))
    rec = trainer.backend.recipe
    assert not rec.fp8_gemm_dgrad.use_split_accumulator and not rec.fp8_gemm_wgrad.use_split_accumulator
    assert torch.equal(loss_tw, loss_fa)
    assert any(not torch.equal(g_tw[name], g_fa[name]) for name in g_tw if ".layer." in name)
    s = run(compose_cfg(*common, fast, "steps=50"), tmp_path)
    assert s.status == "completed" and math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    assert s.recipe_label == "tensorwise + fast accumulation"
    provenance = json.loads((tmp_path / "run.json").read_text())["provenance"]
    assert "fp8_gemm_wgrad=MMParams(use_split_accumulator=False)" in provenance["recipe_repr"]
