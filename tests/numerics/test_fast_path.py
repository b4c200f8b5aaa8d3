"""The emulator's fast paths (harness.numerics.fast) against the reference path, on a CPU.

The fast GEMMs run on each copy's `gemm_operand()`: for power-of-two scales (blockwise, MXFP8,
tensorwise with power_2_scales) those values are the dequantized ones, exactly, and the CPU GEMM is
the same fp32 GEMM, so y, dx and dW are identical; tensorwise's fp32 scale and NVFP4's global
factor are folded into the GEMM's result instead, which changes a few roundings (bounded here).
The fused TE-order LayerNorm (torch.compile, inductor's C++ backend here) gives the eager
function's bits. tests/numerics/test_fast_path_gpu.py checks the CUDA side.
"""

from __future__ import annotations

import pytest
import torch

from harness.numerics import NumericsContext, QuantizedLinear, fast, quantize, resolve_recipe
from harness.numerics.te_layernorm import te_layer_norm
from tests.numerics.golden_subset import INPUTS, SUBSET
from tests.numerics.references.inputs import make_input

BF16 = torch.bfloat16

# (recipe, fields, role): every quantizer the emulated Linear builds
CASES = {
    "tensorwise_e4m3": ("tensorwise", {}, "input"),
    "tensorwise_e5m2": ("tensorwise", {}, "grad"),
    "tensorwise_pow2": ("tensorwise", {"power_2_scales": True}, "input"),
    "delayed_e4m3": ("delayed", {"scale": 3.7}, "input"),
    "block1d_e4m3": ("blockwise", {}, "input"),
    "block1d_e5m2": ("blockwise", {"fp8": "hybrid"}, "grad"),
    "block2d_e4m3": ("blockwise", {}, "weight"),
    "block1d_fp32scale": ("blockwise", {"power_2_scales": False}, "input"),
    "mxfp8_e4m3": ("mxfp8", {}, "input"),
    "mxfp8_e5m2": ("mxfp8", {"fp8": "hybrid"}, "grad"),
    "mxfp8_2d_weight": ("mxfp8", {"enable_2d_quantization": True}, "weight"),
    "nvfp4_1d": ("nvfp4", {}, "input"),
    "nvfp4_rht_sr": ("nvfp4", {}, "grad"),
    "nvfp4_2d": ("nvfp4", {}, "weight"),
}
EXACT = {
    "tensorwise_pow2",
    "block1d_e4m3",
    "block1d_e5m2",
    "block2d_e4m3",
    "mxfp8_e4m3",
    "mxfp8_e5m2",
    "mxfp8_2d_weight",
}
# codes x scale_inv: the reference's own product
FOLDED = {"tensorwise_e4m3", "tensorwise_e5m2", "delayed_e4m3"}


def _copies(x, case, seed=0):
    recipe, fields, role = CASES[case]
    fields = dict(fields)
    g = torch.Generator().manual_seed(seed)
    return [quantize(x, recipe, role=role, columnwise=c, generator=g, **fields) for c in (False, True)]


def _golden_and_random():
    subset = torch.load(SUBSET)
    out = [(f"golden-{i}", subset[i]["input"]) for i in INPUTS]
    g = torch.Generator().manual_seed(1)
    for kind, shape in (("normal", (96, 160)), ("outliers", (64, 256)), ("decades", (128, 96))):
        out.append((f"{kind}-{shape[0]}x{shape[1]}", make_input(kind, shape, g)))
    return out


INPUT_SET = _golden_and_random()


@pytest.mark.parametrize("case", list(CASES))
def test_gemm_operand_is_the_dequantized_copy(case):
    """values * post_scale against dequantize(), element by element: equal where the values are
    exact in bf16 or the fold repeats the reference's own product; within the rounding of the
    per-block dequantization factor for NVFP4."""
    for label, x in INPUT_SET:
        for q in _copies(x, case):
            vals, post = q.gemm_operand()
            deq = q.dequantize()
            assert vals.shape == deq.shape, (label, case)
            got = vals.float() if post is None else vals.float() * post
            if case in EXACT or case in FOLDED:
                assert vals.dtype == BF16 or case == "block1d_fp32scale"
                assert torch.equal(got, deq), (label, case, q.columnwise)
            elif case == "block1d_fp32scale":  # fp32 block scales: values stay fp32, the reference's own
                assert vals.dtype == torch.float32 and torch.equal(got, deq)
            else:  # NVFP4: (E2M1 x E4M3) exact in bf16; amax/2688 applied once instead of per block
                assert vals.dtype == BF16
                assert torch.equal(vals.float(), vals.float().bfloat16().float())
                rel = (got - deq).abs() / deq.abs().clamp_min(1e-30)
                assert float(rel.max()) <= 2**-22, (label, case, float(rel.max()))


