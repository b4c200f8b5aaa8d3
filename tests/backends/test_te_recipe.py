"""The TE recipe object lowp builds, on a CPU: a stand-in for transformer_engine.common.recipe whose
recipe classes have no defaults, so every field the builder leaves to TE fails here. Real TE builds the
same configs in tests/test_megatron_gpu.py (its recipe classes' own asserts)."""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass

import pytest

from harness import recipes
from harness.backends.te_recipe import build_te_recipe
from harness.config.schema import StabilityConfig


class _Format(enum.Enum):
    E4M3 = "e4m3"
    HYBRID = "hybrid"


@dataclass(frozen=True)
class _QParams:
    power_2_scale: bool
    amax_epsilon: float


@dataclass(frozen=True)
class _MMParams:
    use_split_accumulator: bool


@dataclass(kw_only=True)
class _Float8CurrentScaling:
    fp8_format: _Format
    fp8_dpa: bool
    fp8_mha: bool
    backward_override: str | None
    fp8_gemm_fprop: _MMParams
    fp8_gemm_dgrad: _MMParams
    fp8_gemm_wgrad: _MMParams


@pytest.fixture
def stand_in_te(monkeypatch):
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format, recipe.QParams, recipe.MMParams = _Format, _QParams, _MMParams
    recipe.Float8CurrentScaling = _Float8CurrentScaling
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    te = types.ModuleType("transformer_engine")
    te.common = common
    for name, mod in (("transformer_engine", te), ("transformer_engine.common", common)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)


def _split(rec) -> tuple[bool, bool, bool]:
    return tuple(getattr(rec, f"fp8_gemm_{g}").use_split_accumulator for g in ("fprop", "dgrad", "wgrad"))


@pytest.mark.parametrize(
    ("recipe", "split"),
    [
        ("tensorwise", (False, True, True)),  # TE's default: fast accumulation in fprop only
        ("tensorwise_fp8head", (False, True, True)),
        ("tensorwise_fastacc", (False, False, False)),
        ("tensorwise_fp8head_fastacc", (False, False, False)),
        ("tensorwise_fp8attn_fastacc", (False, False, False)),
    ],
)
def test_fast_accumulation_sets_float8_current_scalings_gemm_params(stand_in_te, recipe, split):
    r = recipes.default_fields(recipe)
    rec = build_te_recipe(r, StabilityConfig())
    assert isinstance(rec, _Float8CurrentScaling)
    assert _split(rec) == split
    assert rec.fp8_format is _Format.HYBRID and rec.fp8_quant_bwd_grad == _QParams(False, 0.0)


def test_the_fast_accumulation_recipes_are_their_bases_plus_the_field():
    """Only the accumulation differs: the same TE class, formats and scales, TE-only."""
    for name, base in (
        ("tensorwise_fastacc", "tensorwise"),
        ("tensorwise_fp8head_fastacc", "tensorwise_fp8head"),
        ("tensorwise_fp8attn_fastacc", "tensorwise_fp8attn"),
    ):
        spec, base_spec = recipes.get(name), recipes.get(base)
        assert spec.te_recipe_class == "Float8CurrentScaling" and spec.te_only
        assert spec.megatron == base_spec.megatron and spec.min_cc == base_spec.min_cc
        assert spec.defaults == {**base_spec.defaults, "fp8_fast_accumulation": "all"}
        assert base_spec.default_fields().fp8_fast_accumulation == "fprop"
