"""Megatron export of MoE models: each MoE preset prints Megatron-LM's MoE flags with lowp's values, the
options print where set, what Megatron cannot take is one `error:` line, and the reference sweep (the
configs `benchmarks.megatron_lm check` feeds to Megatron-LM) holds every MoE preset x recipe."""

from __future__ import annotations

import shlex
import warnings

import pytest

from harness.interop.megatron import megatron_args, render
from harness.megatron import main
from harness.validation import reference_sweep as sweep
from tests.helpers import compose_cfg, run_main
from tests.test_megatron import pairs

# What each MoE preset's YAML says, as Megatron-LM reads it (docs/moe.md, conf/model/*.yaml).
PRESET_FLAGS = {
    "qwen3_moe_tiny": {
        "--num-experts": "8",
        "--moe-ffn-hidden-size": "32",
        "--moe-router-topk": "2",
        "--moe-grouped-gemm": None,
        "--moe-token-dispatcher-type": "alltoall",
        "--moe-router-score-function": "softmax",
        "--moe-router-load-balancing-type": "aux_loss",
        "--moe-aux-loss-coeff": "0.001",
        "--moe-router-dtype": "fp32",
    },
    "mixtral_tiny": {
        "--num-experts": "4",
        "--moe-ffn-hidden-size": "128",  # null: the experts are ffn_hidden_size wide
        "--moe-router-topk": "2",
        "--moe-grouped-gemm": None,
        "--moe-token-dispatcher-type": "alltoall",
        "--moe-router-score-function": "softmax",
        "--moe-router-load-balancing-type": "aux_loss",
        "--moe-aux-loss-coeff": "0.02",
    },
}
OPTIONS = {  # printed only where set
    "--moe-router-pre-softmax",
    "--moe-router-topk-scaling-factor",
    "--moe-z-loss-coeff",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "--moe-shared-expert-intermediate-size",
    "--moe-shared-expert-gate",
    "--moe-layer-freq",
    "--moe-router-dtype",
    "--moe-expert-capacity-factor",
    "--moe-router-padding-for-quantization",
}


def moe_part(argv: list[str]) -> dict[str, str | None]:
    return {k: v for k, v in pairs(argv).items() if k.startswith(("--moe-", "--num-experts"))}


def test_every_moe_preset_exports_its_shape():
    """Every MoE model preset (later slices too): the experts' shape and router as composed."""
    for preset in sweep.moe_presets():
        m = compose_cfg(f"model={preset}").model
        got = moe_part(megatron_args(compose_cfg(f"model={preset}"))[0])
        assert got["--num-experts"] == str(m.num_moe_experts), preset
        assert got["--moe-ffn-hidden-size"] == str(m.moe_ffn_hidden_size or m.ffn_hidden_size), preset
        assert got["--moe-router-topk"] == str(m.moe_router_topk), preset
        assert got["--moe-aux-loss-coeff"] == repr(float(m.moe_aux_loss_coeff)), preset
        assert got.get("--moe-router-dtype") == m.moe_router_dtype, preset
        assert "--moe-grouped-gemm" in got and got["--moe-token-dispatcher-type"] == "alltoall", preset


def test_the_tiny_moe_presets_are_in_the_sweep():
    assert set(PRESET_FLAGS) <= set(sweep.moe_presets())


@pytest.mark.parametrize("preset", sorted(PRESET_FLAGS))
@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_moe_preset_exports_megatrons_moe_flags(preset, recipe):
    argv, notes = megatron_args(compose_cfg(f"model={preset}", f"recipe={recipe}"))
    assert moe_part(argv) == PRESET_FLAGS[preset]
    assert not any("moe" in n.lower() or "expert" in n.lower() for n in notes), notes


def test_dense_model_prints_no_moe_flag():
    argv, _ = megatron_args(compose_cfg("model=qwen3_tiny"))
    assert moe_part(argv) == {}


