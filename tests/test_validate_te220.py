"""TE 2.20's recipe fields refused as TE 2.20.2 refuses them, one `error:` line each (exit 2 at the
entry point), on the run's recipe and in stability overrides; their NVTE_* variables under the
set-from-config, refuse-if-different rule; backend=auto and TE's LayerNormMLP."""

from __future__ import annotations

import pytest

from harness import recipes
from harness.backends import te_env
from harness.backends.capability import te_blocker
from harness.config.errors import ConfigError
from harness.validation.load import load
from tests.helpers import run_main

CPU = ["model=gpt_tiny", "hardware=cpu", "backend=emulated"]


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load([*CPU, *overrides], for_export=True)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["recipe=delayed", "recipe.backward_override=high_precision"],
            "only supports backward_override=None",
        ),
        (
            ["recipe=bf16", "recipe.backward_override=dequantized"],
            "recipe.backward_override=dequantized with recipe=bf16",
        ),
        (
            ["recipe=int4_qat", "recipe.backward_override=dequantized"],
            "TE 2.20 has backward_override only on",
        ),
        (["recipe=tensorwise", "recipe.row_scaled_activation=true"], "row_scaled_activation only on nvfp4"),
        (["recipe=mxfp8", "recipe.nvfp4_4over6=weights"], "recipe.nvfp4_4over6=weights with recipe=mxfp8"),
        (["recipe=blockwise", "recipe.nvfp4_4over6_err_mode=MSE"], "nvfp4_4over6_err_mode only on nvfp4"),
        (["recipe=nvfp4", "recipe.enable_2d_quantization=true"], "enable_2d_quantization only on mxfp8"),
        (["recipe=tensorwise", "recipe.backward_override=fast"], "recipe.backward_override=fast: unknown"),
        (["recipe=nvfp4", "recipe.nvfp4_4over6=some"], "recipe.nvfp4_4over6=some: unknown"),
        (["recipe=nvfp4", "recipe.nvfp4_4over6_e4m3_use_256=x"], "nvfp4_4over6_e4m3_use_256=x: unknown"),
        (["recipe=nvfp4", "recipe.nvfp4_4over6_err_mode=mae"], "choose one of ['MAE', 'MSE']"),
        (
            ["recipe=nvfp4", "recipe.nvfp4_4over6=all"],
            "with the random Hadamard transform",
        ),
        (["recipe=nvfp4", "recipe.nvfp4_4over6=activations"], "recipe.disable_rht=true"),
        (
            ["recipe=tensorwise", "recipe.backward_override=dequantized", "stability.fp8_wgrad=false"],
            "stability.fp8_wgrad=false with recipe.backward_override=dequantized",
        ),
    ],
)
def test_refused_in_one_line(overrides, words):
    assert words in error_of(*overrides)


def test_accepted_where_te_has_them():
    for ov in (
        ["recipe=tensorwise", "recipe.backward_override=dequantized"],
        ["recipe=blockwise", "recipe.backward_override=high_precision", "stability.fp8_wgrad=false"],
        ["recipe=mxfp8", "recipe.enable_2d_quantization=true", "recipe.backward_override=high_precision"],
        ["recipe=nvfp4", "recipe.nvfp4_4over6=weights", "recipe.row_scaled_activation=true"],
        [
            "recipe=nvfp4",
            "recipe.nvfp4_4over6=all",
            "recipe.disable_rht=true",
            "recipe.nvfp4_4over6_err_mode=MSE",
        ],
    ):
        load([*CPU, *ov], for_export=True)


def test_stability_overrides_fields_are_validated_the_same_way():
    ok = "+stability.overrides=[{pattern:'*.fc2',recipe:tensorwise,fields:{backward_override:dequantized}}]"
    cfg = load([*CPU, "recipe=blockwise", ok])
    assert cfg.stability.overrides[0].resolved.backward_override == "dequantized"
    bad = "+stability.overrides=[{pattern:'*.fc2',recipe:delayed,fields:{backward_override:high_precision}}]"
    msg = error_of("recipe=blockwise", bad)
    assert msg.startswith(
        "stability.overrides pattern=*.fc2: recipe.backward_override=high_precision with recipe=delayed"
    )
    bad = "+stability.overrides=[{pattern:'*.fc2',recipe:tensorwise,fields:{backward_override:dequantized}}]"
    assert "fp8_wgrad=false with recipe.backward_override" in error_of(
        "recipe=blockwise", "stability.fp8_wgrad=false", bad
    )
    bad = "+stability.overrides=[{pattern:'*.fc2',recipe:mxfp8,fields:{nvfp4_4over6:all}}]"
    assert "nvfp4_4over6=all with recipe=mxfp8" in error_of("recipe=blockwise", bad)


