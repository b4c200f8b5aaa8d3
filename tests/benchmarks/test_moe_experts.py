"""The expert-MLP benchmark's routing counts and spec checks (its timings run on a GPU only)."""

from __future__ import annotations

import pytest

from benchmarks import moe_experts, specs


@pytest.mark.parametrize("routing", moe_experts.ROUTINGS)
def test_counts_cover_the_rows_in_aligned_groups(routing):
    counts = moe_experts.counts_for(routing, 128, 16384 * 8)
    assert sum(counts) == 16384 * 8 and len(counts) == 128
    assert all(c % moe_experts.ALIGN == 0 for c in counts)
    if routing == "balanced":
        assert set(counts) == {1024}
    if routing == "zipf":
        assert counts[0] > 50 * counts[-1] > 0 and counts == sorted(counts, reverse=True)
    if routing == "empty":
        assert counts.count(0) == 16 and len(set(counts) - {0}) <= 2


def test_unknown_shape_is_named_before_anything_runs():
    spec = specs.load_spec("moe_experts")
    opts = moe_experts.Options(shapes=("qwen3",))
    with pytest.raises(specs.SpecError, match=r"unknown shapes \['qwen3'\]"):
        specs.check(spec, opts)


def test_device_peaks_come_from_the_hardware_config_the_device_names():
    assert moe_experts.device_peaks("NVIDIA H200")["fp8"] == 1979
    assert moe_experts.device_peaks("NVIDIA GB200")["bf16"] == 2500  # not b200's
    assert moe_experts.device_peaks("NVIDIA GeForce RTX 4090") is None


def _per_expert(counts, a, b, wgrad: bool):
    import torch

    outs, start = [], 0
    for e, n in enumerate(counts):
        sl = slice(start, start + n)
        outs.append(a[:, sl].float() @ b[sl].float() if wgrad else a[sl].float() @ b[e].float())
        start += n
    return torch.stack(outs) if wgrad else torch.cat(outs)


def test_the_bf16_gemms_alone_are_the_expert_mlps_six_products_per_expert():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    shape, E = (8, 32, 16, 2, 64), 8
    counts = moe_experts.counts_for("empty", E, 8 * 16)  # expert 7 gets no rows
    ops = moe_experts.gemm_operands(shape, counts, "cpu")
    outs = moe_experts.gemm_case(shape, counts, fp8=False, device="cpu", ops=ops)[0]()
    x, a, dy, dh, w1, w2 = (ops[n] for n in ("x", "a", "dy", "dh", "w1", "w2"))
    refs = [
        _per_expert(counts, x, w1.transpose(-2, -1), False),
        _per_expert(counts, a, w2.transpose(-2, -1), False),
        _per_expert(counts, dy, w2, False),
        _per_expert(counts, dh, w1, False),
        _per_expert(counts, dy.t(), a, True),
        _per_expert(counts, dh.t(), x, True),
    ]
    for got, ref in zip(outs, refs, strict=True):
        assert got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    assert counts[7] == 0 and outs[5][7].abs().max() == 0 and outs[4][7].abs().max() == 0


def test_the_fp8_gemms_alone_pass_torchs_layout_and_scale_checks(monkeypatch):
    torch = pytest.importorskip("torch")
    meta = pytest.importorskip("torch._meta_registrations")
    shapes = []

    def checked(a, b, sa, sb, offs=None, out_dtype=None, use_fast_accum=False):
        out = meta._meta_grouped_mm_common(
            a, b, sa, sb, offs=offs, out_dtype=out_dtype, use_fast_accum=use_fast_accum
        )
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "_scaled_grouped_mm", checked)
    E, H, F = 4, 32, 16
    step, _ = moe_experts.gemm_case((E, H, F, 2, 64), moe_experts.counts_for("balanced", E, 128), True, "cpu")
    step()
    assert shapes == [(128, 2 * F), (128, H), (128, F), (128, H), (E, H, F), (E, 2 * F, H)]