@pytest.mark.parametrize("case", ["block1d_e4m3", "mxfp8_e4m3", "nvfp4_1d"])
def test_gemm_operand_values_are_exactly_bf16(case):
    """The bf16 values convert back to the fp32 products they came from (no rounding)."""
    x = INPUT_SET[0][1]
    for q in _copies(x, case):
        vals, _ = q.gemm_operand()
        blocks = q.elems.float() if q.elems.dtype != torch.float32 else q.elems
        assert vals.dtype == BF16 and torch.isfinite(vals.float()).all()
        assert blocks.shape[0] >= vals.shape[0]


def _run(name, fast_gemm, x, w, b, dy, **fields):
    recipe = resolve_recipe(name, **fields)
    ctx = NumericsContext(seed=5)
    lin = QuantizedLinear("blocks.0.mlp.fc1", recipe, ctx, fast_gemm=fast_gemm, wgrad_fp32=True)
    x = x.detach().clone().requires_grad_()
    w = torch.nn.Parameter(w.detach().clone())
    b = torch.nn.Parameter(b.detach().clone())
    y = lin.linear(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def _operands(m=192, k=256, n=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 10 ** (torch.rand(m, k, generator=g) * 4 - 2)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    dy = (torch.randn(m, n, generator=g) * 10 ** (torch.rand(m, n, generator=g) * 4 - 6)).to(BF16)
    return x, w, b, dy


COMPILES = pytest.mark.slow  # torch.compile on a CPU: inductor runs g++ and starts its compile workers


@COMPILES
@pytest.mark.parametrize(
    ("name", "fields"),
    [("blockwise", {}), ("mxfp8", {}), ("tensorwise", {"power_2_scales": True}), ("delayed", {})],
)
def test_fast_linear_is_the_reference_linear_to_the_bit(name, fields):
    """Power-of-two scales (or delayed scaling's first step, scale 1): y, dx, dW and db identical."""
    ops = _operands()
    ref = _run(name, False, *ops, **fields)
    got = _run(name, True, *ops, **fields)
    for r, f, what in zip(ref, got, ("y", "dx", "dW", "db")):
        assert torch.equal(r, f), (name, what)


@COMPILES
@pytest.mark.parametrize("name", ["tensorwise", "nvfp4"])
def test_fast_linear_with_folded_scales_differs_by_single_roundings(name):
    """The scale applied to the fp32 sum instead of to each element: y and dx (bf16) differ in under
    0.1% of their elements, by at most a bf16 ulp of the tensor's largest value (elements near zero
    after cancellation can flip entirely); dW (fp32) within 2^-18 of its largest value."""
    ops = _operands()
    ref = _run(name, False, *ops)
    got = _run(name, True, *ops)
    for r, f, what in zip(ref[:2], got[:2], ("y", "dx")):
        d = (r - f).abs()
        assert float((d > 0).float().mean()) < 1e-3, (name, what)
        assert float(d.max()) <= 2**-7 * float(r.abs().max()), (name, what)
    assert float((ref[2] - got[2]).abs().max()) <= 2**-18 * float(ref[2].abs().max()), name
    assert torch.equal(ref[3], got[3])  # dbias: no quantization


def test_fast_mm_on_cpu_is_the_fp32_gemm():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g).to(BF16), torch.randn(96, 32, generator=g).to(BF16)
    bias = torch.randn(32, generator=g)
    assert torch.equal(fast.mm(a, b), a.float() @ b.float())
    assert torch.equal(fast.mm(a, b, bias=bias), torch.addmm(bias, a.float(), b.float()))
    two = torch.tensor([2.0])
    assert torch.equal(fast.mm(a, b, two, bias), (a.float() @ b.float()) * 2 + bias)


def test_bf16_linear_wgrad_unchanged_on_cpu():
    """The BF16 recipe's fp32 wgrad goes through fast.mm: on a CPU the same fp32 GEMM as before."""
    from harness.backends.emulated import bf16_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 64, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.randn(32, 64, generator=g))
    dy = torch.randn(48, 32, generator=g)
    bf16_linear(x, w, None, wgrad_fp32=True).backward(dy)
    want = dy.to(BF16).float().t() @ x.detach().to(BF16).float()
    assert torch.equal(w.grad, want)


