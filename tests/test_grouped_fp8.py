"""lowp's FP8 expert-group kernels (harness.backends.grouped_fp8) on the CPU: the per-expert amax, scale
and E4M3 cast against the emulator's CurrentScalingQuantizer at atol=0, and the FP8 wgrad against
fp64 sums of the dequantized codes, in Triton's CPU interpreter (the compiled kernels and the GEMMs
are checked on CUDA by tests/test_grouped_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import in_triton_interpreter

# (rows per expert, columns): unaligned counts, an empty expert first and in the middle, a column
# count that is no multiple of the kernels' tile
CASES = (([0, 37, 5, 100], 96), ([3, 0, 300, 17], 200))


def group_rows(counts, cols, g):
    """Rows grouped by expert, expert e's at magnitude 2^(e-1), with values that saturate, -0.0, and
    ties of the E4M3 grid after scaling."""
    x = torch.randn(sum(counts), cols, generator=g)
    start = 0
    for e, n in enumerate(counts):
        x[start : start + n] *= 2.0 ** (e - 1)
        start += n
    if x.shape[0] > 3:
        x[1, :3] = torch.tensor([-0.0, 0.0, 1e-30])
    return x.to(torch.bfloat16)


def emulated(x_e, power_2, epsilon):
    from harness.numerics.formats import E4M3
    from harness.numerics.quantizers import CurrentScalingQuantizer

    return CurrentScalingQuantizer(E4M3, power_2, epsilon).quantize(x_e)


def _on_cpu(q):
    from harness.backends.grouped_fp8 import GroupQuantized

    return GroupQuantized(*(t.cpu() if t is not None else None for t in q))


def _codes_and_scales_equal_the_emulators(device: str = "cpu", cases=CASES) -> None:
    """The group casts on `device` against the emulator's quantizer on the CPU, expert by expert."""
    from harness.backends import grouped_fp8 as G
    from harness.numerics.scaling import scale_from_amax

    g = torch.Generator().manual_seed(0)
    edge = torch.randn(12, 32, generator=g)
    edge[:4] *= 2.0**-133  # expert 0: a subnormal amax, 448 / amax overflows (scale FLT_MAX)
    edge[5, 3], edge[9, 7] = float("inf"), float("nan")  # expert 1: amax Inf (scale 1); 2: a NaN
    groups = [(group_rows(c, k, g), c) for c, k in cases] + [(edge.to(torch.bfloat16), [4, 4, 4])]
    scalings = [(False, 0.0), (True, 0.0), (False, 4.0)]
    for (x, counts), (power_2, epsilon) in [(c, s) for s in scalings for c in groups]:
        cols = x.shape[1]
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        q = G.quantize_group(
            x.to(device), ends.to(device), power_2=power_2, epsilon=epsilon, columnwise=True, row_scales=True
        )
        q, start = _on_cpu(q), 0
        for e, n in enumerate(counts):
            rows = slice(start, start + n)
            start += n
            if n == 0:  # no rows: amax 0 and its scale (TE computes nothing for it; no GEMM reads it)
                want = scale_from_amax(torch.zeros(1), 448.0, power_2=power_2, epsilon=epsilon)
                assert q.amax[e] == 0 and q.scale[e] == want and q.scale_inv[e] == 1 / want, e
                continue
            ref = emulated(x[rows], power_2, epsilon)
            assert torch.equal(q.amax[e].reshape(1), ref.amax.reshape(1)), ("amax", e)
            assert torch.equal(q.scale[e].reshape(1), ref.scale.reshape(1)), ("scale", e)
            assert torch.equal(q.scale_inv[e].reshape(1), ref.scale_inv.reshape(1)), ("scale_inv", e)
            codes = ref.q.view(torch.uint8).reshape(n, cols)
            assert torch.equal(q.rowwise[rows].view(torch.uint8), codes), ("rowwise", e)
            assert torch.equal(q.columnwise[:, rows].view(torch.uint8), codes.t()), ("columnwise", e)
            assert torch.all(q.row_scale_inv[rows] == ref.scale_inv.reshape(())), ("row scale_inv", e)
    w = (
        torch.randn(3, 48, 80, generator=g).to(torch.bfloat16)
        * torch.tensor([1.0, 1e-3, 40.0]).to(torch.bfloat16)[:, None, None]
    )
    qw = _on_cpu(G.quantize_weights(w.to(device), power_2=False, epsilon=0.0, columnwise=True))
    for e in range(3):
        ref = emulated(w[e], False, 0.0)
        codes = ref.q.view(torch.uint8).reshape(48, 80)
        assert torch.equal(qw.rowwise[e].view(torch.uint8), codes), ("weight rowwise", e)
        assert torch.equal(qw.columnwise[e].view(torch.uint8), codes.t()), ("weight columnwise", e)
        assert torch.all(qw.row_scale_inv[e] == ref.scale_inv.reshape(())), ("weight scale_inv", e)


