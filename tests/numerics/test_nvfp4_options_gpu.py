"""NVFP4 row scaling and 4over6 on the CUDA fast path: the CPU reference's codes and scales, atol=0.

The Triton NVFP4 kernel has neither option, so these copies take the reference's own code on CUDA
(row scaling with the compiled element cast, 4over6 eagerly: harness.numerics.nvfp4); this checks
that the fused CUDA quantize gives TE's reference golden and the CPU reference's bits, and that the
fast Linear stays within the accumulation-order bound of the CPU reference Linear.
"""

from __future__ import annotations

import pytest
import torch

from harness.numerics import make_quantizer, resolve_recipe
from tests.helpers import needs_cuda
from tests.numerics.references.inputs import make_input
from tests.numerics.test_fast_path_gpu import _linear, _ops, _same
from tests.numerics.test_nvfp4_options import GOLDEN, _quantizer

pytestmark = [pytest.mark.gpu, needs_cuda]

NO_RHT_SR = {"disable_rht": True, "disable_stochastic_rounding": True}
# (recipe fields, role): every quantizer the two options build
CASES = {
    "rowscaled_input": ({"row_scaled_activation": True}, "input"),
    "rowscaled_input_no_rht": ({"row_scaled_activation": True, **NO_RHT_SR}, "input"),
    "4over6_weight_2d_mae_256": ({"nvfp4_4over6": "weights"}, "weight"),
    "4over6_weight_2d_mse_448": (
        {"nvfp4_4over6": "weights", "nvfp4_4over6_err_mode": "MSE", "nvfp4_4over6_e4m3_use_256": "none"},
        "weight",
    ),
    "4over6_weight_1d_mse_256": (
        {"nvfp4_4over6": "weights", "nvfp4_4over6_err_mode": "MSE", "disable_2d_quantization": True},
        "weight",
    ),
    "4over6_rowscaled_input": (
        {"nvfp4_4over6": "activations", "row_scaled_activation": True, **NO_RHT_SR},
        "input",
    ),
}


def _inputs():
    golden = torch.load(GOLDEN, weights_only=True)
    out = list(golden["inputs"].items())
    g = torch.Generator().manual_seed(3)
    for kind, shape in (("outliers", (384, 1024)), ("decades", (512, 256)), ("tiny", (256, 512))):
        out.append((f"{kind}-{shape[0]}x{shape[1]}", make_input(kind, shape, g)))
    return out


def test_cuda_fast_path_gives_te_reference_golden():
    golden = torch.load(GOLDEN, weights_only=True)
    failures = []
    for key, c in golden["cases"].items():
        qz = _quantizer(c["mode"])
        qz.fused = True
        x = golden["inputs"][c["input"]].cuda()
        for copy, (q, s, a) in zip(
            (qz.quantize(x, False), qz.quantize(x, True)),
            (("qx", "sx", "amax_row"), ("qx_t", "sx_t", "amax_col")),
        ):
            rows, cols = c[s].shape
            ok = torch.equal(copy.data.cpu(), c[q]) and torch.equal(copy.scale_inv[:rows, :cols].cpu(), c[s])
            if not (ok and torch.equal(copy.amax.cpu(), c[a])):
                failures.append(f"{key} {q}")
    assert not failures, f"{len(failures)} of {2 * len(golden['cases'])} copies differ: {failures[:6]}"


@pytest.mark.parametrize("case", list(CASES))
def test_fused_cuda_quantize_is_the_cpu_reference(case):
    fields, role = CASES[case]
    recipe = resolve_recipe("nvfp4", **fields)
    failures = []
    for label, x in _inputs():
        ref_qz, cuda_qz = make_quantizer(recipe, role), make_quantizer(recipe, role)
        cuda_qz.fused = True
        for columnwise in (False, True):
            ref_x = x.cuda() if cuda_qz.rht and columnwise else x  # the RHT's own matmul: CUDA's
            r, f = ref_qz.quantize(ref_x, columnwise), cuda_qz.quantize(x.cuda(), columnwise)
            what = f"{label} {'columnwise' if columnwise else 'rowwise'}"
            try:
                _same(r.data, f.data, f"{what} data")
                _same(r.scale_inv, f.scale_inv, f"{what} scale_inv")
                _same(r.amax, f.amax, f"{what} amax")
                (rv, rp), (fv, fp) = r.gemm_operand(), f.gemm_operand()
                _same(rv, fv, f"{what} GEMM operand")
                _same(rp, fp, f"{what} post scale")
            except AssertionError as e:
                failures.append(str(e))
    assert not failures, f"{case}: " + "; ".join(failures[:6])


@pytest.mark.parametrize(
    "fields",
    [
        {"row_scaled_activation": True},
        {"nvfp4_4over6": "weights"},
        {"nvfp4_4over6": "all", "row_scaled_activation": True, "nvfp4_4over6_err_mode": "MSE"},
    ],
)
def test_cuda_fast_linear_with_the_options_against_the_cpu_reference(fields):
    """As test_fast_path_gpu's Linear check (RHT and stochastic rounding off there): y, dx, dW within
    the accumulation-order bound plus one rounding per product for the folded global scales."""
    ops = _ops()
    ref = _linear("nvfp4", "cpu", False, ops, **fields)
    got = _linear("nvfp4", "cuda", True, ops, **fields)
    k_of = {"y": ops[0].shape[1], "dx": ops[1].shape[0], "dW": ops[0].shape[0]}
    for r, f, what in zip(ref, got, ("y", "dx", "dW")):
        bound = 2.0**-7 * r.abs() + k_of[what] * 2.0**-22 * r.abs().max()
        bad = int(((r - f).abs() > bound).sum())
        assert bad == 0, f"{fields} {what}: {bad} elements beyond the accumulation-order bound"
