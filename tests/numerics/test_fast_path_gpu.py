"""The emulator's CUDA fast paths against the reference path, bit for bit where it must be.

Codes and scales: CUDA's fused casts (torch.compile -> triton) against the CPU reference on the
golden inputs and random shapes, atol=0 (the CPU golden tests cannot see a CUDA-only path); where
the reference itself draws CUDA random numbers (NVFP4 stochastic rounding) or runs CUDA's matmul
(the RHT), against the CUDA reference path. GEMMs: the bf16 tensor-core GEMMs against the CPU
reference's within the fp32 accumulation-order bound. The fused TE-order LayerNorm: the eager one's
bits on CUDA (the eager one is TE's to the bit, test_te_layernorm_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from harness.numerics import NumericsContext, QuantizedLinear, fast, make_quantizer, resolve_recipe
from tests.helpers import needs_cuda
from tests.numerics.golden_subset import FULL, INPUTS, SUBSET
from tests.numerics.references.inputs import make_input
from tests.numerics.test_fast_path import CASES

pytestmark = [pytest.mark.gpu, needs_cuda]

BF16 = torch.bfloat16
CUDA_RANDOM = {"nvfp4_rht_sr"}  # its columnwise copy draws CUDA random numbers


def _inputs():
    subset = torch.load(SUBSET)
    out = [(f"golden-tile-{i}", subset[i]["input"]) for i in INPUTS]
    for i in INPUTS:
        path = FULL / f"te-golden-bf16-{i}.pt"
        if path.is_file():
            out.append((f"golden-{i}", torch.load(path)["input"]))
    g = torch.Generator().manual_seed(3)
    for kind, shape in (("outliers", (384, 1024)), ("decades", (512, 256))):
        out.append((f"{kind}-{shape[0]}x{shape[1]}", make_input(kind, shape, g)))
    out.append(("tiny-2048x2048", make_input("tiny", (2048, 2048), g)))
    return out


def _quantizer(case, device, fused, generator):
    recipe, fields, role = CASES[case]
    fields = dict(fields)
    scale = fields.pop("scale", None)
    scale = None if scale is None else torch.tensor([scale], device=device)
    qz = make_quantizer(resolve_recipe(recipe, **fields), role, scale=scale, generator=generator)
    qz.fused = fused
    return qz


def _quantize(case, x, fused, generator):
    qz = _quantizer(case, x.device, fused, generator)
    return [qz.quantize(x, c) for c in (False, True)]


def _same(a, b, what):
    """Bit patterns equal (NaN codes included)."""
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, what
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(a.dtype)
    n = int((a.view(bits) != b.view(bits)).sum()) if bits else int((a != b).sum())
    assert n == 0, f"{what}: {n} differing elements"


@pytest.mark.parametrize("case", list(CASES))
def test_fused_cuda_codes_are_the_reference_codes(case):
    failures = []
    for label, x in _inputs():
        g_ref = torch.Generator(device="cuda" if case in CUDA_RANDOM else "cpu").manual_seed(11)
        ref_x = x.cuda() if case in CUDA_RANDOM else x
        ref = _quantize(case, ref_x, False, g_ref)
        got = _quantize(case, x.cuda(), True, torch.Generator(device="cuda").manual_seed(11))
        for orient, r, f in zip(("rowwise", "columnwise"), ref, got):
            if case.startswith("nvfp4") and orient == "columnwise" and case != "nvfp4_2d":
                r = _quantize(case, x.cuda(), False, torch.Generator(device="cuda").manual_seed(11))[1]
            try:
                _same(r.data, f.data, f"{label} {orient} data")
                _same(r.scale_inv, f.scale_inv, f"{label} {orient} scale_inv")
                rv, rp = r.gemm_operand()
                fv, fp = f.gemm_operand()
                _same(rv, fv, f"{label} {orient} GEMM operand")
                assert (rp is None) == (fp is None)
                if rp is not None:
                    _same(rp, fp, f"{label} {orient} post scale")
            except AssertionError as e:
                failures.append(str(e))
    assert not failures, f"{case}: " + "; ".join(failures[:6])


@pytest.mark.parametrize("case", ["nvfp4_1d", "nvfp4_rht_sr"])
def test_rht_copy_on_cuda_is_the_cpu_one(case):
    """The RHT columnwise copy's codes on CUDA (no stochastic rounding) against the CPU's: both
    multiply bf16 values by +-1/4 and sum 16 of them in fp32, in torch's matmul order on each."""
    recipe = resolve_recipe("nvfp4", disable_stochastic_rounding=True)
    qz_cpu, qz_gpu = (make_quantizer(recipe, CASES[case][2]) for _ in range(2))
    qz_gpu.fused = True
    for label, x in _inputs():
        _same(qz_cpu.quantize(x, True).data, qz_gpu.quantize(x.cuda(), True).data, f"{label} RHT copy")