def _fp8_wgrad_sums_each_experts_codes(device: str = "cpu") -> None:
    """The FP8 wgrad kernel on `device` against fp64 sums of the dequantized codes on the CPU."""
    from harness.backends import grouped_fp8 as G

    g = torch.Generator().manual_seed(1)
    for counts, (m, n) in (([0, 37, 5, 100], (96, 80)), ([3, 0, 17, 300], (40, 24))):
        ends = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
        dy = G.quantize_group(group_rows(counts, m, g).to(device), ends, columnwise=True)
        x = G.quantize_group(group_rows(counts, n, g).to(device), ends, columnwise=True)
        got = G.grouped_wgrad_fp8(dy.columnwise, x.columnwise, ends, dy.scale_inv, x.scale_inv).cpu()
        main = torch.randn(len(counts), m, n, generator=g)
        summed = G.grouped_wgrad_fp8(
            dy.columnwise, x.columnwise, ends, dy.scale_inv, x.scale_inv, out=main.clone().to(device)
        ).cpu()
        dy, x, stops = _on_cpu(dy), _on_cpu(x), ends.tolist()
        want = torch.stack(
            [
                (dy.columnwise[:, s - c : s].double() @ x.columnwise[:, s - c : s].double().t())
                * (dy.scale_inv[e].double() * x.scale_inv[e].double())
                for e, (c, s) in enumerate(zip(counts, stops))
            ]
        )
        tol = 1e-6 * want.abs().max()
        assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= tol, "fresh"
        assert all(torch.count_nonzero(got[i]) == 0 for i, c in enumerate(counts) if c == 0), "empty, fresh"
        assert (summed.double() - main.double() - want).abs().max() <= tol + 1e-6, "added into the main grad"
        for i, c in enumerate(counts):
            if c == 0:  # TE leaves the main grad of an expert without rows as it was
                assert torch.equal(summed[i], main[i]), ("empty, accumulated", i)


