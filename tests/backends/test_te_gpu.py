"""GPU tests of the TE backend: it trains each Hopper recipe, refuses Blackwell ones, and its optimizer
and memory knobs train (run on a CUDA machine with TE; skipped elsewhere)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import GPU_TINY, compose_cfg, needs_cuda, needs_te

pytestmark = pytest.mark.gpu


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["bf16", "delayed", "tensorwise", "blockwise", "int4_qat"])
def test_hopper_recipe_trains_50_steps(tmp_path, recipe):
    from harness.train import run

    s = run(compose_cfg(*GPU_TINY, "backend=te", f"recipe={recipe}", "steps=50"), tmp_path)
    assert s.status == "completed" and s.backend == "te"
    assert math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_blackwell_recipes_refused_on_hopper_with_reason(recipe):
    from harness.validation.rules import ConfigError, validate

    cfg = compose_cfg(*GPU_TINY, "backend=te", f"recipe={recipe}")
    from harness.backends.hardware import resolve_hardware

    cfg.hardware = resolve_hardware(cfg.hardware)
    if cfg.hardware.compute_capability and cfg.hardware.compute_capability >= 10:
        pytest.skip("this GPU runs Blackwell recipes natively")
    with pytest.raises(ConfigError, match="compute capability"):
        validate(cfg)


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_auto_picks_emulated_for_blackwell_recipes_on_hopper(recipe):
    from harness.backends import resolve_backend_name
    from harness.backends.capability import te_recipe_available

    ok, reason = te_recipe_available(recipe)
    if ok:
        pytest.skip("this GPU runs it natively")
    assert reason  # TE's own reason
    cfg = compose_cfg(*GPU_TINY, f"recipe={recipe}", "backend=auto")
    assert resolve_backend_name(cfg.backend.name, cfg.recipe.name) == "emulated"


@needs_cuda
@needs_te
def test_precision_aware_optimizer_and_fp8_weights_train(tmp_path):
    from harness.train import run

    s = run(
        compose_cfg(
            *GPU_TINY,
            "backend=te",
            "recipe=tensorwise",
            "optimizer=min_memory",
            "optimizer.fp8_param=true",
            "steps=30",
        ),
        tmp_path,
    )
    assert s.status == "completed" and math.isfinite(s.final_train_loss)
    assert s.memory["quantized_copies_gib"] > 0 and s.memory["optimizer_states_gib"] > 0


@needs_cuda
@needs_te
def test_optimizer_cpu_offload_with_delayed_trains(tmp_path):
    from harness.train import run

    s = run(
        compose_cfg(
            *GPU_TINY,
            "backend=te",
            "recipe=delayed",
            "optimizer.optimizer_cpu_offload=true",
            # Megatron: offload needs the precision-aware optimizer, which needs the distributed one
            "optimizer.use_precision_aware_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
            "steps=30",
        ),
        tmp_path,
    )
    assert s.status == "completed" and math.isfinite(s.final_train_loss)
    assert s.memory["host_offloaded_gib"] > 0 and s.memory["optimizer_states_gib"] == 0


@needs_cuda
@needs_te
def test_fused_wgrad_into_fp32_main_grads_matches_bf16_grads(tmp_path):
    """Megatron's default keeps fp32 main grads; TE's wgrad GEMM accumulates straight into them
    (fuse_wgrad_accumulation). Step 0's gradient norm must match the plain bf16-grad path's."""
    import json

    from harness.train import run

    norms = {}
    for grads in ("fp32", "bf16"):
        out = tmp_path / grads
        s = run(
            compose_cfg(
                *GPU_TINY,
                "backend=te",
                "recipe=bf16",
                "steps=2",
                "log_interval=1",
                "optimizer.use_precision_aware_optimizer=true",
                "optimizer.use_distributed_optimizer=true",
                f"optimizer.main_grads_dtype={grads}",
            ),
            out,
        )
        assert s.status == "completed"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        norms[grads] = next(r["optim/grad_norm"] for r in rows if "optim/grad_norm" in r)
    assert norms["fp32"] > 0 and abs(norms["fp32"] - norms["bf16"]) <= 2e-2 * norms["bf16"], norms


@needs_cuda
@needs_te
def test_chunked_lm_head_loss_matches_whole_on_te(tmp_path):
    from harness.train import run

    common = (*GPU_TINY, "backend=te", "recipe=tensorwise", "steps=20")
    a = run(compose_cfg(*common), tmp_path / "whole")
    b = run(compose_cfg(*common, "model.lm_head_loss_chunks=4"), tmp_path / "chunked")
    assert a.status == b.status == "completed"
    assert abs(a.final_train_loss - b.final_train_loss) < 1e-2 * a.final_train_loss


@needs_cuda
@needs_te
def test_accumulation_reuses_first_microbatch_weights(tmp_path, monkeypatch):
    """is_first_microbatch caching changes no number: the weights are the same inside the window."""
    from harness.backends.te import TEBackend
    from harness.train import run

    common = (*GPU_TINY, "backend=te", "recipe=tensorwise", "steps=10", "micro_batch_size=4")
    cached = run(compose_cfg(*common), tmp_path / "cached")
    monkeypatch.setattr(TEBackend, "microbatch", lambda self, i, n: None)  # quantize every forward
    fresh = run(compose_cfg(*common), tmp_path / "fresh")
    assert cached.status == fresh.status == "completed"
    assert abs(cached.final_train_loss - fresh.final_train_loss) < 1e-3 * fresh.final_train_loss


def _loss_and_grads(cfg, *, fused: bool, nudge: float = 0.0):
    """One forward/backward of the TE model from a fresh Trainer: the loss and every parameter's
    gradient (main grad or .grad). `nudge` multiplies the bf16 logit gradient by (1 + nudge) before
    it flows back through the LM head: the reference path's response to moving every logit gradient
    by one bf16 unit in the last place."""
    import tempfile

    from harness.model.loss import loss_fn
    from harness.train import Trainer

    trainer = Trainer(cfg, tempfile.mkdtemp(prefix="lowp-fused-ce-"))
    x, y = trainer._next_batch()
    model = trainer.model
    with trainer.backend.autocast():
        logits = model.lm_head(model.hidden(x))  # (B, T, V) bf16
    if nudge:
        logits.register_hook(lambda g: (g.float() * (1 + nudge)).to(g.dtype))
    loss = loss_fn(logits, y, fused=fused)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None) if p.grad is None else p.grad
        grads[name] = g.detach().float().clone()
    return loss.detach().float(), grads


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_fused_cross_entropy_matches_the_whole_logits_loss(recipe):
    """TE's fused cross entropy against the whole-logits loss (F.cross_entropy on the fp32 logits).

    Both compute the loss in fp32 from the same bf16 logits, so the losses agree to fp32 rounding of a
    mean over the tokens (relative 1e-5). Their logit gradients, softmax - onehot, are computed in fp32
    and stored in bf16 by both, so they differ at most by one bf16 unit in the last place (ULP: 2^-7
    relative at most) where the two fp32 values round to different bf16 neighbours. Everything after
    that is the same backward, which is linear in the logit gradient for the saved activations: the
    parameter gradients then differ by at most the backward's response to a one-ULP change of the
    logit gradients. The test measures that response on the reference path itself (every logit
    gradient moved by 2^-7, i.e. by at least one ULP, the worst case in which every element rounds
    differently) and allows twice it per parameter, plus the bf16 rounding of the gradient's own
    largest element. A bug (a wrong softmax, a missing 1/N) moves gradients by far more."""
    common = (*GPU_TINY, "backend=te", f"recipe={recipe}", "seed=5")
    loss_ref, g_ref = _loss_and_grads(compose_cfg(*common), fused=False)
    _, g_ulp = _loss_and_grads(compose_cfg(*common), fused=False, nudge=2**-7)
    loss_fused, g_fused = _loss_and_grads(
        compose_cfg(*common, "model.cross_entropy_loss_fusion=true"), fused=True
    )
    assert loss_fused.shape == () and abs(loss_ref - loss_fused) <= 1e-5 * abs(loss_ref)
    for name, ref in g_ref.items():
        one_ulp = (g_ulp[name] - ref).abs().max()
        own_rounding = ref.abs().max() * 2**-8  # bf16 half-ULP of the largest element
        bound = 2 * one_ulp + own_rounding
        assert (g_fused[name] - ref).abs().max() <= bound, (
            name,
            float((g_fused[name] - ref).abs().max()),
            float(bound),
        )
