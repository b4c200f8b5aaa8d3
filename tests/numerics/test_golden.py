"""The 48 golden cases: TE 2.20.2's own quantizers on an H200, reproduced bit for bit.

Codes and scale_inv of both copies; 128x128 scale tensors only in their valid region (TE leaves
the padding uninitialised); for the `normal` input also TE's dequantization (rounded to bf16,
TE's nominal dtype there). Every clone checks the in-repo slice of all 48 cases
(`tests/assets/golden/`, see golden_subset.py); the full set is checked where `../shared` is beside
the clone, and under `CI=true` its absence fails rather than skips.
"""

from __future__ import annotations

import os

import pytest
import torch

from harness.numerics import quantize
from tests.numerics.golden_subset import FULL as GOLDEN
from tests.numerics.golden_subset import INPUTS, SUBSET, TILE

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


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.is_dir():
        why = f"full golden vectors not found at {GOLDEN} (../shared beside the clone)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}: CI must check the full set")
        pytest.skip(why)
    return {name: torch.load(GOLDEN / f"te-golden-bf16-{name}.pt") for name in INPUTS}


@pytest.fixture(scope="module")
def subset():
    return torch.load(SUBSET)


def test_there_are_48_cases(golden):
    assert sum(len(golden[i]["quantized"]) for i in INPUTS) == 48
    assert all(set(golden[i]["quantized"]) == set(CONFIGS) for i in INPUTS)


def _valid(s: torch.Tensor, config: str, cols: int) -> torch.Tensor:
    return s[:, :cols] if config.startswith("block2d") else s


def _quantize_both(x: torch.Tensor, config: str, te: dict):
    recipe, kw = CONFIGS[config]
    if recipe == "delayed":
        kw = {**kw, "scale": te["scale"]}
    return quantize(x, recipe, **kw), quantize(x, recipe, columnwise=True, **kw)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("inp", INPUTS)
def test_golden_case(golden, inp, config):
    x, te = golden[inp]["input"], golden[inp]["quantized"][config]
    row, col = _quantize_both(x, config, te)
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


def test_subset_has_every_case(subset):
    assert set(subset) == set(INPUTS)
    assert all(set(subset[i]["quantized"]) == set(CONFIGS) for i in INPUTS)
    assert all(subset[i]["input"].shape == (TILE, TILE) for i in INPUTS)


def _valid_part(ours: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """128x128 scales: TE pads the last dimension with uninitialised entries; the stored part is valid."""
    return ours[..., : stored.shape[-1]] if ours.dim() == 2 else ours


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("inp", INPUTS)
def test_golden_subset_case(subset, inp, config):
    """The tile holds its input's amax, so its quantization is the whole tensor's, cut to the tile."""
    x, te = subset[inp]["input"], subset[inp]["quantized"][config]
    row, col = _quantize_both(x, config, te)
    assert torch.equal(row.data, te["row_data"])
    assert torch.equal(col.data, te["col_data"])
    assert torch.equal(_valid_part(row.scale_inv, te["row_scale_inv"]), te["row_scale_inv"])
    assert torch.equal(_valid_part(col.scale_inv, te["col_scale_inv"]), te["col_scale_inv"])
    if "dequantized" in te:
        n = te["dequantized"].shape[0]
        assert torch.equal(row.dequantize()[:n].bfloat16(), te["dequantized"])


def test_subset_matches_full_set(golden, subset):
    """The slice in the repo is the slice of the vectors in ../shared (regenerate it if they change)."""
    from tests.numerics.golden_subset import cut

    fresh = cut(GOLDEN)
    for inp in INPUTS:
        assert fresh[inp]["corner"] == subset[inp]["corner"]
        assert torch.equal(fresh[inp]["input"], subset[inp]["input"])
        for config, case in fresh[inp]["quantized"].items():
            assert set(case) == set(subset[inp]["quantized"][config])
            for k, v in case.items():
                assert torch.equal(v, subset[inp]["quantized"][config][k]), (inp, config, k)