@pytest.mark.slow
@pytest.mark.parametrize(("hidden", "rows"), [(256, 36), (768, 16), (3072, 8)])
def test_fused_te_layernorm_is_the_eager_one_to_the_bit(hidden, rows):
    """torch.compile (inductor C++) of the TE-order statistics and output: the eager bits, for the
    general kernel (256), a one-warp tuned one (768) and a four-warp one with Chan's merge (3072)."""
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(rows, hidden, generator=g) * 2 + 0.3).bfloat16().float()
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).bfloat16().float()
    b = (0.1 * torch.randn(hidden, generator=g)).bfloat16().float()
    ref = te_layer_norm(x, w, b, 1e-5)
    got = te_layer_norm(x, w, b, 1e-5, fused=True)
    assert int((ref.view(torch.int32) != got.view(torch.int32)).sum()) == 0


def _fused_pair(case, x, fused, seed=0):
    from harness.numerics import make_quantizer

    recipe, fields, role = CASES[case]
    fields = dict(fields)
    scale = fields.pop("scale", None)
    cfg = resolve_recipe(recipe, **fields)
    scale = None if scale is None else torch.tensor([scale])
    qz = make_quantizer(cfg, role, scale=scale, generator=torch.Generator().manual_seed(seed))
    qz.fused = fused
    return [qz.quantize(x, c) for c in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fused_casts_give_the_reference_codes_and_scales(case):
    """The fused casts (torch.compile; inductor's C++ backend here) on the golden inputs: the
    reference's codes, scale_inv and dequantization, and the reference's GEMM operand."""
    subset = torch.load(SUBSET)
    for inp in INPUTS:
        x = subset[inp]["input"]
        for ref, got in zip(_fused_pair(case, x, False), _fused_pair(case, x, True)):
            assert torch.equal(ref.data, got.data), (inp, case)
            assert torch.equal(ref.scale_inv, got.scale_inv), (inp, case)
            assert torch.equal(ref.dequantize(), got.dequantize()), (inp, case)
            rv, rp = ref.gemm_operand()
            gv, gp = got.gemm_operand()
            assert torch.equal(rv, gv) and (rp is None) == (gp is None), (inp, case)
            assert rp is None or torch.equal(rp, gp)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["blockwise", "nvfp4"])
def test_fast_paths_train_the_golden_loss_curves(name, monkeypatch):
    """gpt_tiny's golden runs with every fast path forced on a CPU (fused casts, GEMMs on the GEMM
    operands): blockwise's curve to the bit (power-of-two scales); NVFP4's within 1e-3 (the global
    factor applied to the GEMM's sum)."""
    from harness.backends.emulated import EmulatedBackend
    from tests.golden_losses import curve, read_curve

    monkeypatch.setattr(EmulatedBackend, "fast_paths", True)
    got, stored = curve(name), read_curve(name)
    if name == "blockwise":
        assert got == stored
    else:
        assert [s for s, _ in got] == [s for s, _ in stored]
        assert max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, stored)) < 1e-3


@pytest.mark.slow
def test_fused_stochastic_rounding_draws_what_the_cuda_reference_draws(monkeypatch):
    """CUDA's reference SR adds torch.rand(v.shape) to v/step; the fused cast draws the same tensor
    from the same generator. Checked on a CPU with the reference's draw switched to CUDA's form."""
    import harness.numerics.formats as formats
    import harness.numerics.nvfp4 as nvfp4

    cuda_draw = lambda t, g: t.add_(torch.rand(t.shape, generator=g, device=t.device))  # noqa: E731
    monkeypatch.setattr(formats, "add_uniform_", cuda_draw)
    monkeypatch.setattr(nvfp4, "_fused_draws_match", lambda device: True)
    x = torch.load(SUBSET)["outliers"]["input"]
    for columnwise in (False, True):
        qs = [
            nvfp4.quantize_nvfp4(
                x,
                columnwise=columnwise,
                rht=True,
                stochastic=True,
                generator=torch.Generator().manual_seed(4),
                fused=f,
            )
            for f in (False, True)
        ]
        assert torch.equal(qs[0].elems, qs[1].elems) and torch.equal(qs[0].data, qs[1].data)
        assert torch.equal(qs[0].gemm_operand()[0], qs[1].gemm_operand()[0])