def _fp8_linear_multiplies_the_emulators_codes(device: str = "cpu") -> None:
    """FP8GroupedLinear's y, dx and main grad (and .grad without one) against fp64 GEMMs of each
    expert's emulator codes times scale_inv: y and dx within one BF16 ulp of the tensor's largest value
    (the same products, summed in another order, rounded to BF16), dW within 1e-6 of its largest."""
    from harness.backends.grouped_fp8 import FP8GroupedLinear

    g = torch.Generator().manual_seed(2)
    counts, (n_out, k_in) = [16, 0, 32, 48], (48, 64)
    x, dy = group_rows(counts, k_in, g), group_rows(counts, n_out, g)
    w = (torch.randn(len(counts), n_out, k_in, generator=g) * 0.05).to(torch.bfloat16)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    y_ref, dx_ref, dw_ref, start = [], [], [], 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        start += n
        if n == 0:  # no GEMM rows; a zero wgrad
            dw_ref.append(torch.zeros(n_out, k_in, dtype=torch.float64))
            continue
        xd, dyd, wd = (emulated(t, False, 0.0).dequantize().double() for t in (x[rows], dy[rows], w[e]))
        y_ref.append(xd @ wd.t())
        dx_ref.append(dyd @ wd)
        dw_ref.append(dyd.t() @ xd)
    y_ref, dx_ref, dw_ref = torch.cat(y_ref), torch.cat(dx_ref), torch.stack(dw_ref)

    def close(got, want, ulps):
        return (got.double() - want).abs().max() <= ulps * 2.0 ** (torch.log2(want.abs().max()).floor() - 7)

    for main_grad in (True, False):
        xi = x.to(device, copy=True).requires_grad_(True)
        wi = w.to(device, copy=True).requires_grad_(True)
        if main_grad:
            wi.main_grad = torch.zeros(wi.shape, device=device)
        y = FP8GroupedLinear.apply(xi, wi, ends.to(device), False, 0.0)
        y.backward(dy.to(device))
        assert y.dtype == torch.bfloat16 and close(y.cpu(), y_ref, 1), "y"
        assert close(xi.grad.cpu(), dx_ref, 1), "dx"
        if main_grad:
            assert wi.grad is None, "the wgrad goes to main_grad only"
            dw = wi.main_grad.cpu()
            assert (dw.double() - dw_ref).abs().max() <= 1e-6 * dw_ref.abs().max(), "main grad"
            assert torch.count_nonzero(dw[1]) == 0, "an expert without rows"
        else:
            assert wi.grad.dtype == torch.bfloat16 and close(wi.grad.cpu(), dw_ref, 1), "dw"
    wi = w.to(device, copy=True).requires_grad_(True)  # an input without grad: the wgrad only
    FP8GroupedLinear.apply(x.to(device), wi, ends.to(device), False, 0.0).backward(dy.to(device))
    assert close(wi.grad.cpu(), dw_ref, 1), "wgrad only"
    xi = x.to(device, copy=True).requires_grad_(True)  # a frozen weight: the dgrad only
    FP8GroupedLinear.apply(xi, w.to(device), ends.to(device), False, 0.0).backward(dy.to(device))
    assert close(xi.grad.cpu(), dx_ref, 1), "dgrad only"


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_fp8_linear_multiplies_the_emulators_codes_in_tritons_interpreter():
    """The autograd function's wiring (which copy and which scale_inv each GEMM takes, the wgrad into
    main_grad) on the CPU, the GEMMs by the CPU stand-in for torch._scaled_grouped_mm (skips without
    triton; the real GEMMs in tests/test_grouped_fp8_gpu.py)."""
    in_triton_interpreter(
        "from tests.test_grouped_fp8 import _fp8_linear_multiplies_the_emulators_codes as f; f()"
    )


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_group_casts_equal_the_emulators_codes_and_scales_in_tritons_interpreter():
    """Per-expert amax, scale, scale_inv and E4M3 codes (rowwise, columnwise, each row's scale_inv;
    weights' per-expert transposes) equal the emulator's CurrentScalingQuantizer on each expert's rows
    at atol=0, with unaligned counts, empty experts, pow2 scales and an amax epsilon (skips without
    triton)."""
    in_triton_interpreter(
        "from tests.test_grouped_fp8 import _codes_and_scales_equal_the_emulators as f; f()"
    )


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_fp8_wgrad_kernel_in_tritons_interpreter():
    """The FP8 wgrad sums each expert's code products in fp32 times its two scale_inv, fresh and added
    into a main grad, and leaves an empty expert's main grad untouched (skips without triton)."""
    in_triton_interpreter("from tests.test_grouped_fp8 import _fp8_wgrad_sums_each_experts_codes as f; f()")


def test_hybrid_gradients_are_refused_with_the_fix():
    from harness.backends.grouped_fp8 import require_e4m3

    require_e4m3("e4m3")
    with pytest.raises(ValueError, match=r"set recipe.fp8=e4m3") as exc:
        require_e4m3("hybrid")
    assert "\n" not in str(exc.value)


