"""The native-options benchmark's CPU parts: the kernel classifier on a trace, the ratios, the
memory breakdown's arithmetic and the saved-for-backward count."""

from __future__ import annotations

import pytest
import torch

from benchmarks import kernel_breakdown as K
from benchmarks import native_options as N
from harness.lifecycle.memory import GIB, SavedTensors, breakdown


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def _launch(corr, ts, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "pid": 0, "tid": tid, "args": {"correlation": corr}}  # fmt: skip


def _kernel(corr, name, dur_us):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": dur_us, "pid": 1, "tid": 7,
            "args": {"correlation": corr}}  # fmt: skip


def test_kernels_are_classified_by_launching_ops_then_by_name():
    events = [
        _op("_LayerNormMLP", 0, 100),  # TE's GEMMs: no aten op around them
        _launch(1, 10),
        _launch(2, 20),
        _op("aten::linear", 200, 50),
        _op("aten::mm", 205, 40),
        _launch(3, 210),  # the LM head
        _op("autograd::engine::evaluate_function: SelectBackward0", 300, 30, tid=2),
        _op("aten::zeros", 301, 5, tid=2),
        _launch(4, 302, tid=2),
        _op("Optimizer.step#AdamW.step", 400, 50),
        _launch(5, 410),
        _op("aten::cross_entropy_loss", 500, 20),
        _launch(6, 505),
        _launch(7, 600),  # no op open: by name
    ]
    events += [
        _kernel(1, "nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_TNT", 2000),
        _kernel(2, "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 3000),
        _kernel(3, "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 4000),
        _kernel(4, "void at::native::vectorized_elementwise_kernel<4, FillFunctor>", 500),
        _kernel(5, "void at::native::multi_tensor_apply_kernel<AdamW>", 1000),
        _kernel(6, "void at::native::cunn_SoftMaxForward<8>", 600),
        _kernel(7, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 800),
    ]
    out = K.breakdown({"traceEvents": events}, steps=2)
    ms = out["ms_per_step"]
    assert set(ms) == set(K.CATEGORIES)
    assert ms["gemm_fp8"] == 1.0 and ms["gemm_bf16"] == 1.5 and ms["lm_head"] == 2.0
    assert ms["qkv_select_backward"] == 0.25 and ms["optimizer"] == 0.5 and ms["loss"] == 0.3
    assert ms["attention"] == 0.4 and ms["elementwise_other"] == 0.0
    assert out["gpu_total_ms_per_step"] == pytest.approx(5.95)


@pytest.mark.parametrize(
    ("kernel", "category"),
    [
        ("void transformer_engine::normalization::ln_fwd_tuned_kernel<...>", "norm"),
        ("void transformer_engine::detail::cast_transpose_kernel<...>", "cast_quantize"),
        ("void transformer_engine::compute_amax_kernel", "cast_quantize"),
        ("void transformer_engine::gelu_kernel", "activation"),
        ("void at::native::embedding_backward_feature_kernel", "embedding"),
        ("cross_entropy_fwd_kernel", "loss"),
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32", "gemm_fp8"),
    ],
)
def test_kernel_names(kernel, category):
    assert K.classify(kernel, []) == category


def test_ratios_against_the_fastest_bf16_of_each_shape():
    runs = {
        "s8b_bf16": {"step_ms": 130.0},
        "s8b_bf16_all": {"step_ms": 125.0},
        "s8b_tensorwise_all": {"step_ms": 86.0},
        "mem_bf16": {"step_ms": 280.0},
        "mem_tensorwise": {"step_ms": 224.0},
        "s8b_broken": {"error": "x"},
    }
    r = N.ratios(runs)
    assert r["s8b_tensorwise_all"]["vs_best_bf16"] == pytest.approx(125 / 86)
    assert r["s8b_bf16"]["best_bf16_ms"] == 125.0 and r["mem_tensorwise"]["vs_best_bf16"] == 1.25
    assert "s8b_broken" not in r
    assert "error" in N.table(runs)


class _Opt:
    def memory_bytes(self):
        return {"master_weights": 2 * GIB, "optimizer_states": 8 * GIB, "main_grads": 4 * GIB}


def test_memory_breakdown_explains_the_peak():
    model = torch.nn.Linear(1024, 256, bias=False)  # 1 MiB of fp32 params
    out = breakdown(model, _Opt(), peak_bytes=20 * GIB, saved_bytes=3 * GIB)
    assert out["params_gib"] == pytest.approx(1 / 1024) and out["grads_gib"] == 4
    assert out["static_total_gib"] == pytest.approx(14 + 1 / 1024)
    assert out["activations_estimate_gib"] == pytest.approx(6 - 1 / 1024)
    assert out["saved_for_backward_gib"] == 3
    assert out["transient_at_peak_gib"] == pytest.approx(3 - 1 / 1024)
    total = out["static_total_gib"] + out["saved_for_backward_gib"] + out["transient_at_peak_gib"]
    assert total == pytest.approx(out["peak_measured_gib"])
    assert "saved_for_backward_gib" not in breakdown(model, _Opt(), peak_bytes=GIB)


def test_saved_tensors_counts_each_storage_once_without_the_parameters():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    counter = SavedTensors(exclude=list(lin.parameters()))
    with counter.counting():
        h = lin(x)  # saves x (and the weight: excluded)
        y = torch.tanh(h)  # saves its output
        z = (y * y).sum()  # saves y (already counted)
    assert counter.bytes == 16 * 64 * 4 + 16 * 32 * 4
    z.backward()
    assert x.grad is not None