def _amax_inputs():
    out = [x for _, x in INPUT_SET]
    special = torch.tensor([[1.0, -0.0, float("nan"), -3.5], [float("-inf"), 2.0, 0.0, -7.0]])
    out += [special, special.to(BF16), torch.full((2, 4), -0.0), torch.full((2, 4), float("nan"))]
    return out


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sync_free_amax_is_the_reference_amax(fused):
    """scaling.amax_nosync (what CUDA runs: no host sync for the NaN check) against scaling.amax's
    CPU value, bit for bit, whole-tensor and per block, NaN, +-Inf and -0.0 included; `fused`:
    compiled (inductor's C++ backend here)."""
    from harness.numerics.scaling import amax, amax_nosync

    for x in _amax_inputs():
        for xx in (x, x.to(BF16)):
            for dim in (None, (1,)):
                want, _ = amax(xx, dim)
                got = amax_nosync(xx, dim, fused=fused)
                assert want.dtype == got.dtype and want.shape == got.shape
                if dim is None and not bool((xx.float().abs() > 0).any()):
                    want = want.abs()  # all zeros: the reference's aminmax may return -0.0, TE's +0
                assert torch.equal(want.view(torch.int32), got.view(torch.int32)), (xx.dtype, dim, xx)


@pytest.mark.parametrize("case", list(CASES))
def test_quantize_with_the_cuda_amax_reads_no_tensor_on_the_host(case, monkeypatch):
    """Every quantizer with CUDA's sync-free amax (forced onto CPU tensors here) calls no
    bool()/item() of a tensor (aten::_local_scalar_dense: a host sync on CUDA), and gives the
    reference's codes and scales (the NaN-safe branches it takes instead are no-ops here)."""
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.numerics import scaling

    x = INPUT_SET[0][1]
    want = _copies(x, case)
    cuda_amax = lambda t, dim=None: (scaling.amax_nosync(t, dim, fused=False), True)  # noqa: E731
    for mod in ("blockwise", "mxfp8", "nvfp4", "quantizers", "tensorwise"):
        monkeypatch.setattr(importlib.import_module(f"harness.numerics.{mod}"), "amax", cuda_amax)
    syncs = []

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                syncs.append(func)
            return func(*args, **(kwargs or {}))

    copies = _copies(x, case)  # outside the mode: the reference's scalar constants are cached
    with Syncs():
        copies = _copies(x, case)
    assert not syncs, f"{case}: {len(syncs)} host reads of a tensor"
    for w, g in zip(want, copies):
        assert torch.equal(w.data, g.data) and torch.equal(w.scale_inv, g.scale_inv), case


def test_a_kernel_that_fails_to_build_falls_back_once_with_a_warning():
    """fast.first_working: the Triton kernels (LayerNorm statistics, block amaxes) fall back to the
    compiled PyTorch function from their first failure on, with one warning, same numbers."""
    calls = []

    def kernel(x):
        calls.append("kernel")
        raise RuntimeError("no such layout")

    def fallback(x):
        calls.append("fallback")
        return x + 1

    run = fast.first_working(kernel, fallback)
    with pytest.warns(UserWarning, match="no such layout"):
        assert run(1) == 2
    assert run(2) == 3
    assert calls == ["kernel", "fallback", "fallback"]


@COMPILES
def test_compiled_functions_keep_eager_s_bf16_roundings():
    """A compiled bf16 rounding in fp32 storage (fast.bf16_round) is eager's x.to(bf16).float()
    (Inductor folds the literal cast pair into nothing)."""
    import shutil
    import warnings

    from harness.model.gpt import _round_sum

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler for Inductor's CPU kernels")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, generator=g), (torch.randn(4096, generator=g) * 1e-3).to(torch.bfloat16)
    x[:4] = torch.tensor([float("inf"), -float("inf"), 3.4e38, 1e-40])  # overflow to Inf, a subnormal
    assert torch.equal(fast.bf16_round(x), x.to(torch.bfloat16).float())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch.compile failed")  # no eager fallback
        got = fast._compiled(_round_sum, "cpu", True)(x, y)
    assert torch.equal(got, (x + y).to(torch.bfloat16).float())
