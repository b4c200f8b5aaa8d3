"""The TE recipe object lowp builds, on a CPU: a stand-in for transformer_engine.common.recipe whose
recipe classes have no defaults, so every field the builder leaves to TE fails here. Real TE builds the
same configs in tests/test_megatron_gpu.py (its recipe classes' own asserts)."""

from __future__ import annotations

import dataclasses
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
    ("fields", "split"),
    [
        ({}, (False, True, True)),  # TE's default: fast accumulation in fprop only
        ({"fp8_fast_accumulation": "all"}, (False, False, False)),
        ({"fp8_fast_accumulation": "all", "fp8_dpa": True}, (False, False, False)),
    ],
)
def test_fast_accumulation_sets_float8_current_scalings_gemm_params(stand_in_te, fields, split):
    r = dataclasses.replace(recipes.default_fields("tensorwise"), **fields)
    rec = build_te_recipe(r, StabilityConfig())
    assert isinstance(rec, _Float8CurrentScaling)
    assert _split(rec) == split
    assert rec.fp8_format is _Format.HYBRID and rec.fp8_quant_bwd_grad == _QParams(False, 0.0)
