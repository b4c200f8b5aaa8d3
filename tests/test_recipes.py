"""The recipe registry agrees with conf/recipe, and what it states is what the modules do."""

from __future__ import annotations

import dataclasses

import pytest

from harness import recipes
from harness.config.schema import RecipeConfig
from harness.config.store import load_preset, presets


def test_every_preset_has_a_spec_and_back():
    assert set(presets("recipe")) == set(recipes.names())


@pytest.mark.parametrize("name", recipes.names())
def test_yaml_agrees_with_default_fields(name):
    spec = recipes.get(name)
    if spec.needs_factory:  # conf/recipe/custom.yaml: quantizer_factory: ??? (the user must give it)
        from omegaconf import OmegaConf

        from harness.config.store import CONF_DIR

        raw = OmegaConf.load(CONF_DIR / "recipe" / f"{name}.yaml")
        assert OmegaConf.is_missing(raw, "quantizer_factory")
        raw.quantizer_factory = None
        raw.pop("defaults")
        yaml = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), raw))
    else:
        yaml = load_preset("recipe", name)
    assert dataclasses.asdict(yaml) == dataclasses.asdict(spec.default_fields())


def test_unknown_name_names_the_choices():
    with pytest.raises(ValueError, match="recipe=mxfp4: unknown; choose one of"):
        recipes.get("mxfp4")


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipes.get("nvfp4").gemm_multiple = 8


def test_formats_and_peaks_are_consistent():
    for spec in recipes.REGISTRY.values():
        fields = spec.default_fields()
        assert not (spec.fp8_family and spec.fp4_family), spec.name
        if spec.fp8_family:
            assert fields.fp8 and spec.peak_dtype == "fp8", spec.name
        if spec.fp4_family:
            assert fields.fp4 == "e2m1" and spec.peak_dtype == "fp4", spec.name
        if not spec.quantizes_gemms:
            assert spec.peak_dtype == "bf16" and spec.te_recipe_class is None, spec.name
        assert (spec.scheme is None) == (spec.name == recipes.BASELINE), spec.name


def test_fused_casts_name_block_linears():
    for spec in recipes.REGISTRY.values():
        assert set(spec.fused_casts) <= {"input", "grad"}
        for leaves in spec.fused_casts.values():
            assert set(leaves) <= {"qkv", "proj", "fc1", "fc2"}, spec.name


def test_nvte_vars_follow_the_fields():
    blockwise = recipes.default_fields("blockwise")
    assert recipes.get("blockwise").nvte_env(blockwise) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    fp32 = dataclasses.replace(blockwise, power_2_scales=False)
    assert recipes.get("blockwise").nvte_env(fp32) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    nv = dataclasses.replace(recipes.default_fields("nvfp4"), disable_rht=True)
    assert recipes.get("nvfp4").nvte_env(nv)["NVTE_NVFP4_DISABLE_RHT"] == "1"
    assert recipes.get("bf16").nvte_env(recipes.default_fields("bf16")) == {}


def test_native_recipes_by_compute_capability():
    hopper = {"bf16", "int4_qat", "delayed", "tensorwise", "blockwise"}
    assert set(recipes.native_on(9.0)) == hopper
    assert {"mxfp8", "nvfp4"} <= set(recipes.native_on(10.0))
    assert "mxfp8" not in recipes.native_on(12.0) and "blockwise" not in recipes.native_on(8.0)


def test_recipes_are_the_eight_families():
    assert recipes.names() == (
        "bf16",
        "delayed",
        "tensorwise",
        "blockwise",
        "mxfp8",
        "nvfp4",
        "int4_qat",
        "custom",
    )


def test_label_names_the_fields_changed_from_the_preset():
    tensorwise = recipes.default_fields("tensorwise")
    assert recipes.label(tensorwise) == "tensorwise"
    fast = dataclasses.replace(tensorwise, fp8_fast_accumulation="all")
    assert recipes.label(fast) == "tensorwise + fast accumulation"
    attn = dataclasses.replace(recipes.default_fields("delayed"), fp8_dpa=True, fp8_mha=True)
    assert recipes.label(attn) == "delayed + FP8 attention + FP8 attention I/O"
    nv = dataclasses.replace(
        recipes.default_fields("nvfp4"), disable_rht=True, disable_stochastic_rounding=True
    )
    assert recipes.label(nv) == "nvfp4 + no RHT + no stochastic rounding"
    # a field without words is shown as name=value; a preset's own non-default value is not a change
    assert (
        recipes.label(dataclasses.replace(tensorwise, amax_epsilon=1e-6)) == "tensorwise + amax_epsilon=1e-06"
    )
    assert recipes.label(recipes.default_fields("blockwise")) == "blockwise"
    # a field only another family reads does not name the run (a sweep sets it for every arm)
    everywhere = {"int4_group_size": 256, "disable_rht": True, "fp8_fast_accumulation": "all"}
    assert recipes.label(dataclasses.replace(recipes.default_fields("bf16"), **everywhere)) == "bf16"
    assert (
        recipes.label(dataclasses.replace(recipes.default_fields("nvfp4"), **everywhere)) == "nvfp4 + no RHT"
    )
    int4 = dataclasses.replace(recipes.default_fields("int4_qat"), **everywhere)
    assert recipes.label(int4) == "int4_qat + int4_group_size=256"


