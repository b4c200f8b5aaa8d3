"""backend.moe_experts: the choice of kernels for BF16 expert groups on backend=te (CPU checks; the kernels
themselves are checked on the H200 by tests/test_moe_te_gpu.py)."""

from __future__ import annotations

import pytest

from harness.backends import grouped_gemm
from harness.backends.te_moe import AUTO_GROUPED_MIN_EXPERTS, expert_kernels, resolve
from harness.config.errors import ConfigError
from harness.config.schema import RecipeConfig
from harness.training.trainer import expert_kernels_of, variant
from harness.validation.load import compose_config, prepare
from tests.helpers import compose_cfg, in_triton_interpreter


def test_a_quantized_expert_group_stays_on_te_grouped_linear():
    assert expert_kernels("grouped", None) == "grouped"
    assert expert_kernels("grouped", RecipeConfig(name="blockwise")) == "te"
    assert expert_kernels("te", None) == "te"


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (["backend=emulated", "backend.moe_experts=grouped"], "use backend=te or backend.moe_exp"),
        (["backend.moe_experts=cutlass"], r"choose one of \['te', 'grouped', 'auto'\]"),
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


def test_auto_picks_grouped_from_128_experts_where_the_kernels_run():
    assert AUTO_GROUPED_MIN_EXPERTS == 128
    assert [resolve("auto", e, available=True) for e in (None, 8, 64, 127, 128, 256)] == [
        "te", "te", "te", "te", "grouped", "grouped"
    ]  # fmt: skip
    assert resolve("auto", 256, available=False) == "te"  # no triton or no CUDA: TE's GroupedLinear
    assert resolve("te", 256, available=True) == "te" and resolve("grouped", 8, available=False) == "grouped"


def test_the_variant_names_grouped_kernels_only_where_a_bf16_expert_group_runs_on_them(monkeypatch):
    monkeypatch.setattr(grouped_gemm, "available", lambda: True)  # as on a GPU with triton
    qwen = ["experiment=h200_qwen3_30b_a3b_slice"]  # 128 experts, backend=te
    assert compose_cfg(*qwen).backend.moe_experts == "auto"  # the presets' choice
    assert expert_kernels_of(compose_cfg(*qwen)) == "grouped"
    assert variant(compose_cfg(*qwen)).endswith("+grouped_experts")
    assert expert_kernels_of(compose_cfg(*qwen, "recipe=tensorwise")) == "te"  # every group quantizes
    assert (
        expert_kernels_of(compose_cfg(*qwen, "recipe=tensorwise", "stability=first_last_bf16")) == "grouped"
    )
    assert expert_kernels_of(compose_cfg(*qwen, "backend.moe_experts=te")) == "te"
    assert expert_kernels_of(compose_cfg("experiment=h200_mixtral_8x7b_slice")) == "te"  # 8 experts
    assert expert_kernels_of(compose_cfg("model=gpt_tiny", "backend=te")) == "te"  # dense
    monkeypatch.setattr(grouped_gemm, "available", lambda: False)
    assert expert_kernels_of(compose_cfg(*qwen)) == "te"


def test_auto_on_the_emulated_backend_is_no_error():
    prepare(
        compose_config(["model=qwen3_moe_tiny", "hardware=cpu", "logger=none", "backend.moe_experts=auto"])
    )


def test_megatron_export_notes_what_auto_picks():
    from harness.interop.megatron import megatron_args

    _, notes = megatron_args(compose_cfg("experiment=h200_qwen3_30b_a3b_slice"))
    assert [n for n in notes if "backend.moe_experts=auto (auto: this model's experts" in n]
    _, coarse = megatron_args(compose_cfg("experiment=h200_mixtral_8x7b_slice"))
    assert not [n for n in coarse if "moe_experts" in n]


def test_a_run_stored_with_te_resumes_under_auto_where_auto_picks_te(monkeypatch):
    """The presets' `auto` is compared by what it runs: a dense or coarse-expert run checkpointed with
    `te` resumes; where auto would switch a run's BF16 experts to the grouped kernels it is refused."""
    from dataclasses import asdict

    from harness.lifecycle.resume import config_diff

    def dicts(*over):
        saved, requested = (asdict(compose_cfg(*over, f"backend.moe_experts={k}")) for k in ("te", "auto"))
        return saved, requested

    monkeypatch.setattr(grouped_gemm, "available", lambda: True)
    assert config_diff(*dicts("model=gpt_tiny")) == []
    assert config_diff(*dicts("experiment=h200_mixtral_8x7b_slice")) == []
    assert config_diff(*dicts("experiment=h200_qwen3_30b_a3b_slice")) == ["backend.moe_experts"]
    monkeypatch.setattr(grouped_gemm, "available", lambda: False)
    assert config_diff(*dicts("experiment=h200_qwen3_30b_a3b_slice")) == []