def _linear(name, device, fast_gemm, ops, **fields):
    if name == "nvfp4":  # CPU and CUDA random numbers differ; the RHT copies: their own test
        fields = {**fields, "disable_stochastic_rounding": True, "disable_rht": True}
    recipe = resolve_recipe(name, **fields)
    ctx = NumericsContext(device)
    lin = QuantizedLinear("blocks.0.mlp.fc1", recipe, ctx, fast_gemm=fast_gemm, wgrad_fp32=True)
    x, w, b, dy = (t.to(device) for t in ops)
    x = x.clone().requires_grad_()
    w, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    y = lin.linear(x, w, b)
    y.backward(dy)
    return [t.detach().cpu().float() for t in (y, x.grad, w.grad)]


def _ops(m=1024, k=768, n=512):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) * 10 ** (torch.rand(m, k, generator=g) * 4 - 2)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    dy = (torch.randn(m, n, generator=g) * 1e-4).to(BF16)
    return x, w, b, dy


LINEAR_CASES = [
    ("blockwise", {}),
    ("mxfp8", {}),
    ("tensorwise", {}),
    ("tensorwise", {"power_2_scales": True}),
    ("nvfp4", {}),
    ("tensorwise", {"backward_override": "high_precision"}),
    ("blockwise", {"backward_override": "dequantized"}),
    ("nvfp4", {"backward_override": "dequantized"}),
    ("mxfp8", {"enable_2d_quantization": True}),
]


@pytest.mark.parametrize(("name", "fields"), LINEAR_CASES)
def test_cuda_fast_linear_against_the_cpu_reference(name, fields):
    """y, dx (bf16) and dW (fp32) of the CUDA fast path against the CPU reference path: the sums
    of the same exact products in another order, so |diff| <= K * 2^-23 * sum|a||b| (+ one bf16
    rounding of the result); folded scales (tensorwise fp32, NVFP4) add one rounding per product."""
    ops = _ops()
    ref = _linear(name, "cpu", False, ops, **fields)
    got = _linear(name, "cuda", True, ops, **fields)
    k_of = {"y": ops[0].shape[1], "dx": ops[1].shape[0], "dW": ops[0].shape[0]}
    for r, f, what in zip(ref, got, ("y", "dx", "dW")):
        bound = 2.0**-7 * r.abs() + k_of[what] * 2.0**-22 * r.abs().max()
        bad = int(((r - f).abs() > bound).sum())
        assert bad == 0, f"{name} {what}: {bad} elements beyond the accumulation-order bound"