def test_entry_point_exits_2_with_one_error_line(capsys, tmp_path):
    from harness import train

    args = [*CPU, "recipe=delayed", "recipe.backward_override=dequantized", f"hydra.run.dir={tmp_path}/run"]
    code, err = run_main(capsys, train.main, "harness.train", *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(
        "error: recipe.backward_override=dequantized with recipe=delayed"
    )


@pytest.mark.parametrize(
    ("var", "have", "overrides", "ok"),
    [
        ("NVTE_BACKWARD_OVERRIDE", "dequantized", ["recipe=tensorwise"], False),  # null field: must be unset
        (
            "NVTE_BACKWARD_OVERRIDE",
            "dequantized",
            ["recipe=tensorwise", "recipe.backward_override=dequantized"],
            True,
        ),
        ("NVTE_BACKWARD_OVERRIDE", "high_precision", ["recipe=delayed"], False),
        ("NVTE_NVFP4_4OVER6", "all", ["recipe=nvfp4"], False),
        ("NVTE_NVFP4_4OVER6", "weights", ["recipe=nvfp4", "recipe.nvfp4_4over6=weights"], True),
        ("NVTE_NVFP4_4OVER6_ERR_MODE", "mse", ["recipe=nvfp4", "recipe.nvfp4_4over6_err_mode=MSE"], True),
        ("NVTE_NVFP4_4OVER6_ERR_MODE", "MSE", ["recipe=nvfp4"], False),
        ("NVTE_NVFP4_4OVER6_E4M3_USE_256", "none", ["recipe=nvfp4"], False),
        ("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "1", ["recipe=nvfp4"], False),
        (
            "NVTE_NVFP4_ROW_SCALED_ACTIVATION",
            "1",
            ["recipe=nvfp4", "recipe.row_scaled_activation=true"],
            True,
        ),
    ],
)
def test_nvte_variables_set_from_config_refused_if_different(monkeypatch, var, have, overrides, ok):
    monkeypatch.setenv(var, have)
    cfg = load([*CPU, *overrides], for_export=True) if ok else None
    if not ok:
        errs = te_env.conflicts(recipes_cfg(overrides))
        assert len(errs) == 1 and errs[0].startswith(f"environment {var}={have} contradicts the config")
    else:
        assert te_env.conflicts(cfg.recipe) == []


def recipes_cfg(overrides):
    from tests.helpers import compose_cfg

    return compose_cfg(*CPU, *overrides).recipe


def test_set_nvte_env_sets_strings_and_unsets_its_own_null(monkeypatch):
    for var in ("NVTE_BACKWARD_OVERRIDE", "NVTE_NVFP4_4OVER6"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(te_env, "LOWP_SET_NVTE", {})
    import os

    r = recipes_cfg(["recipe=nvfp4", "recipe.nvfp4_4over6=weights", "recipe.backward_override=dequantized"])
    env = te_env.set_nvte_env(r)
    assert env["NVTE_NVFP4_4OVER6"] == "weights" and os.environ["NVTE_BACKWARD_OVERRIDE"] == "dequantized"
    te_env.set_nvte_env(recipes_cfg(["recipe=nvfp4"]))  # a later run in the same process: null again
    assert "NVTE_BACKWARD_OVERRIDE" not in os.environ and os.environ["NVTE_NVFP4_4OVER6"] == "none"


def test_te_backend_refuses_backward_override_on_layernorm_mlp_blocks():
    """TE 2.20.2's LayerNormMLP asserts backward_override is None (layernorm_mlp.py:253): dense
    blocks on backend=te are refused; an all-MoE model has none; backend=auto picks the emulator."""
    te = ["model=gpt_tiny", "hardware=h100", "backend=te"]
    with pytest.raises(ConfigError, match="layernorm_mlp.py:253"):
        load([*te, "recipe=tensorwise", "recipe.backward_override=dequantized"], for_export=True)
    with pytest.raises(ConfigError, match="layernorm_mlp.py:253"):  # fp8_wgrad=false maps to it on TE
        load([*te, "recipe=tensorwise", "stability.fp8_wgrad=false"], for_export=True)
    cfg = load(
        [
            "model=mixtral_tiny",
            "hardware=h100",
            "backend=te",
            "recipe=tensorwise",
            "recipe.backward_override=dequantized",
        ],
        for_export=True,
    )
    assert te_blocker(cfg.recipe, cfg.stability, cfg.model) is None
    with pytest.warns(Warning, match="backend=auto runs the emulated backend: backward_override=dequantized"):
        load(
            [
                "model=gpt_tiny",
                "hardware=h100",
                "backend=auto",
                "recipe=tensorwise",
                "recipe.backward_override=dequantized",
            ],
            for_export=True,
        )


def test_labels_and_verification():
    r = recipes_cfg(["recipe=nvfp4", "recipe.nvfp4_4over6=weights", "recipe.backward_override=dequantized"])
    assert recipes.label(r) == "nvfp4 + dequantized backward + 4over6 weights"
    assert recipes.verification(r) == {
        "recipe.backward_override=dequantized": recipes.KERNEL_UNVERIFIED,
        "recipe.nvfp4_4over6=weights": recipes.KERNEL_UNVERIFIED,
    }
    t = recipes_cfg(["recipe=tensorwise", "recipe.backward_override=high_precision"])
    assert recipes.verification(t) == {
        "recipe.backward_override=high_precision": recipes.VERIFICATION[
            ("backward_override", "Float8CurrentScaling")
        ]
    }
    assert recipes.verification(recipes_cfg(["recipe=tensorwise"])) == {}
