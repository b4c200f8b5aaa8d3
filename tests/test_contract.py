"""The artifact contract is written twice on purpose (analysis never imports the harness): the two
copies must stay the same strings, so a rename on one side fails here instead of in a report."""

from __future__ import annotations

import dataclasses

from analysis import keys as A
from harness.lifecycle import metrics as M
from harness.lifecycle.artifacts import Summary


def test_metric_keys_agree():
    assert M.ALL_KEYS == A.METRIC_KEYS
    assert (M.STEP, M.TOKENS) == (A.STEP, A.TOKENS)
    assert A.NUMERICS_PREFIX == M.NUMERICS + "/"


def test_summary_fields_agree():
    assert tuple(f.name for f in dataclasses.fields(Summary)) == A.SUMMARY_FIELDS


def test_statuses_the_harness_writes_are_known_to_analysis():
    from harness.lifecycle import artifacts

    assert artifacts.STATUSES == (A.COMPLETED, A.DIVERGED, A.FAILED, A.PREEMPTED)
    assert A.INCOMPLETE not in artifacts.STATUSES  # analysis's own name, never written
    assert Summary().status == artifacts.FAILED  # a summary written before the end says failed


def test_telemetry_columns_agree():
    from harness.numerics import telemetry

    assert (telemetry.LAYER, telemetry.TENSOR) == (A.TELEMETRY_LAYER, A.TELEMETRY_TENSOR)
    assert telemetry.TENSORS == A.TELEMETRY_TENSORS
    assert telemetry.STATS == A.TELEMETRY_STATS
    assert (telemetry.CANDIDATE, telemetry.SCALE_SPREAD, telemetry.REL_ERR, telemetry.GEMMS) == (
        A.TELEMETRY_CANDIDATE,
        A.TELEMETRY_SCALE_SPREAD,
        A.TELEMETRY_REL_ERR,
        A.TELEMETRY_GEMMS,
    )


def test_telemetry_rows_have_the_contract_columns():
    import torch

    from harness.numerics import quantize, telemetry

    x = torch.randn(128, 128)
    row = telemetry.tensor_row("blocks.0.attn.qkv", "input", x, quantize(x, "tensorwise", role="input"))
    assert tuple(row) == (A.TELEMETRY_LAYER, A.TELEMETRY_TENSOR, *A.TELEMETRY_STATS)


def test_the_names_analysis_keeps_of_the_harness_agree():
    from harness import recipes
    from harness.backends.emulated import EmulatedBackend
    from harness.backends.te import TEBackend
    from harness.config.schema import OptimizerConfig, StabilityConfig

    assert A.BASELINE_RECIPE == recipes.BASELINE and A.BASELINE_RECIPE in recipes.names()
    assert (A.NATIVE_BACKEND, A.EMULATED_BACKEND) == (TEBackend.name, EmulatedBackend.name)
    assert A.DEFAULT_VARIANT == f"{StabilityConfig().name}+{OptimizerConfig().name}"


def test_legacy_recipe_names_map_to_the_same_family_and_label():
    from harness import recipes

    assert set(recipes.LEGACY) == set(A.LEGACY_RECIPES)
    for name, (family, label) in A.LEGACY_RECIPES.items():
        assert (recipes.LEGACY[name].family, recipes.LEGACY[name].label) == (family, label), name