def test_grouped_puts_tensorwise_groups_on_the_fp8_kernels_only():
    from harness.backends.te_moe import KERNELS, expert_kernels
    from harness.config.schema import RecipeConfig

    tensorwise = RecipeConfig(name="tensorwise", fp8="e4m3")
    assert expert_kernels("grouped", tensorwise) == "grouped_fp8" in KERNELS
    assert expert_kernels("te", tensorwise) == "te"
    for other in ("delayed", "blockwise", "mxfp8", "nvfp4"):
        assert expert_kernels("grouped", RecipeConfig(name=other)) == "te", other


@pytest.mark.parametrize("fp8", ["hybrid", "e4m3"])
def test_grouped_tensorwise_needs_e4m3_gradients(fp8):
    """backend.moe_experts=grouped under recipe=tensorwise: E5M2 gradients (hybrid, the default) are
    refused in one line naming recipe.fp8=e4m3; all-E4M3 validates."""
    from harness.config.errors import ConfigError
    from harness.validation.load import compose_config, prepare

    over = [
        "model=qwen3_moe_tiny",
        "hardware=h200",
        "logger=none",
        "backend=te",
        "backend.moe_experts=grouped",
    ]
    cfg = compose_config([*over, "recipe=tensorwise", f"recipe.fp8={fp8}"])
    if fp8 == "e4m3":
        prepare(cfg)
        return
    with pytest.raises(ConfigError, match=r"recipe.fp8=hybrid: .* set recipe.fp8=e4m3") as exc:
        prepare(cfg)
    assert "\n" not in str(exc.value)


@pytest.mark.slow  # Triton runs ptxas
def test_kernels_compile_for_hopper_and_the_wgrad_promotes_on_wgmma():
    """The kernels compile for sm_90 without a GPU; the FP8 wgrad's MMAs are wgmma on E4M3 operands
    with fp32 promotion of their partial sums (add.f32 in the loop), not fp16 mma.sync (what
    max_num_imprecise_acc=0 gives) nor never-promoted fast accumulation (Triton's default)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from harness.backends import grouped_fp8 as G

    def compile_(fn, types: dict, consts: dict, **options):
        sig = {**types, **dict.fromkeys(consts, "constexpr")}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

    rows = {"ends_ptr": "*i32", "K": "i32"}
    amax = {
        "DTYPE": tl.bfloat16,
        "IBITS": tl.int16,
        "MASK": 0x7FFF,
        "INF": 0x7F80,
        "SPLIT": 4,
        "BR": 64,
        "BC": 128,
    }
    compile_(G._amax_kernel, {"x_ptr": "*i16", "out_ptr": "*i32", **rows}, amax)
    f32 = {"amax_ptr": "*fp32", "scale_ptr": "*fp32", "sinv_ptr": "*fp32", "row_sinv_ptr": "*fp32"}
    f32 |= {"M": "i32", "eps": "fp32"}
    cast = {"x_ptr": "*bf16", "row_ptr": "*u8", "col_ptr": "*u8", **rows, **f32}
    for per_expert in (False, True):
        flags = {"ROWWISE": True, "COLUMNWISE": True, "PER_EXPERT_T": per_expert, "ROW_SCALES": True}
        flags |= {"HAS_EPS": per_expert, "POW2": per_expert}
        compile_(G._cast_kernel, cast, {**flags, "SPLIT": 4, "BR": 64, "BC": 128}, enable_fp_fusion=False)
    wgrad = {"dyt_ptr": "*fp8e4nv", "xt_ptr": "*fp8e4nv", "ends_ptr": "*i32", "dy_sinv_ptr": "*fp32"}
    wgrad |= {"x_sinv_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32", "R": "i32"}
    tiles = {"ACCUMULATE": True, "UPCAST": False, "BM": 128, "BN": 128, "BK": 128}
    ptx = compile_(G._wgrad_kernel, wgrad, tiles, num_warps=8, num_stages=4).asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx and "mma.sync" not in ptx
    assert "add.f32" in ptx  # the partial sums promoted into the fp32 accumulator