def test_every_moe_option_prints_its_flag_and_value():
    cfg = compose_cfg(
        "model=qwen3_moe_tiny",
        "recipe=mxfp8",
        "model.moe_router_score_function=sigmoid",
        "model.moe_router_pre_softmax=true",
        "model.moe_router_topk_scaling_factor=2.5",
        "model.moe_router_enable_expert_bias=true",
        "model.moe_router_bias_update_rate=0.01",
        "model.moe_router_load_balancing_type=seq_aux_loss",
        "model.moe_aux_loss_coeff=1e-4",
        "model.moe_z_loss_coeff=1e-3",
        "model.moe_shared_expert_intermediate_size=64",
        "model.moe_shared_expert_gate=true",
        "model.moe_layer_freq=[0,1]",
        "model.moe_router_dtype=fp64",
        "model.moe_expert_capacity_factor=1.25",
        "model.moe_router_padding_for_quantization=true",
    )
    got = moe_part(megatron_args(cfg)[0])
    assert OPTIONS <= set(got)
    assert got == {
        **PRESET_FLAGS["qwen3_moe_tiny"],
        "--moe-router-score-function": "sigmoid",
        "--moe-router-load-balancing-type": "seq_aux_loss",
        "--moe-aux-loss-coeff": "0.0001",
        "--moe-router-pre-softmax": None,
        "--moe-router-topk-scaling-factor": "2.5",
        "--moe-router-enable-expert-bias": None,
        "--moe-router-bias-update-rate": "0.01",
        "--moe-z-loss-coeff": "0.001",
        "--moe-shared-expert-intermediate-size": "64",
        "--moe-shared-expert-gate": None,
        "--moe-layer-freq": "[0,1]",  # Megatron's moe_freq_type: digits, commas, brackets
        "--moe-router-dtype": "fp64",
        "--moe-expert-capacity-factor": "1.25",
        "--moe-router-padding-for-quantization": None,
    }
    # the shell line quotes the pattern, and the shell gives Megatron the list back
    line = render(cfg, "sh")
    assert "--moe-layer-freq '[0,1]'" in line
    assert shlex.split(line.splitlines()[-1].rstrip(" \\"))  # one runnable line after the comments


def test_integer_layer_freq_and_default_bias_rate():
    cfg = compose_cfg(
        "model=mixtral_tiny",
        "model.moe_layer_freq=2",
        "model.moe_router_score_function=sigmoid",
        "model.moe_router_enable_expert_bias=true",
    )
    got = moe_part(megatron_args(cfg)[0])
    assert got["--moe-layer-freq"] == "2"
    assert "--moe-router-enable-expert-bias" in got and "--moe-router-bias-update-rate" not in got


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["model.add_bias_linear=true"],
            ["model.add_bias_linear=true", "no biases", "set model.add_bias_linear=false"],
        ),
        (
            ["hardware=h100", "hardware.compute_capability=7.5"],
            ["model.num_moe_experts=4 with hardware=h100", "--moe-grouped-gemm", ">= 8.0"],
        ),
        (
            ["model.moe_router_padding_for_quantization=true"],
            ["model.moe_router_padding_for_quantization=true with recipe=bf16", "FP8/FP4"],
        ),
        (["model.moe_router_enable_expert_bias=true"], ["needs model.moe_router_score_function=sigmoid"]),
        (["model.moe_router_topk=1"], ["model.moe_router_pre_softmax=true"]),
    ],
    ids=["biases", "capability_7_5", "padding_under_bf16", "expert_bias_softmax", "top1_softmax"],
)
def test_export_refusals_are_one_line_naming_the_option(capsys, overrides, words):
    code, err = run_main(capsys, main, "harness.megatron", "model=mixtral_tiny", *overrides)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_export_prints_an_moe_model(capsys):
    assert main(["model=qwen3_moe_tiny", "recipe=blockwise", "--format", "args"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "--num-experts 8" in out and "--moe-grouped-gemm" in out


def test_reference_sweep_holds_every_moe_preset_x_recipe():
    """Each MoE preset under each recipe is accepted as shipped (so the Megatron check holds its
    export), and the MoE knobs give both verdicts."""
    got = list(sweep.moe_cases())
    assert len(got) == len(sweep.moe_presets()) * len(sweep.recipes()) * len(sweep.MOE_KNOBS)
    labels = {label for label, _ in got}
    for preset in sweep.moe_presets():
        for recipe in sweep.recipes():
            assert sweep.moe_label(preset, recipe, "none") in labels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdicts = {
            label: sweep.verdict(cfg) for label, cfg in got if "knob=none" in label or "padding" in label
        }
    plain = {label: v for label, v in verdicts.items() if "knob=none" in label}
    assert all(v is None for v in plain.values()), {k: v for k, v in plain.items() if v}
    padded = {
        label.split(" ")[1]: v for label, v in verdicts.items() if label.endswith("knob=router_padding")
    }
    assert padded["recipe=bf16"] and padded["recipe=int4_qat"]  # Megatron refuses both too
    assert padded["recipe=tensorwise"] is None and padded["recipe=nvfp4"] is None


def test_router_padding_says_where_megatrons_alignment_differs():
    """Megatron aligns every FP4 recipe to 128 tokens; lowp's custom recipe to 16, and the router's
    padding tokens reach the quantizers: a `#` line says so; the shipped recipes agree."""
    pad = ("model=qwen3_moe_tiny", "model.moe_router_padding_for_quantization=true")
    factory = f"recipe.quantizer_factory={sweep.EXAMPLE_FACTORY}"
    cfg = compose_cfg(*pad, "recipe=custom", factory, "recipe.fp8=null", "recipe.fp4=e2m1")
    notes = " ".join(megatron_args(cfg)[1])
    assert "Megatron aligns each expert's tokens to 128" in notes and "lowp to 16" in notes
    for recipe in ("delayed", "mxfp8", "nvfp4"):
        assert not any(
            "aligns each expert" in n for n in megatron_args(compose_cfg(*pad, f"recipe={recipe}"))[1]
        )
