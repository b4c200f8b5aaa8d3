"""Runs with TE 2.20's backward_override and MXFP8 2D weights train on the CPU (emulated backend), and
run.json holds the resolved recipe and each option's verification status (recipes.verification)."""

from __future__ import annotations

import json

import pytest

from harness import recipes
from harness.train import run
from tests.helpers import TINY, compose_cfg

SHORT = [
    *TINY,
    "steps=2",
    "eval_interval=0",
    "log_interval=1",
    "backend=emulated",
    "hardware=cpu",
    "data.num_tokens=20000",
]
CASES = {
    "tensorwise_high_precision": (["recipe=tensorwise", "recipe.backward_override=high_precision"], "H200"),
    "blockwise_dequantized": (["recipe=blockwise", "recipe.backward_override=dequantized"], "H200"),
    "mxfp8_2d_dequantized": (
        ["recipe=mxfp8", "recipe.enable_2d_quantization=true", "recipe.backward_override=dequantized"],
        recipes.KERNEL_UNVERIFIED,
    ),
    "nvfp4_high_precision": (
        ["recipe=nvfp4", "recipe.backward_override=high_precision"],
        recipes.KERNEL_UNVERIFIED,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_option_trains_and_run_json_says_what_it_ran(name, tmp_path):
    overrides, status = CASES[name]
    summary = run(compose_cfg(*SHORT, *overrides), tmp_path)
    assert summary.status == "completed", summary.error
    info = json.loads((tmp_path / "run.json").read_text())
    recipe = info["config"]["recipe"]
    for ov in overrides[1:]:
        key, value = ov.removeprefix("recipe.").split("=")
        assert str(recipe[key]).lower() == value
    checks = info["provenance"]["verification"]
    assert checks and all((status in v) for v in checks.values()), checks
    numerics = info["provenance"]["numerics"]
    if "backward_override" in " ".join(overrides):
        assert all("backward=" in rep for rep in numerics.values())
    if "enable_2d_quantization=true" in overrides:
        assert all("weight=MXFP8(E4M3, 32x32" in rep for rep in numerics.values())


def test_a_module_override_with_backward_override(tmp_path):
    ov = "+stability.overrides=[{pattern:'*.fc2',recipe:tensorwise,fields:{backward_override:dequantized}}]"
    summary = run(compose_cfg(*SHORT, "recipe=blockwise", ov), tmp_path)
    assert summary.status == "completed", summary.error
    info = json.loads((tmp_path / "run.json").read_text())
    numerics = info["provenance"]["numerics"]
    assert all(("backward=dequantized" in rep) == name.endswith("fc2") for name, rep in numerics.items())
    assert list(info["provenance"]["verification"]) == ["*.fc2: recipe.backward_override=dequantized"]
