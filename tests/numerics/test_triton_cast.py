"""The CUDA fast path's one-kernel MXFP8 and NVFP4 quantizers (harness.numerics.triton_cast) against
the reference quantizers, bit for bit, through Triton's CPU interpreter (needs triton, a GPU extra;
the compiled kernels are checked against the CPU reference on CUDA in test_fast_path_gpu.py).
TRITON_INTERPRET is read when triton builds a kernel's definition, at import: hence a fresh process."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import in_triton_interpreter


def _inputs():
    from tests.numerics.references.inputs import make_input

    g = torch.Generator().manual_seed(0)
    out = [(k, make_input(k, (128, 256), g)) for k in ("outliers", "decades", "tiny")]
    x = torch.randn(96, 80, generator=g) * 3  # 80 columns, 96 rows: padded blocks both ways
    x[3, 5], x[7, 9], x[10, 11] = float("nan"), float("inf"), -float("inf")
    x[32:64, 32:64] = 0  # all-zero blocks
    x[64:, :32] *= 1e-38  # subnormal inputs, scales at the E8M0 floor
    out += [("planted", x), ("zeros", torch.zeros(32, 48))]
    return out, g


def _same(a, b, what):
    """Equal bits (NaN payloads aside: positions must match)."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(a.isnan(), b.isnan()), what
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
        a, b = a.nan_to_num().view(bits), b.nan_to_num().view(bits)
    n = int((a != b).sum())
    assert n == 0, f"{what}: {n} differing elements"


def _mxfp8_matches_reference() -> None:
    from harness.numerics import mxfp8
    from harness.numerics.formats import E4M3, E5M2

    inputs, _ = _inputs()
    for label, x in inputs:
        for dtype in (torch.bfloat16, torch.float32):
            for fmt in (E4M3, E5M2):
                for col in (False, True):
                    xx = x.to(dtype)
                    ref = mxfp8.quantize_mxfp8(xx, fmt, columnwise=col)
                    got = mxfp8.one_kernel(xx, fmt, xx.shape, col)
                    what = f"{label} {dtype} {fmt.name} columnwise={col}"
                    _same(ref.data.view(torch.uint8), got.data.view(torch.uint8), what + " data")
                    _same(ref.scale_inv, got.scale_inv, what + " scale_inv")
                    _same(ref.gemm_operand()[0], got.gemm_operand()[0], what + " GEMM operand")
                    _same(ref.dec, got.dec, what + " decode")


def _blockwise_matches_reference() -> None:
    from harness.numerics import blockwise
    from harness.numerics.formats import E4M3, E5M2

    inputs, _ = _inputs()
    for label, x in inputs:
        for dtype in (torch.bfloat16, torch.float32):
            for fmt, eps in ((E4M3, 0.0), (E5M2, 0.0), (E4M3, 1e-3)):
                for block in ((1, 128), (128, 1), (128, 128)):
                    xx = x.to(dtype)
                    tile_2d, col = block == (128, 128), block == (128, 1)
                    ref = blockwise.quantize_blockwise(xx, fmt, tile_2d=tile_2d, columnwise=col, epsilon=eps)
                    got = blockwise.one_kernel(xx, fmt, block, xx.shape, col, eps)
                    what = f"{label} {dtype} {fmt.name} eps={eps} {block}"
                    _same(ref.data.view(torch.uint8), got.data.view(torch.uint8), what + " data")
                    _same(ref.scale_inv, got.scale_inv, what + " scale_inv")
                    _same(ref.gemm_operand()[0], got.gemm_operand()[0], what + " GEMM operand")
                    _same(ref._scale, got._scale, what + " scale")
                    _same(ref.block_amax, got.block_amax, what + " block amax")


