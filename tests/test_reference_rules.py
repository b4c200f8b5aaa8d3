"""The Megatron-LM / TE rules lowp mirrors (harness/validation/megatron_rules.py): one test per rule,
the messages the issue names, the shipped presets, and the rule table in docs/validation_rules.md."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from harness.config.store import presets
from harness.validation.megatron_rules import RULES
from harness.validation.reference_sweep import EXAMPLE_FACTORY
from harness.validation.rules import ConfigError, validate
from tests.helpers import compose_cfg

DOC = Path(__file__).resolve().parents[1] / "docs" / "validation_rules.md"


def refusal(*overrides: str) -> str | None:
    """lowp's export-time verdict: None if accepted, else the one-line message."""
    cfg = compose_cfg(*overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate(cfg, for_export=True)
        except ConfigError as exc:
            assert "\n" not in str(exc)
            return str(exc)
    return None


# (overrides that break the rule, the fix that makes them pass, words the message must hold)
CASES = {
    "cpu_offload_needs_precision_aware": (
        ["recipe=delayed", "optimizer.optimizer_cpu_offload=true"],
        ["optimizer.use_precision_aware_optimizer=true", "optimizer.use_distributed_optimizer=true"],
        ["optimizer.use_precision_aware_optimizer=true", "Megatron refuses --optimizer-cpu-offload"],
    ),
    "cpu_offload_fp8_param_needs_delayed": (
        [
            "recipe=custom",
            f"recipe.quantizer_factory={EXAMPLE_FACTORY}",
            "optimizer.optimizer_cpu_offload=true",
            "optimizer.use_precision_aware_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
            "optimizer.fp8_param=true",
        ],
        ["optimizer.fp8_param=false"],
        ["recipe=custom", "unless --fp8-recipe delayed"],
    ),
    "precision_aware_needs_distributed": (
        ["optimizer.use_precision_aware_optimizer=true"],
        ["optimizer.use_distributed_optimizer=true"],
        ["optimizer.use_distributed_optimizer=true", "one GPU too"],
    ),
    "fp8_param_needs_distributed": (
        ["recipe=tensorwise", "optimizer.fp8_param=true"],
        ["optimizer.use_distributed_optimizer=true"],
        ["optimizer.fp8_param=true", "any world size"],
    ),
    "reuse_grad_buf_needs_fp8_param": (
        ["recipe=mxfp8", "optimizer.reuse_grad_buf_for_mxfp8_param_ag=true"],
        ["optimizer.fp8_param=true", "optimizer.use_distributed_optimizer=true"],
        ["optimizer.fp8_param=true", "MXFP8 params"],
    ),
    "min_lr_at_most_lr": (
        ["optimizer.lr=0.001", "optimizer.min_lr=0.002"],
        ["optimizer.min_lr=0.001"],
        ["optimizer.min_lr=0.002 exceeds optimizer.lr=0.001", "min_lr <= lr"],
    ),
    "activation_func_fp8_input_store_needs_swiglu": (
        ["optimizer.activation_func_fp8_input_store=true"],
        ["model.activation=swiglu"],
        ["model.activation=gelu", "only for SwiGLU"],
    ),
    "blockwise_no_2d_by_2d": (
        ["recipe=blockwise", "recipe.x_block_dim=2"],
        ["recipe.w_block_dim=1"],
        ["recipe.x_block_dim=2 with recipe.w_block_dim=2", "2D by 2D", "fprop"],
    ),
}


def test_every_rule_has_a_case():
    assert {r.name for r in RULES} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_refuses_and_its_fix_passes(name):
    broken, fix, words = CASES[name]
    msg = refusal(*broken)
    assert msg is not None, f"{name}: lowp accepted {broken}"
    for w in words:
        assert w in msg, (w, msg)
    assert refusal(*broken, *fix) is None


def test_fp8_param_needs_the_distributed_optimizer_on_one_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")  # the old rule only looked when WORLD_SIZE > 1
    assert "optimizer.use_distributed_optimizer=true" in refusal(
        "recipe=tensorwise", "optimizer.fp8_param=true"
    )


@pytest.mark.parametrize(
    "dims",
    [
        ("x_block_dim=2", "w_block_dim=2"),
        ("grad_block_dim=2", "w_block_dim=2"),
        ("x_block_dim=2", "grad_block_dim=2"),
    ],
)
def test_blockwise_refuses_every_2d_pair_te_refuses(dims):
    extra = [] if "w_block_dim=2" in dims else ["recipe.w_block_dim=1"]
    assert "2D by 2D" in refusal("recipe=blockwise", *extra, *(f"recipe.{d}" for d in dims))


def test_block_dims_only_bind_blockwise():
    assert refusal("recipe=tensorwise", "recipe.x_block_dim=2") is None


def test_negative_bf16_layer_count_says_so():
    msg = refusal(
        "recipe=tensorwise", "stability=first_last_bf16", "stability.num_layers_at_start_in_bf16=-1"
    )
    assert msg.startswith("stability.num_layers_at_start_in_bf16=-1: a layer count, must be >= 0")
    assert "exceeds" not in msg


def test_bf16_layer_sum_says_what_megatron_would_do():
    msg = refusal("recipe=tensorwise", "stability=first_last_bf16", "stability.num_layers_at_start_in_bf16=4")
    assert "exceeds model.num_layers=4" in msg and "keep every block BF16" in msg


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["recipe=tensorwise", "recipe.fp8=null"], "silently trains BF16"),
        (
            ["recipe=tensorwise", "optimizer.optimizer_cpu_offload=true"],
            "refuses it only with --fp8-param-gather",
        ),
        (["recipe=mxfp8", "backend=te", "hardware=h100"], "Megatron accepts the flags and TE stops"),
        (["recipe=delayed", "backend=te", "hardware=h100", "stability.fp8_wgrad=false"], "silently keep"),
    ],
)
def test_stricter_than_megatron_says_what_megatron_would_do(overrides, words):
    msg = refusal(*overrides)
    assert msg is not None and words in msg, msg


@pytest.mark.parametrize("preset", presets("experiment"))
def test_shipped_presets_pass_the_reference_rules(preset):
    assert refusal(f"experiment={preset}") is None


@pytest.mark.parametrize("optimizer", presets("optimizer"))
def test_shipped_optimizer_presets_pass_the_reference_rules(optimizer):
    assert refusal(f"optimizer={optimizer}") is None


def test_rule_table_lists_every_rule_with_its_source():
    text = DOC.read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9_]+)` \|.*$", text, flags=re.M)}
    for rule in RULES:
        assert rule.name in rows, f"docs/validation_rules.md has no row for {rule.name}"
        path, _, lines = rule.source.split()[1].partition(":")
        assert path in rows[rule.name] and lines in rows[rule.name], (rule.name, rows[rule.name])
