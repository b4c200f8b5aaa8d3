"""The CUDA fast path's block-amax kernel (harness.numerics.triton_amax) against the reference amax,
through Triton's CPU interpreter (needs triton, a GPU extra; the compiled kernel is checked on CUDA
in test_fast_path_gpu.py). TRITON_INTERPRET is read when triton builds a kernel's definition, at
import: hence a fresh process."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import in_triton_interpreter

SHAPES = [  # (M, K, block rows, block cols): NVFP4 1x16 / 16x1 / 16x16, blockwise 1x128 / 128x128, MXFP8
    (64, 256, 1, 16),
    (64, 256, 16, 1),
    (48, 80, 16, 16),
    (256, 384, 1, 128),
    (256, 256, 128, 128),
    (96, 64, 32, 1),
    (64, 96, 1, 32),
]


def _matches_reference() -> None:
    from harness.numerics import scaling, triton_amax
    from harness.numerics.qtensor import block_view, pad2d

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, br, bc in SHAPES:
            x = (torch.randn(m, k, generator=g) * 3).to(dtype)
            x[3, 5], x[7, 9] = float("nan"), float("inf")  # NaN ignored, Inf kept (TE's fmaxf)
            blocks = block_view(pad2d(x, br, bc), br, bc)
            assert triton_amax.handles(blocks, (1, 3)), (m, k, br, bc)
            ref, _ = scaling.amax(blocks, dim=(1, 3))
            got = triton_amax.block_amax(blocks).float()
            assert torch.equal(got, ref), (dtype, m, k, br, bc)
            whole = triton_amax.tensor_amax(x).float()
            assert torch.equal(whole, ref.amax()), (dtype, m, k)
    big = torch.randn(3 * triton_amax.TENSOR_BLOCK + 5, generator=g)  # partial last program
    big[-1] = 100.0
    assert triton_amax.tensor_amax(big).item() == 100.0
    assert triton_amax.tensor_amax(torch.zeros(7)).item() == 0.0


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_block_amax_kernel_is_the_reference_in_triton_s_interpreter():
    in_triton_interpreter("from tests.numerics.test_triton_amax import _matches_reference as f\nf()\n")


def test_only_contiguous_power_of_two_block_views_are_handled():
    from harness.numerics import triton_amax
    from harness.numerics.qtensor import block_view

    x = torch.zeros(64, 64)
    ok = triton_amax.available()
    assert triton_amax.handles(block_view(x, 1, 16), (1, 3)) is ok
    assert not triton_amax.handles(block_view(x, 1, 16), None)
    assert not triton_amax.handles(torch.zeros(4, 16, 4, 16).transpose(0, 2), (1, 3))  # not contiguous
    assert not triton_amax.handles(block_view(torch.zeros(64, 48), 1, 12), (1, 3))  # not a power of two
    assert not triton_amax.handles(block_view(x.to(torch.int32), 1, 16), (1, 3))
