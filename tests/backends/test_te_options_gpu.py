"""GPU tests of the TE backend's speed options: the packed QKV gradient changes no number, the fused
cross entropy matches the whole-logits loss, FP8 attention trains (skipped without CUDA and TE)."""

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
@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_fused_cross_entropy_matches_the_whole_logits_loss(recipe):
    common = (*GPU_TINY, "backend=te", f"recipe={recipe}", "seed=5")
    loss_a, ga, _ = _grads_after_one_step(compose_cfg(*common))
    loss_b, gb, _ = _grads_after_one_step(compose_cfg(*common, "model.cross_entropy_loss_fusion=true"))
    assert loss_b.shape == () and abs(loss_a - loss_b) <= 1e-5 * abs(loss_a)
    for name in ga:  # bf16 logit grads from fp32 softmax, up to the order of fp32 operations
        scale = ga[name].abs().max().clamp_min(1e-12)
        assert (ga[name] - gb[name]).abs().max() <= 2e-2 * scale, name


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["tensorwise_fp8attn", "delayed_fp8attn"])
def test_fp8_attention_recipes_train(tmp_path, recipe):
    import json

    from harness.train import run

    cfg = compose_cfg(*GPU_TINY, *FP8_ATTN_SHAPE, "backend=te", f"recipe={recipe}", "steps=50")
    s = run(cfg, tmp_path)
    assert s.status == "completed" and math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert run_json["provenance"]["speed_options"]["fp8_dpa"] is True
    if recipe == "tensorwise_fp8attn":
        assert run_json["provenance"]["nvte_set"]["NVTE_DPA_FP8_RECIPE"] == "DelayedScaling"


@needs_cuda
@needs_te
def test_fp8_attention_really_quantizes_attention():
    """The FP8 attention path runs: DotProductAttention's fused FP8 backend, and the loss differs from
    tensorwise's (whose attention is bf16) on the same batch."""
    common = (*GPU_TINY, *FP8_ATTN_SHAPE, "backend=te", "seed=7")
    loss_tw, _, _ = _grads_after_one_step(compose_cfg(*common, "recipe=tensorwise"))
    loss_fa, _, trainer = _grads_after_one_step(compose_cfg(*common, "recipe=tensorwise_fp8attn"))
    assert math.isfinite(float(loss_fa)) and not torch.equal(loss_tw, loss_fa)
    dpa = trainer.model.blocks[0].layer.self_attention.core_attention
    assert dpa.fp8_meta["recipe"].fp8_dpa


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["bf16", "tensorwise", "delayed"])
def test_cuda_graphs_train_like_eager(tmp_path, recipe):
    """Replaying the captured blocks gives the eager run's losses (same kernels, same inputs), with
    fp32 main grads (Megatron's default optimizer) and with bf16 params (the anchor's)."""
    import json

    from harness.train import run

    for opt in ("adamw_fp32", "bf16_params"):
        common = (
            *GPU_TINY,
            "backend=te",
            f"recipe={recipe}",
            f"optimizer={opt}",
            "steps=6",
            "log_interval=1",
        )
        losses = {}
        for graphs in ("false", "true"):
            out = tmp_path / f"{opt}_{graphs}"
            s = run(compose_cfg(*common, f"backend.cuda_graphs={graphs}"), out)
            assert s.status == "completed", (opt, graphs, s.error)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            losses[graphs] = [r["loss/train"] for r in rows if "loss/train" in r]
        assert len(losses["true"]) == 6
        for a, b in zip(losses["false"], losses["true"]):
            assert abs(a - b) <= 1e-3 * abs(a), (opt, losses)


@needs_cuda
@needs_te
def test_fp8_lm_head_quantizes_the_head_and_trains(tmp_path):
    """tensorwise_fp8head: the LM head is a te.Linear that ran under FP8 autocast (verify_active), its
    loss differs from tensorwise's on the same batch (BF16 head), and 50 steps train."""
    import json

    from harness.train import run

    common = (*GPU_TINY, "backend=te", "seed=9")
    loss_tw, g_tw, _ = _grads_after_one_step(compose_cfg(*common, "recipe=tensorwise"))
    loss_fh, g_fh, trainer = _grads_after_one_step(compose_cfg(*common, "recipe=tensorwise_fp8head"))
    import transformer_engine.pytorch as te

    assert isinstance(trainer.model.lm_head, te.Linear)
    trainer.backend.verify_active(trainer.model, 0)
    assert math.isfinite(float(loss_fh)) and not torch.equal(loss_tw, loss_fh)
    assert g_fh["lm_head.weight"].abs().max() > 0
    s = run(compose_cfg(*common, "recipe=tensorwise_fp8head", "steps=50"), tmp_path)
    assert s.status == "completed" and math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert run_json["provenance"]["speed_options"]["fp8_lm_head"] is True


