"""TE 2.20's recipe fields refused as TE 2.20.2 refuses them, one `error:` line each (exit 2 at the
entry point), on the run's recipe and in stability overrides; their NVTE_* variables under the
set-from-config, refuse-if-different rule; backend=auto and TE's LayerNormMLP."""

from __future__ import annotations

import pytest

from harness import recipes
from harness.backends import te_env
from harness.backends.capability import te_blocker
from harness.config.errors import ConfigError
from harness.numerics import resolve_recipe
from harness.validation.load import load
from tests.helpers import run_main

CPU = ["model=gpt_tiny", "hardware=cpu", "backend=emulated"]


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load([*CPU, *overrides], for_export=True)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def recipe_errors(name: str, **fields) -> list[str]:
    """The recipe rules alone (no Hydra compose): the run's recipe and an override's go through them."""
    from harness.validation.legality import NAMES, _recipe_errors, _unknown

    r = resolve_recipe(name, **fields)
    errs = [
        _unknown(k, getattr(r, k[7:]), v)
        for k, v in NAMES.items()
        if k[7:] in fields and getattr(r, k[7:]) not in v
    ]
    return errs or _recipe_errors(r)


@pytest.mark.parametrize(
    ("name", "fields", "words"),
    [
        (
            "bf16",
            {"backward_override": "dequantized"},
            "recipe.backward_override=dequantized with recipe=bf16",
        ),
        ("int4_qat", {"backward_override": "dequantized"}, "TE 2.20 has backward_override only on"),
        ("tensorwise", {"row_scaled_activation": True}, "row_scaled_activation only on nvfp4"),
        ("mxfp8", {"nvfp4_4over6": "weights"}, "recipe.nvfp4_4over6=weights with recipe=mxfp8"),
        ("blockwise", {"nvfp4_4over6_err_mode": "MSE"}, "nvfp4_4over6_err_mode only on nvfp4"),
        ("nvfp4", {"enable_2d_quantization": True}, "enable_2d_quantization only on mxfp8"),
        ("tensorwise", {"backward_override": "fast"}, "recipe.backward_override=fast: unknown"),
        ("nvfp4", {"nvfp4_4over6": "some"}, "recipe.nvfp4_4over6=some: unknown"),
        ("nvfp4", {"nvfp4_4over6_e4m3_use_256": "x"}, "nvfp4_4over6_e4m3_use_256=x: unknown"),
        ("nvfp4", {"nvfp4_4over6_err_mode": "mae"}, "choose one of ['MAE', 'MSE']"),
        ("nvfp4", {"nvfp4_4over6": "all"}, "with the random Hadamard transform"),
        ("nvfp4", {"nvfp4_4over6": "activations"}, "recipe.disable_rht=true"),
    ],
)
def test_refused_in_one_line(name, fields, words):
    errs = recipe_errors(name, **fields)
    assert len(errs) == 1 and words in errs[0] and "\n" not in errs[0], errs


def test_refused_through_load():
    assert "only supports backward_override=None" in error_of(
        "recipe=delayed", "recipe.backward_override=high_precision"
    )
    msg = error_of("recipe=tensorwise", "recipe.backward_override=dequantized", "stability.fp8_wgrad=false")
    assert "stability.fp8_wgrad=false with recipe.backward_override=dequantized" in msg


def test_accepted_where_te_has_them():
    for name, fields in (
        ("tensorwise", {"backward_override": "dequantized"}),
        ("blockwise", {"backward_override": "high_precision"}),
        ("mxfp8", {"enable_2d_quantization": True, "backward_override": "high_precision"}),
        ("nvfp4", {"nvfp4_4over6": "weights", "row_scaled_activation": True}),
        ("nvfp4", {"nvfp4_4over6": "all", "disable_rht": True, "nvfp4_4over6_err_mode": "MSE"}),
    ):
        assert recipe_errors(name, **fields) == []
    load([*CPU, "recipe=blockwise", "recipe.backward_override=high_precision", "stability.fp8_wgrad=false"])


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
    errs = te_env.conflicts(recipes_cfg(overrides))
    if ok:
        assert errs == []
    else:
        assert len(errs) == 1 and errs[0].startswith(f"environment {var}={have} contradicts the config")


def test_nvte_conflict_is_an_error_line_on_te(monkeypatch):
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    with pytest.raises(ConfigError, match="environment NVTE_BACKWARD_OVERRIDE=high_precision contradicts"):
        load(["model=mixtral_tiny", "hardware=h100", "backend=te", "recipe=tensorwise"], for_export=True)


def recipes_cfg(overrides):
    """The recipe of `recipe=NAME recipe.FIELD=VALUE ...` overrides, without Hydra."""
    name = overrides[0].removeprefix("recipe=")
    fields = dict(o.removeprefix("recipe.").split("=") for o in overrides[1:])
    typed = {k: {"true": True, "false": False}.get(v, v) for k, v in fields.items()}
    return resolve_recipe(name, **typed)


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
    hybrid = resolve_recipe("custom", quantizer_factory="mxfp8_fwd_nvfp4_bwd_factory")  # a shipped name
    assert recipes.verification(hybrid) == {
        "recipe.quantizer_factory=mxfp8_fwd_nvfp4_bwd_factory": recipes.KERNEL_UNVERIFIED
    }
    user = resolve_recipe("custom", quantizer_factory="harness.numerics.custom:tensorwise_factory")
    assert recipes.verification(user) == {}
