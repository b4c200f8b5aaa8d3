"""`harness.numerics.quantize`: recipe names or configs, field overrides, roles, errors."""

from __future__ import annotations

import pytest
import torch

from harness.config.schema import RecipeConfig
from harness.numerics import quantize, resolve_recipe


def x3d():
    return torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0)).bfloat16()


def test_preset_defaults_and_overrides():
    assert resolve_recipe("blockwise").power_2_scales is True
    assert resolve_recipe("blockwise", power_2_scales=False).power_2_scales is False
    cfg = RecipeConfig(name="tensorwise", fp8="e4m3")
    assert quantize(x3d(), cfg, role="grad").fmt.name == "e4m3"  # E4M3 everywhere
    assert quantize(x3d(), "tensorwise", role="grad").fmt.name == "e5m2"  # HYBRID grads


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8", "nvfp4", "int4_qat"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_dequantize_keeps_shape_and_orientation(recipe, columnwise):
    x = x3d()
    q = quantize(x, recipe, role="weight", columnwise=columnwise)
    d = q.dequantize()
    assert d.shape == x.shape and d.dtype == torch.float32
    assert (d - x.float()).abs().max() < 0.6 * x.float().abs().max()


def test_per_tensor_columnwise_is_the_byte_transpose():
    x = x3d()
    row, col = (
        quantize(x, "tensorwise", role="input"),
        quantize(x, "tensorwise", role="input", columnwise=True),
    )
    assert torch.equal(col.data, row.data.reshape(-1, 128).t().reshape(128, 2, 64))


def test_delayed_needs_a_scale():
    with pytest.raises(ValueError, match="scale="):
        quantize(x3d(), "delayed", role="input")
    q = quantize(x3d(), "delayed", role="input", scale=2.0)
    assert q.scale_inv.item() == 0.5


def test_errors():
    with pytest.raises(ValueError, match="unknown recipe fields"):
        quantize(x3d(), "tensorwise", role="input", power2=True)
    with pytest.raises(ValueError, match="role="):
        quantize(x3d(), "tensorwise", role="activation")
    with pytest.raises(ValueError, match="bf16"):
        quantize(x3d(), "bf16", role="input")
    with pytest.raises(ValueError, match="quantizer_factory"):
        quantize(x3d(), "custom", role="input", quantizer_factory="no_colon")


def test_custom_factory():
    q = quantize(
        x3d(), "custom", role="input", quantizer_factory="harness.numerics.custom:tensorwise_factory"
    )
    ref = quantize(x3d(), "tensorwise", role="input", fp8="e4m3")
    assert torch.equal(q.dequantize(), ref.dequantize())
