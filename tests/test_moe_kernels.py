"""backend.moe_experts: the choice of kernels for BF16 expert groups on backend=te (CPU checks; the kernels
themselves are checked on the H200 by tests/test_moe_te_gpu.py)."""

from __future__ import annotations

import pytest

from harness.backends.te_moe import expert_kernels
from harness.config.errors import ConfigError
from harness.config.schema import RecipeConfig
from harness.validation.load import compose_config, prepare
from tests.helpers import in_triton_interpreter


def test_a_quantized_expert_group_stays_on_te_grouped_linear():
    assert expert_kernels("grouped", None) == "grouped"
    assert expert_kernels("grouped", RecipeConfig(name="blockwise")) == "te"
    assert expert_kernels("te", None) == "te"


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (["backend=emulated", "backend.moe_experts=grouped"], "use backend=te or backend.moe_exp"),
        (["backend.moe_experts=cutlass"], r"choose one of \['te', 'grouped'\]"),
    ],
)
def test_bad_expert_kernels_are_named_with_the_fix(over, message):
    with pytest.raises(ConfigError, match=message) as exc:
        prepare(compose_config(["model=qwen3_moe_tiny", "hardware=cpu", "logger=none", *over]))
    assert "\n" not in str(exc.value)


def _grouped_wgrad_sums_each_experts_rows() -> None:
    import torch

    from harness.backends import grouped_gemm

    g = torch.Generator().manual_seed(0)
    for counts, m, n in (([0, 37, 5, 100], 96, 80), ([3, 0, 17], 40, 24)):
        dy = torch.randn(sum(counts), m, generator=g).to(torch.bfloat16)
        x = torch.randn(sum(counts), n, generator=g).to(torch.bfloat16)
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        rows = torch.tensor(counts).cumsum(0).tolist()
        want = torch.stack([dy[e - c : e].double().t() @ x[e - c : e].double() for c, e in zip(counts, rows)])
        got = grouped_gemm.grouped_wgrad(dy, x, ends)
        assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-5, "fresh"
        assert all(torch.count_nonzero(got[i]) == 0 for i, c in enumerate(counts) if c == 0), "empty"
        main = torch.randn(len(counts), m, n, generator=g)
        summed = grouped_gemm.grouped_wgrad(dy, x, ends, out=main.clone())
        assert (summed.double() - main.double() - want).abs().max() < 1e-5, "added into the main grad"


@pytest.mark.slow  # a fresh Python, for TRITON_INTERPRET=1
def test_grouped_wgrad_kernel_in_tritons_interpreter():
    """The grouped wgrad kernel sums each expert's rows (unaligned counts, experts without rows) in fp32,
    fresh and added into a main grad, through Triton's CPU interpreter (skips without triton; the
    compiled kernel is checked against TE's GroupedLinear on CUDA in test_moe_te_gpu.py)."""
    in_triton_interpreter(
        "from tests.test_moe_kernels import _grouped_wgrad_sums_each_experts_rows as f; f()"
    )


def test_megatron_export_notes_the_grouped_expert_kernels():
    """backend.moe_experts=grouped is no Megatron flag: the export prints the same --moe-grouped-gemm and a
    `#` line saying lowp's expert kernels differ from Megatron's (TE's GroupedLinear)."""
    from harness.interop.megatron import megatron_args
    from tests.helpers import compose_cfg

    argv, notes = megatron_args(compose_cfg("model=qwen3_moe_tiny", "backend.moe_experts=grouped"))
    assert "--moe-grouped-gemm" in argv
    assert [n for n in notes if "backend.moe_experts=grouped" in n and "GroupedLinear" in n]
    _, plain = megatron_args(compose_cfg("model=qwen3_moe_tiny"))
    assert not [n for n in plain if "moe_experts" in n]
