"""benchmarks.te_cast_bandwidth: the pass classification, and the one-line refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import te_cast_bandwidth as bw


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        (
            "cast_transpose_optimized_kernel(__nv_bfloat16 const*, float const*, __nv_fp8_e4m3*",
            "cast_transpose",
        ),
        ("void transformer_engine::(anonymous namespace)::amax_kernel<16, true, __nv_bfloat16>", "amax"),
        ("transformer_engine::(anonymous namespace)::zero_amax_kernel(float*, float const*)", None),
        ("transformer_engine::(anonymous namespace)::compute_scale_from_amax_kernel(float const*", None),
        ("Memcpy DtoD (Device -> Device)", "copy"),
    ],
)
def test_kernels_are_sorted_into_the_passes_they_are(kernel, kind):
    assert bw._kind(kernel) == kind


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(capsys, tmp_path):
    assert bw.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "te_cast_bandwidth: needs a CUDA GPU (TE's casts run there only); run it on one"
    assert not (tmp_path / "te_cast_bandwidth.json").exists()
