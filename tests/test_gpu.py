"""GPU tests (run on the device): the native TE backend trains each Hopper recipe, refuses Blackwell ones."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.helpers import compose_cfg

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs TE")

GPU_TINY = [
    "model=gpt_tiny",
    "model.hidden_size=128",
    "model.ffn_hidden_size=512",
    "model.num_attention_heads=2",
    "hardware=auto",
    "logger=none",
    "data=markov",
    "micro_batch_size=8",
    "global_batch_size=8",
    "eval_tokens=4096",
    "eval_interval=0",
    "log_interval=10",
    "checkpoint_interval=-1",
]


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
    from harness.config.validate import ConfigError, validate

    cfg = compose_cfg(*GPU_TINY, "backend=te", f"recipe={recipe}")
    from harness.hardware import resolve_hardware

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
            *GPU_TINY, "backend=te", "recipe=delayed", "optimizer.optimizer_cpu_offload=true", "steps=30"
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


@needs_cuda
@needs_te
@pytest.mark.parametrize("states", [("fp8", "fp8"), ("fp8", "fp16")])
def test_batched_fp8_state_scaling_is_bit_identical_to_fused_adam(states):
    """harness.optim's FusedAdam subclass (un)scales FP8 moments for all tensors at once; TE's own
    FusedAdam does it tensor by tensor. Same grads, 6 steps: every state, scale and parameter equal."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    from harness.optim import TORCH_DTYPES, fused_adam_batched_fp8_states

    torch.manual_seed(0)
    shapes = [(256, 128), (128,), (64, 64, 3), (512,), (32, 16)]
    init = [torch.randn(s, device="cuda").bfloat16() for s in shapes]
    grads = [[torch.randn(s, device="cuda").bfloat16() * 10.0 ** -(i % 4) for i, s in enumerate(shapes)]]
    for _ in range(5):
        grads.append([g * 0.5 + torch.randn_like(g) * 1e-3 for g in grads[-1]])
    for gs in grads:
        gs[3].zero_()  # an all-zero moment: scale 1/0, NaN codes in TE; the batched path must agree

    def train(cls):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = cls(
            [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}],
            lr=1e-2,
            adam_w_mode=True,
            master_weights=True,
            exp_avg_dtype=TORCH_DTYPES[states[0]],
            exp_avg_sq_dtype=TORCH_DTYPES[states[1]],
        )
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return params, opt

    def same(a, b):  # bit-equal, NaN payloads aside
        a, b = a.float(), b.float()
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(
            torch.where(nan, 0.0, a).view(torch.int32), torch.where(nan, 0.0, b).view(torch.int32)
        )

    ref_params, ref = train(FusedAdam)
    params, opt = train(fused_adam_batched_fp8_states())
    assert type(opt).__name__ == "FusedAdamBatchedFP8States"
    for i, (p0, p1) in enumerate(zip(ref_params, params)):
        assert same(p0, p1), i
        s0, s1 = ref.state[p0], opt.state[p1]
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            a, b = s0[name], s1[name]
            if hasattr(a, "_data"):
                codes = [t._data.view(torch.float8_e4m3fn) for t in (a, b)]
                assert same(*codes), (i, name)
                assert same(a._scale_inv, b._scale_inv) and same(a._quantizer.scale, b._quantizer.scale)
            else:
                assert same(a, b), (i, name)
        for name, sc in ref._scales[p0].items():
            assert same(sc, opt._scales[p1][name]), (i, name)
    assert torch.isnan(ref.state[ref_params[3]]["exp_avg"].dequantize()).all()  # the zero-moment case ran


@needs_cuda
@needs_te
@pytest.mark.parametrize(
    ("hidden", "rows"), [(768, 2048), (2048, 2048), (4096, 2048), (256, 2048), (768, 2047)]
)
def test_te_order_layernorm_is_te_layernorm_to_the_bit(hidden, rows):
    """harness.numerics.te_layernorm on CUDA against TE's own LayerNorm (bf16 in and out): the tuned
    kernel (rows % 4 == 0) and the general one (gpt_small's 256; an odd row count)."""
    from transformer_engine.pytorch.module._common import apply_normalization

    from harness.numerics.te_layernorm import te_layer_norm

    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 2 + 0.3).bfloat16()
    w = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    want = apply_normalization(x, None, w, b, 1e-5, None, torch.bfloat16, "LayerNorm", 0, False)[0]
    got = te_layer_norm(x.float(), w.float(), b.float(), 1e-5).bfloat16()
    assert int((got.view(torch.int16) != want.view(torch.int16)).sum()) == 0
