"""The 48 golden cases: TE 2.20.2's own quantizers on an H200, reproduced bit for bit.

Codes and scale_inv of both copies; 128x128 scale tensors only in their valid region (TE leaves
the padding uninitialised); for the `normal` input also TE's dequantization (rounded to bf16,
TE's nominal dtype there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.numerics import quantize

GOLDEN = Path(__file__).parents[2].parent / "shared/golden/te-2.20.2-h200"
INPUTS = ("normal", "outliers", "tiny", "decades")
CONFIGS = {  # golden config -> (recipe, quantize() keywords), as in the golden README
    "current_e4m3": ("tensorwise", {"role": "input"}),
    "current_e5m2": ("tensorwise", {"role": "grad"}),
    "current_e4m3_pow2": ("tensorwise", {"role": "input", "power_2_scales": True}),
    "current_e4m3_eps": ("tensorwise", {"role": "input", "amax_epsilon": 1e-3}),
    "delayed_e4m3_m0": ("delayed", {"role": "input"}),
    "delayed_e4m3_m2": ("delayed", {"role": "input"}),
    "delayed_e5m2_m0": ("delayed", {"role": "grad"}),
    "block1d_e4m3": ("blockwise", {"role": "input"}),
    "block1d_e5m2": ("blockwise", {"role": "grad", "fp8": "hybrid"}),
    "block2d_e4m3": ("blockwise", {"role": "weight"}),
    "block1d_e4m3_fp32scale": ("blockwise", {"role": "input", "power_2_scales": False}),
    "block2d_e4m3_fp32scale": ("blockwise", {"role": "weight", "power_2_scales": False}),
}

pytestmark = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"golden vectors not found at {GOLDEN}")


@pytest.fixture(scope="module")
def golden():
    return {name: torch.load(GOLDEN / f"te-golden-bf16-{name}.pt") for name in INPUTS}


def test_there_are_48_cases(golden):
    assert sum(len(golden[i]["quantized"]) for i in INPUTS) == 48
    assert all(set(golden[i]["quantized"]) == set(CONFIGS) for i in INPUTS)


def _valid(s: torch.Tensor, config: str, cols: int) -> torch.Tensor:
    return s[:, :cols] if config.startswith("block2d") else s


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("inp", INPUTS)
def test_golden_case(golden, inp, config):
    x, te = golden[inp]["input"], golden[inp]["quantized"][config]
    recipe, kw = CONFIGS[config]
    if recipe == "delayed":
        kw = {**kw, "scale": te["scale"]}
    row = quantize(x, recipe, **kw)
    col = quantize(x, recipe, columnwise=True, **kw)
    if "_data" in te:  # per-tensor: Float8Tensor
        assert torch.equal(row.data, te["_data"])
        assert torch.equal(col.data, te["_transpose"])
        assert torch.equal(row.scale_inv, te["_scale_inv"])
        assert torch.equal(col.scale_inv, te["_scale_inv"])
    else:  # Float8BlockwiseQTensor; 128x128 grids: 2 x 4 tiles rowwise, 4 x 2 columnwise
        assert torch.equal(row.data, te["_rowwise_data"])
        assert torch.equal(col.data, te["_columnwise_data"])
        assert row.scale_inv.shape == te["_rowwise_scale_inv"].shape
        assert col.scale_inv.shape == te["_columnwise_scale_inv"].shape
        assert torch.equal(_valid(row.scale_inv, config, 4), _valid(te["_rowwise_scale_inv"], config, 4))
        assert torch.equal(_valid(col.scale_inv, config, 2), _valid(te["_columnwise_scale_inv"], config, 2))
    if "dequantized" in te:
        assert torch.equal(row.dequantize().bfloat16().float(), te["dequantized"])