def _nvfp4_matches_reference() -> None:
    from harness.numerics import fast, nvfp4, triton_cast, triton_random
    from harness.numerics.qtensor import block_view, pad2d

    inputs, g = _inputs()
    for label, x in inputs:
        for dtype in (torch.bfloat16, torch.float32):
            for block in ((1, 16), (16, 1), (16, 16)):
                src = x.to(dtype)
                args = (src, block, src.shape, block == (16, 1), False, False, None)
                ref, got = nvfp4._quantize(*args, False), nvfp4.one_kernel(*args)
                what = f"{label} {dtype} {block}"
                assert got.elems.dtype == torch.bfloat16  # grid values, exact in bf16
                _same(ref.elems, got.elems.float(), what + " grid values")
                _same(ref.sf.view(torch.uint8), got.sf.view(torch.uint8), what + " block scales")
                _same(ref.dec, got.dec, what + " decode")
                _same(ref.data, got.data, what + " data")
                _same(ref.scale_inv, got.scale_inv, what + " scale_inv")
                (rv, rp), (gv, gp) = ref.gemm_operand(), got.gemm_operand()
                _same(rv, gv, what + " GEMM operand")
                _same(rp, gp, what + " post scale")
                # stochastic rounding from the same uniforms: the fused cast's function, eagerly
                br, bc = block
                blocks = block_view(pad2d(src, br, bc), br, bc)
                seed = torch.randint(0, 2**62, (1,), generator=g, dtype=torch.int64)
                u = triton_random.from_seed(blocks.shape, seed)
                assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.05
                q, _, _, vals, post = triton_cast.nvfp4(src, br, bc, ref.amax, True, seed)
                _same(post, rp, what + " kernel's post scale")
                sf32 = ref.sf.float()
                s_dec = torch.div(torch.tensor(1.0), nvfp4.global_encode_scale(ref.amax.reshape(())))
                k = torch.minimum(torch.div(torch.tensor(1.0), sf32 * s_dec), torch.tensor(torch.finfo().max))
                eq, ev = fast._e2m1_cast(True, True)(blocks, k, sf32, u)
                _same(eq.reshape(q.shape), q.float(), what + " stochastic grid values")
                _same(ev.reshape(q.shape)[: src.shape[0], : src.shape[1]], vals, what + " stochastic operand")


def _rht_matches_reference() -> None:
    from harness.numerics import nvfp4, triton_cast

    inputs, _ = _inputs()
    for label, x in inputs:
        x16 = x.to(torch.bfloat16)
        for xx in (x16, x16[: x16.shape[0] - 6]):  # whole 16-token chunks and a padded last one
            ref = nvfp4.rht_tokens(xx)
            got, amax_g = triton_cast.rht(xx, nvfp4.rht_matrix(xx.device))
            what = f"{label} {tuple(xx.shape)}"
            _same(ref, got, what + " transform")
            _same(torch.nan_to_num(ref.float().abs(), nan=0.0).amax().reshape(1), amax_g, what + " amax")
            args = (got, (16, 1), xx.shape, True, True, False, None)
            r, g = nvfp4._quantize(*args, False), nvfp4.one_kernel(*args, amax_g)
            _same(r.data, g.data, what + " codes")
            _same(r.scale_inv, g.scale_inv, what + " scale_inv")
            _same(r.gemm_operand()[0], g.gemm_operand()[0], what + " GEMM operand")


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_rht_kernel_is_the_reference_in_triton_s_interpreter():
    in_triton_interpreter("from tests.numerics.test_triton_cast import _rht_matches_reference as f\nf()\n")


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_blockwise_kernel_is_the_reference_in_triton_s_interpreter():
    in_triton_interpreter(
        "from tests.numerics.test_triton_cast import _blockwise_matches_reference as f\nf()\n"
    )


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_mxfp8_kernel_is_the_reference_in_triton_s_interpreter():
    in_triton_interpreter("from tests.numerics.test_triton_cast import _mxfp8_matches_reference as f\nf()\n")


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_nvfp4_kernel_is_the_reference_in_triton_s_interpreter():
    in_triton_interpreter("from tests.numerics.test_triton_cast import _nvfp4_matches_reference as f\nf()\n")


def test_only_power_of_two_blocks_of_known_dtypes_are_handled():
    from harness.numerics import triton_cast

    ok = triton_cast.available()
    assert triton_cast.handles(torch.zeros(64, 64, dtype=torch.bfloat16), 1, 32) is ok
    assert triton_cast.handles(torch.zeros(64, 64), 16, 16) is ok
    assert not triton_cast.handles(torch.zeros(64, 48), 1, 12)  # not a power of two
    assert not triton_cast.handles(torch.zeros(64, 64, dtype=torch.int32), 1, 32)
    assert not triton_cast.handles(torch.zeros(4, 64, 64), 1, 32)  # not a matrix
