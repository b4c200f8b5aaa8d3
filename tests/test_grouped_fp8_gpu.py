"""lowp's FP8 expert groups (harness.backends.grouped_fp8) on an H200: the compiled casts against the
emulator at atol=0, the FP8 wgrad against fp64 sums of the codes, and a whole group against TE
2.20.2's GroupedLinear under Float8CurrentScaling(fp8_format=E4M3) on the same weights.

The group's codes and scales equal the emulator's at atol=0 (the first test), and TE's equal the
emulator's at atol=0 (tests/test_moe_te_gpu.py, tensorwise); so both libraries multiply the same
codes, and the outputs differ by the GEMMs' accumulation order only: y and dx (BF16) within four
BF16 ulps of the tensor's largest value, the fp32 main grad within 1e-5 of its largest value.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import moe_paths as P
from tests.helpers import compose_cfg, needs_cuda, needs_te
from tests.test_grouped_fp8 import (
    CASES,
    _codes_and_scales_equal_the_emulators,
    _fp8_linear_multiplies_the_emulators_codes,
    _fp8_wgrad_sums_each_experts_codes,
)

pytestmark = [pytest.mark.gpu, needs_cuda]
FP8 = ["recipe=tensorwise", "recipe.fp8=e4m3"]


def test_compiled_group_casts_equal_the_emulators_codes_and_scales():
    """Per-expert amax, scales and E4M3 codes (both copies, each row's scale_inv, weights' per-expert
    transposes) of the compiled kernels equal the emulator's at atol=0: the CPU test's cases and a
    fine-grained one (64 experts of Zipf-like counts, empty ones included, 2048 columns)."""
    zipf = [0 if e % 9 == 4 else 4000 // (e + 1) for e in range(64)]
    _codes_and_scales_equal_the_emulators("cuda", (*CASES, (zipf, 2048)))


def test_compiled_fp8_wgrad_sums_each_experts_codes():
    _fp8_wgrad_sums_each_experts_codes("cuda")


def test_fp8_linear_multiplies_the_emulators_codes_on_scaled_grouped_mm():
    """FP8GroupedLinear on torch._scaled_grouped_mm: y and dx within one BF16 ulp of fp64 GEMMs of the
    emulator's dequantized codes, the main grad within 1e-6 (the CPU test's check, on CUDA)."""
    _fp8_linear_multiplies_the_emulators_codes("cuda")


def _group(kernels: str, fc: str, weight: torch.Tensor, recipe: list[str]):
    """(backend, group): block 0's expert group `fc` of qwen3_moe_tiny on lowp's TE backend under
    `recipe` with backend.moe_experts=`kernels`, holding `weight`, with an fp32 main grad."""
    from harness.backends import build_backend
    from harness.train import backend_spec

    over = [*P.RUN, "backend=te", "hardware=auto", *recipe, f"backend.moe_experts={kernels}"]
    backend = build_backend(backend_spec(compose_cfg(*over)), torch.device("cuda"))
    group = getattr(backend.build_model().blocks[0].layer.layernorm_mlp.moe.experts, fc)
    with torch.no_grad():
        group.weight.copy_(weight)
    group.weight.main_grad = torch.zeros(group.weight.shape, dtype=torch.float32, device="cuda")
    return backend, group


@needs_te
@pytest.mark.parametrize("fc", ["fc1", "fc2"])
@pytest.mark.parametrize("splits", [[48, 0, 16, 16, 64, 32, 0, 16], [16] * 8])
def test_fp8_group_computes_te_grouped_linears_function(fc, splits):
    """backend.moe_experts=grouped against te under recipe=tensorwise recipe.fp8=e4m3 (TE's
    GroupedLinear under Float8CurrentScaling(E4M3)), from the same bf16 weights and rows (counts
    padded to 16, as lowp's experts pad them; experts without rows; per-expert magnitudes 2^e): y and
    dx within four BF16 ulps of the tensor's largest value, the main grad within 1e-5 of its largest
    value; an expert without rows leaves its main grad zero."""
    from harness.backends.te_moe import KERNELS

    torch.manual_seed(0)
    E, (out, inp) = 8, {"fc1": (64, 64), "fc2": (64, 32)}[fc]  # qwen3_moe_tiny: hidden 64, expert FFN 32
    weight = (torch.randn(E, out, inp) * 0.05).to(torch.bfloat16).cuda()
    scale = torch.cat([torch.full((n, 1), 2.0 ** (e - 3)) for e, n in enumerate(splits)])
    x = (torch.randn(sum(splits), inp) * scale).to(torch.bfloat16).cuda()
    dy = (torch.randn(sum(splits), out) * scale).to(torch.bfloat16).cuda()
    got = {}
    for kernels in ("te", "grouped"):
        backend, group = _group(kernels, fc, weight, FP8)
        assert group.kernels == {"te": "te", "grouped": "grouped_fp8"}[kernels]
        assert KERNELS[group.kernels] in repr(group)
        xi = x.clone().requires_grad_(True)
        with backend.autocast():
            y = group(xi, splits)
        y.backward(dy)
        if kernels == "grouped":
            assert group.weight.grad is None  # added to main_grad instead, as TE's fused wgrad does
        got[kernels] = (y.float(), xi.grad.float(), group.weight.main_grad.clone())

    def within_ulps(a, b, n):
        return (a - b).abs().max().item() <= n * 2.0 ** (math.floor(math.log2(b.abs().max().item())) - 7)

    (y_te, dx_te, mg_te), (y_g, dx_g, mg_g) = got["te"], got["grouped"]
    assert within_ulps(y_g, y_te, 4), (y_g - y_te).abs().max().item()
    assert within_ulps(dx_g, dx_te, 4), (dx_g - dx_te).abs().max().item()
    assert (mg_g - mg_te).abs().max().item() <= 1e-5 * mg_te.abs().max().item()
    for e, n in enumerate(splits):
        if n == 0:
            assert torch.count_nonzero(mg_g[e]) == 0 and torch.count_nonzero(mg_te[e]) == 0


@needs_te
def test_moe_preset_trains_on_fp8_grouped_experts(tmp_path):
    """qwen3_moe_tiny, 50 steps on TE with backend.moe_experts=grouped under recipe=tensorwise
    recipe.fp8=e4m3: the loss falls as on te (tests/test_moe_te_gpu.py's bound) and run.json records
    the FP8 grouped kernels for every expert group."""
    import json

    from harness.backends.te_moe import KERNELS
    from harness.train import run

    over = ["model=qwen3_moe_tiny", "backend=te", "hardware=auto", *FP8, "logger=none", "steps=50"]
    over += ["log_interval=10", "eval_tokens=2048", "micro_batch_size=8", "global_batch_size=8"]
    s = run(compose_cfg(*over, "backend.moe_experts=grouped"), tmp_path)
    assert s.status == "completed" and s.backend == "te"
    assert math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    kernels = json.loads((tmp_path / "run.json").read_text())["provenance"]["speed_options"]
    assert kernels["moe_experts"] == "grouped"
    assert set(kernels["moe_expert_kernels"].values()) == {KERNELS["grouped_fp8"]}