def test_bf16_wgrad_gemm_is_fp32_accurate():
    """fast.mm on bf16 CUDA operands: within the fp32 accumulation bound of the fp64 product."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4096, 2048, generator=g).to(BF16), torch.randn(2048, 1024, generator=g).to(BF16)
    exact = a.double() @ b.double()
    got = fast.mm(a.cuda(), b.cuda()).cpu().double()
    bound = 2048 * 2.0**-24 * (a.double().abs() @ b.double().abs())
    assert bool(((got - exact).abs() <= bound).all())
    assert fast.mm(a.cuda(), b.cuda()).dtype == torch.float32


@pytest.mark.parametrize(("hidden", "rows"), [(2048, 16384), (768, 2047), (4096, 1028), (1000, 37)])
def test_fused_te_layernorm_is_the_eager_one_on_cuda(hidden, rows):
    """The 1.4B shape (one warp a row), the general kernel (with loads past the row), four warps with
    Chan's merge (8B slice): the Triton statistics and the compiled output step against the eager
    reference, at atol=0 (the eager one is checked against TE in test_te_layernorm_gpu.py)."""
    from harness.numerics.te_layernorm import te_layer_norm

    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 2 + 0.3).bfloat16().float()
    w = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16().float()
    b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16().float()
    ref = te_layer_norm(x, w, b, 1e-5)
    got = te_layer_norm(x, w, b, 1e-5, fused=True)
    assert int((ref.view(torch.int32) != got.view(torch.int32)).sum()) == 0


@pytest.mark.parametrize("case", list(CASES))
def test_fused_cuda_quantize_needs_no_host_sync(case):
    """A fused CUDA quantize (amax, scale, cast, GEMM operand) under
    torch.cuda.set_sync_debug_mode("error") after a warm-up call: no .item()/bool() of a CUDA
    tensor, which would drain the launch queue once per quantized tensor."""
    x = torch.randn(512, 384, generator=torch.Generator().manual_seed(5)).cuda()
    qz = _quantizer(case, "cuda", True, torch.Generator(device="cuda").manual_seed(11))
    for c in (False, True):  # compiles, fills the constant caches
        qz.quantize(x, c).gemm_operand()
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for c in (False, True):
            qz.quantize(x, c).gemm_operand()
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def test_cuda_amax_is_the_cpu_amax_without_a_sync():
    from harness.numerics.scaling import amax

    x = torch.randn(1024, 512, generator=torch.Generator().manual_seed(2))
    x[3, 7], x[100, 0] = float("nan"), float("-inf")
    for xx in (x, x.to(BF16)):
        for dim in (None, (1,)):
            want, xc = amax(xx, dim)[0], xx.cuda()
            amax(xc, dim)  # compiles
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = amax(xc, dim)[0]
            finally:
                torch.cuda.set_sync_debug_mode(0)
            _same(want, got, f"amax {xx.dtype} dim={dim}")


def test_block_amax_kernel_is_the_reference_on_cuda():
    """harness.numerics.triton_amax on CUDA: the block amaxes of every block recipe's shapes equal the
    CPU reference's at atol=0 (NaN ignored, Inf kept), bf16 and fp32 inputs."""
    from harness.numerics import scaling, triton_amax
    from harness.numerics.qtensor import block_view, pad2d

    g = torch.Generator().manual_seed(0)
    shapes = [(4096, 2048, 1, 16), (4096, 2048, 16, 1), (2048, 8192, 16, 16), (1000, 1536, 1, 128)]
    shapes += [(1024, 1024, 128, 128), (4096, 2048, 32, 1), (4096, 2048, 1, 32)]
    for dtype in (torch.bfloat16, torch.float32):
        for m, k, br, bc in shapes:
            x = (torch.randn(m, k, generator=g) * 3).to(dtype)
            x[3, 5], x[7, 9] = float("nan"), float("inf")
            blocks = block_view(pad2d(x, br, bc), br, bc)
            ref, _ = scaling.amax(blocks, dim=(1, 3))
            xc = blocks.cuda()
            assert triton_amax.handles(xc, (1, 3))
            got = triton_amax.block_amax(xc).float().cpu()
            assert torch.equal(got, ref), (dtype, m, k, br, bc)


def test_fused_residual_add_is_the_unfused_one_on_cuda():
    """model.residual_add's compiled CUDA pass against bf16_values(x + y): values and gradients."""
    from harness.model.gpt import bf16_values, residual_add

    g = torch.Generator().manual_seed(0)
    x0 = bf16_values(torch.randn(4096, 2048, generator=g) * 3).cuda()
    y0 = (torch.randn(4096, 2048, generator=g) * 1e-2).to(BF16).cuda()
    grad = torch.randn(4096, 2048, generator=g).cuda()
    outs = []
    for fused in (False, True):
        x, y = x0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
        out = residual_add(x, y) if fused else bf16_values(x + y)
        out.backward(grad)
        outs.append((out.detach(), x.grad, y.grad))
    for a, b, what in zip(*outs, ("sum", "dx", "dy")):
        _same(a, b, what)


def test_norm_with_bf16_output_is_the_fp32_one_rounded_on_cuda():
    """TEOrderLayerNorm.bf16_output (its linear rounds the input anyway): forward bits and the
    gradients of x, weight and bias equal the fp32 output's rounded by the consumer."""
    from harness.backends.emulated import TEOrderLayerNorm
    from harness.model.gpt import bf16_values

    g = torch.Generator().manual_seed(1)
    x0 = bf16_values(torch.randn(2, 1024, 2048, generator=g) * 2).cuda()
    gy = torch.randn(2, 1024, 2048, generator=g).to(BF16).cuda()
    w0, b0 = 1 + 0.1 * torch.randn(2048, generator=g), 0.1 * torch.randn(2048, generator=g)
    outs = []
    for bf16_output in (False, True):
        ln = TEOrderLayerNorm(2048, eps=1e-5).cuda()
        with torch.no_grad():
            ln.weight.copy_(w0), ln.bias.copy_(b0)
        ln.bf16_output = bf16_output
        x = x0.clone().requires_grad_(True)
        out = ln(x)
        out = out if bf16_output else out.to(BF16)
        out.backward(gy)
        outs.append((out.detach(), x.grad, ln.weight.grad, ln.bias.grad))
    for a, b, what in zip(*outs, ("y", "dx", "dgamma", "dbeta")):
        _same(a, b, what)
