"""Megatron export: each cookbook preset prints exactly the guide's flags, plus shape and non-defaults."""

from __future__ import annotations

import pytest

from harness.megatron import MEGATRON_DEFAULTS, SHAPE_FLAGS, megatron_args, render
from tests.helpers import compose_cfg, run_cli

# The guide's Configuration Cookbook (Megatron Core Low-Precision Training Guide), verbatim.
COOKBOOK = {
    "hopper_fp8": "--bf16 --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather --use-distributed-optimizer",  # noqa: E501
    "blackwell_fp8": "--bf16 --fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather "
    "--reuse-grad-buf-for-mxfp8-param-ag --use-distributed-optimizer",
    "blackwell_fp4": "--bf16 --fp4-format e2m1 --fp4-param-gather --first-last-layers-bf16 "
    "--num-layers-at-start-in-bf16 2 --num-layers-at-end-in-bf16 2 --use-distributed-optimizer",
    "fp8_cpu_offload": "--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather "
    "--use-distributed-optimizer --optimizer-cpu-offload",
    "min_memory_optimizer": "--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype fp8 "
    "--exp-avg-sq-dtype fp8",
}
TRAINING = {
    "--lr",
    "--min-lr",
    "--weight-decay",
    "--adam-beta1",
    "--adam-beta2",
    "--adam-eps",
    "--clip-grad",
    "--lr-warmup-iters",
    "--lr-decay-style",
    "--seed",
    "--micro-batch-size",
    "--global-batch-size",
    "--train-iters",
}


def pairs(argv: list[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(argv):
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        out[argv[i]] = argv[i + 1] if has_value else None
        i += 2 if has_value else 1
    return out


@pytest.mark.parametrize("preset", sorted(COOKBOOK))
def test_cookbook_flags_match_the_guide(preset):
    argv, _ = megatron_args(compose_cfg(f"experiment={preset}", "model=gpt_1b"))
    got, want = pairs(argv), pairs(COOKBOOK[preset].split())
    for flag, value in want.items():
        assert flag in got and got[flag] == value, (flag, got.get(flag))
    extra = set(got) - set(want)
    history = {"--fp8-amax-history-len", "--fp8-amax-compute-algo"}
    allowed = set(SHAPE_FLAGS) | TRAINING | (history if preset == "fp8_cpu_offload" else set())
    if preset == "min_memory_optimizer":
        allowed |= {"--bf16"}
    assert extra <= allowed, extra - allowed
    for flag in extra & set(MEGATRON_DEFAULTS):  # printed only where lowp differs from Megatron
        assert got[flag] != str(MEGATRON_DEFAULTS[flag]), flag


def test_delayed_always_prints_history_flags():
    got = pairs(megatron_args(compose_cfg("recipe=delayed"))[0])
    assert got["--fp8-amax-history-len"] == "1024" and got["--fp8-amax-compute-algo"] == "max"


def test_no_fp8_wgrad_prints_flag_and_warning():
    argv, notes = megatron_args(compose_cfg("recipe=tensorwise", "stability.fp8_wgrad=false"))
    assert "--no-fp8-wgrad" in argv
    assert any("silently ignores --no-fp8-wgrad" in n for n in notes)


def test_model_shape_flags():
    got = pairs(
        megatron_args(
            compose_cfg(
                "model=gpt_8b_slice",
                "model.activation=swiglu",
                "model.position_embedding=rope",
                "model.normalization=RMSNorm",
            )
        )[0]
    )
    assert (got["--num-layers"], got["--hidden-size"], got["--ffn-hidden-size"], got["--seq-length"]) == (
        "6",
        "4096",
        "16384",
        "4096",
    )
    assert (
        "--swiglu" in got
        and got["--position-embedding-type"] == "rope"
        and got["--normalization"] == "RMSNorm"
    )
    assert "--untie-embeddings-and-output-weights" in got


def test_what_megatron_cannot_express_is_a_comment():
    text = render(
        compose_cfg("recipe=int4_qat", "+stability.overrides=[{pattern: 'blocks.0.*', recipe: bf16}]")
    )
    assert "# INT4 fake-QAT" in text and "OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1" in text
    assert "--te-precision-config-file" in text
    text = render(compose_cfg("recipe=blockwise", "recipe.power_2_scales=false"))
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in text


def test_cli_prints_flags_and_refuses_illegal_configs():
    res = run_cli(["-m", "harness.megatron", "experiment=hopper_fp8"])
    assert res.returncode == 0 and "--fp8-recipe tensorwise" in res.stdout
    res = run_cli(["-m", "harness.megatron", "experiment=fp8_cpu_offload", "recipe=tensorwise"])
    assert res.returncode == 2 and res.stderr.strip().startswith("error: optimizer.optimizer_cpu_offload")


def test_lm_head_loss_chunks_is_a_note_not_a_flag():
    argv, notes = megatron_args(compose_cfg("model=gpt_tiny", "model.lm_head_loss_chunks=8"))
    assert not any("chunk" in a for a in argv)
    assert any("lm_head_loss_chunks=8" in n and n.startswith("#") for n in notes)