@needs_cuda
@needs_te
def test_fast_accumulation_changes_the_backward_only_and_trains(tmp_path):
    """tensorwise_fastacc: TE builds Float8CurrentScaling with fast accumulation in dgrad and wgrad,
    the forward (fast accumulation in fprop under both recipes) gives tensorwise's loss to the bit, some
    gradient differs (TE's modules read fp8_gemm_dgrad/fp8_gemm_wgrad), and 50 steps train."""
    import json

    from harness.train import run

    common = (*GPU_TINY, "backend=te", "seed=9")
    loss_tw, g_tw, _ = _grads_after_one_step(compose_cfg(*common, "recipe=tensorwise"))
    loss_fa, g_fa, trainer = _grads_after_one_step(compose_cfg(*common, "recipe=tensorwise_fastacc"))
    rec = trainer.backend.recipe
    assert not rec.fp8_gemm_dgrad.use_split_accumulator and not rec.fp8_gemm_wgrad.use_split_accumulator
    assert torch.equal(loss_tw, loss_fa)
    assert any(not torch.equal(g_tw[name], g_fa[name]) for name in g_tw if ".layer." in name)
    s = run(compose_cfg(*common, "recipe=tensorwise_fastacc", "steps=50"), tmp_path)
    assert s.status == "completed" and math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    provenance = json.loads((tmp_path / "run.json").read_text())["provenance"]
    assert provenance["speed_options"]["fp8_fast_accumulation"] == "all"
    assert "fp8_gemm_wgrad=MMParams(use_split_accumulator=False)" in provenance["recipe_repr"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["tensorwise_fp8headbwd", "tensorwise_fp8headbwd_fastacc"])
def test_fp8_backward_head_multiplies_te_fp8_operands(recipe):
    """The *_fp8headbwd head: its logits are the BF16 GEMM's to the bit; its dx and dW are the
    products of TE's current-scaling operands (E5M2 gradient, E4M3 weight and input), so they sit
    far closer to those dequantized operands' fp32 product than to the BF16 gradients."""
    import torch.nn.functional as F
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    from harness.backends.te_lm_head import FP8BackwardHead

    torch.manual_seed(0)
    head = FP8BackwardHead(256, 1024, compose_cfg(f"recipe={recipe}").recipe).to("cuda", torch.bfloat16)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = head(x)
    assert torch.equal(out, F.linear(x, head.weight))
    dy = torch.randn_like(out) * 1e-3
    out.backward(dy)

    def deq(t, fmt):
        q = Float8CurrentScalingQuantizer(fmt, t.device, rowwise=True, columnwise=True)
        return q(t.contiguous()).dequantize(dtype=torch.float32)

    dy_q = deq(dy.reshape(-1, 1024), tex.DType.kFloat8E5M2)
    e4m3 = tex.DType.kFloat8E4M3
    w_q, x_q = deq(head.weight, e4m3), deq(x.detach().reshape(-1, 256), e4m3)
    dx, dw = x.grad.reshape(-1, 256), head.weight.grad
    dy32, w32, x32 = dy.reshape(-1, 1024).float(), head.weight.float(), x.detach().reshape(-1, 256).float()
    assert _rel(dx, dy_q @ w_q) < 0.25 * _rel(dx, dy32 @ w32), (_rel(dx, dy_q @ w_q), _rel(dx, dy32 @ w32))
    assert _rel(dw, dy_q.t() @ x_q) < 0.25 * _rel(dw, dy32.t() @ x32)
    assert _rel(dx, dy_q @ w_q) < 1e-2 and _rel(dw, dy_q.t() @ x_q) < 1e-2


@needs_cuda
@needs_te
def test_fp8_backward_head_trains_and_reports_bf16_logits(tmp_path):
    """tensorwise_fp8headbwd: the first loss is tensorwise's on the same batch (BF16 logits), the
    head's gradient is not (FP8 dgrad/wgrad), and 50 steps train."""
    import json

    from harness.train import run

    common = (*GPU_TINY, "backend=te", "seed=9")
    loss_tw, g_tw, _ = _grads_after_one_step(compose_cfg(*common, "recipe=tensorwise"))
    loss_hb, g_hb, trainer = _grads_after_one_step(compose_cfg(*common, "recipe=tensorwise_fp8headbwd"))
    trainer.backend.verify_active(trainer.model, 0)
    assert torch.equal(loss_tw, loss_hb)
    assert not torch.equal(g_tw["lm_head.weight"], g_hb["lm_head.weight"])
    assert _rel(g_hb["lm_head.weight"], g_tw["lm_head.weight"]) < 0.2
    s = run(compose_cfg(*common, "recipe=tensorwise_fp8headbwd", "steps=50"), tmp_path)
    assert s.status == "completed" and math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    run_json = json.loads((tmp_path / "run.json").read_text())
    assert run_json["provenance"]["speed_options"]["fp8_lm_head_fprop"] is False