def test_every_removed_name_maps_to_a_family_and_valid_fields():
    assert len(recipes.LEGACY) == 9 and not set(recipes.LEGACY) & set(recipes.names())
    known = {f.name for f in dataclasses.fields(RecipeConfig)}
    for name, old in recipes.LEGACY.items():
        assert old.family in recipes.names(), name
        assert set(old.fields) <= known and not set(old.removed) & known, name
        assert old.label.startswith(old.family + " + "), name
        assert all(recipes.field_label(k, v) in old.label for k, v in old.fields.items()), name
        message = recipes.legacy_message(name)
        assert message.startswith(f"recipe={name} is no longer a recipe") and old.replacement in message
        assert "\n" not in message


def test_the_hardware_presets_agree_with_the_registry():
    """A preset's native recipes are the ones its compute capability runs (custom aside)."""
    for name in presets("hardware"):
        hw = load_preset("hardware", name) if name != "auto" else None
        if hw is None or hw.compute_capability is None:
            continue
        assert set(hw.native_recipes) == set(recipes.native_on(hw.compute_capability)), name


@pytest.mark.parametrize(
    "overrides",
    [
        ["recipe=tensorwise_fastacc"],
        ["model=gpt_tiny", "recipe=bf16,tensorwise_fastacc"],
        ["recipe.name=tensorwise_fastacc"],
        ["+stability.overrides=[{pattern: 'blocks.0.*', recipe: tensorwise_fastacc}]"],
    ],
)
def test_a_removed_recipe_name_is_found_wherever_an_override_names_it(overrides):
    assert recipes.legacy_in(overrides) == recipes.legacy_message("tensorwise_fastacc")
    assert recipes.legacy_in(["recipe=tensorwise", "seed=0,1"]) is None


def test_entry_points_refuse_a_removed_recipe_with_exit_2_and_one_line(monkeypatch, capsys):
    import sys

    from harness import megatron, train

    assert megatron.main(["recipe=tensorwise_fp8attn"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: recipe=tensorwise_fp8attn is no longer a recipe") and "\n" not in err
    assert "recipe=tensorwise recipe.fp8_dpa=true" in err
    monkeypatch.setattr(sys, "argv", ["lowp-train", "model=gpt_tiny", "recipe=delayed_fp8attn"])
    with pytest.raises(SystemExit) as exit_:
        train.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: " + recipes.legacy_message("delayed_fp8attn")
    assert err.endswith("use recipe=delayed recipe.fp8_dpa=true")


def test_a_sweep_naming_a_removed_recipe_launches_nothing():
    from harness.multirun.spec import SweepError, build_jobs

    with pytest.raises(SweepError, match=r"arm .*: recipe=tensorwise_fp8head is no longer a recipe"):
        build_jobs("cpu_compare", ["recipe=tensorwise_fp8head"])


def test_the_validator_refuses_a_removed_name_given_as_a_field():
    from tests.test_validate import error_of

    msg = error_of("model=gpt_tiny", "recipe.name=tensorwise_fastacc")
    assert msg == recipes.legacy_message("tensorwise_fastacc")
    msg = error_of(
        "model=gpt_tiny", "+stability.overrides=[{pattern: 'blocks.0.*', recipe: tensorwise_fastacc}]"
    )
    assert msg.startswith(
        "stability.overrides pattern=blocks.0.* recipe=tensorwise_fastacc is no longer a recipe"
    )


def test_a_run_is_named_by_its_family_and_changed_fields(tmp_path):
    """summary.json holds the family and its label (the report's arm, the W&B name and the sweep's
    progress line): two runs that differ only in a recipe field are told apart by it."""
    import json

    from harness.train import run
    from tests.helpers import compose_cfg, tiny_cpu_run

    base = tiny_cpu_run(2, 4, 4, log_interval=1, eval_interval=0, eval_tokens=0, checkpoint_interval=-1)
    labels = {}
    for name, extra in (("plain", []), ("no_rht", ["recipe.disable_rht=true"])):
        summary = run(compose_cfg(*base, "recipe=nvfp4", *extra), tmp_path / name)
        assert summary.status == "completed"
        stored = json.loads((tmp_path / name / "summary.json").read_text())
        assert stored["recipe"] == "nvfp4"
        labels[name] = stored["recipe_label"]
        prov = json.loads((tmp_path / name / "run.json").read_text())["provenance"]
        assert prov["recipe_label"] == labels[name]
    assert labels == {"plain": "nvfp4", "no_rht": "nvfp4 + no RHT"}
