"""backend.moe_experts: the choice of kernels for BF16 expert groups on backend=te (CPU checks; the kernels
themselves are checked on the H200 by tests/test_moe_te_gpu.py)."""

from __future__ import annotations

import pytest

from harness.backends.te_moe import expert_kernels
from harness.config.errors import ConfigError
from harness.config.schema import RecipeConfig
from harness.validation.load import compose_config, prepare


def test_a_quantized_expert_group_stays_on_te_grouped_linear():
    assert expert_kernels("torch_grouped", None) == "torch_grouped"
    assert expert_kernels("torch_grouped", RecipeConfig(name="blockwise")) == "te"
    assert expert_kernels("te", None) == "te"


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (["backend=emulated", "backend.moe_experts=torch_grouped"], "use backend=te or backend.moe_exp"),
        (["backend.moe_experts=cutlass"], r"choose one of \['te', 'torch_grouped'\]"),
    ],
)
def test_bad_expert_kernels_are_named_with_the_fix(over, message):
    with pytest.raises(ConfigError, match=message) as exc:
        prepare(compose_config(["model=qwen3_moe_tiny", "hardware=cpu", "logger=none", *over]))
    assert "\n" not in str(exc.value)
