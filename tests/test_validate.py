"""One test per validation rule of architecture.md: exit-2-style one-line errors and warnings."""

from __future__ import annotations

import warnings

import pytest

from harness.validation.rules import ConfigError, ConfigWarning, validate
from tests.helpers import compose_cfg, run_cli


def error_of(*overrides: str, env: dict | None = None, monkeypatch=None, export: bool = False) -> str:
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, for_export=export)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def warnings_of(*overrides: str, export: bool = True) -> list[str]:
    cfg = compose_cfg(*overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(cfg, for_export=export)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_default_is_valid():
    validate(compose_cfg())


def test_fp8_and_fp4_both_set():
    msg = error_of("recipe=tensorwise", "recipe.fp4=e2m1")
    assert "recipe.fp8=hybrid" in msg and "recipe.fp4=e2m1" in msg and "exclusive" in msg


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_blackwell_recipes_with_te_below_cc10(recipe):
    msg = error_of(f"recipe={recipe}", "backend=te", "hardware=h100", export=True)
    assert "compute capability" in msg and "backend=emulated" in msg


def test_fp8_recipe_with_te_on_hardware_without_fp8():
    msg = error_of("recipe=tensorwise", "backend=te", "hardware=a100", export=True)
    assert "hardware=a100" in msg and "backend=emulated" in msg


def test_te_on_cpu():
    assert "needs a CUDA GPU" in error_of("backend=te", "hardware=cpu", export=True)


def test_fp8_param_across_ranks_needs_distributed_optimizer(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    msg = error_of("recipe=tensorwise", "optimizer.fp8_param=true", export=True)
    assert "use_distributed_optimizer" in msg
    monkeypatch.setenv("WORLD_SIZE", "1")


def test_cpu_offload_only_with_delayed():
    msg = error_of("experiment=fp8_cpu_offload", "recipe=tensorwise", export=True)
    assert "optimizer.optimizer_cpu_offload=true" in msg and "recipe=delayed" in msg


def test_first_last_bf16_with_delayed():
    msg = error_of("recipe=delayed", "stability=first_last_bf16")
    assert "stability.first_last_layers_bf16" in msg and "delayed" in msg


def test_nvfp4_needs_te_2_7_from_backend_version():
    msg = error_of("recipe=nvfp4", "backend=te", "hardware=b200", "backend.te_version=2.6.0", export=True)
    assert "2.7.0" in msg and "backend.te_version is 2.6.0" in msg


def test_nvfp4_with_new_te_is_fine_on_blackwell():
    validate(compose_cfg("experiment=blackwell_fp4", "model=gpt_1b"), for_export=True)


@pytest.mark.parametrize(
    "recipe,dim,block", [("tensorwise", 200, 16), ("mxfp8", 272, 32), ("nvfp4", 264, 16)]
)
def test_gemm_dims_divisibility_for_te(recipe, dim, block):
    hw = "b200" if recipe in ("mxfp8", "nvfp4") else "h100"
    msg = error_of(
        f"recipe={recipe}", "backend=te", f"hardware={hw}", f"model.ffn_hidden_size={dim}", export=True
    )
    assert f"model.ffn_hidden_size={dim}" in msg and str(block) in msg


def test_gemm_dims_not_checked_for_emulated():
    validate(
        compose_cfg("recipe=tensorwise", "backend=emulated", "model.ffn_hidden_size=200"), for_export=True
    )


def test_more_bf16_layers_than_the_model_has():
    msg = error_of(
        "recipe=tensorwise",
        "stability=first_last_bf16",
        "stability.num_layers_at_start_in_bf16=3",
        "stability.num_layers_at_end_in_bf16=3",
    )
    assert "model.num_layers=4" in msg


def test_fp8_states_without_precision_aware_optimizer():
    msg = error_of("optimizer.exp_avg_dtype=fp8", export=True)
    assert "use_precision_aware_optimizer=true" in msg


@pytest.mark.parametrize(
    "override,key",
    [
        ("recipe.fp8=e5m2", "recipe.fp8"),
        ("recipe.fp8_amax_compute_algo=mean", "recipe.fp8_amax_compute_algo"),
        ("optimizer.exp_avg_dtype=int8", "optimizer.exp_avg_dtype"),
        ("model.activation=relu", "model.activation"),
        ("backend.name=jax", "backend.name"),
    ],
)
def test_unknown_names(override, key):
    assert key in error_of(override, export=True)


def test_fp8_wgrad_false_with_delayed_on_te_is_refused():
    msg = error_of("recipe=delayed", "stability.fp8_wgrad=false", "backend=te", "hardware=h100", export=True)
    assert "--no-fp8-wgrad" in msg


def test_fp8_wgrad_false_on_te_warns_about_dgrad():
    """An all-MoE model (no LayerNormMLP, which refuses TE's backward_override) runs it on TE."""
    notes = warnings_of(
        "recipe=tensorwise", "stability.fp8_wgrad=false", "backend=te", "hardware=h100", "model=mixtral_tiny"
    )
    assert any("dgrad" in n for n in notes)


def test_nvte_environment_conflict(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    msg = error_of("recipe=blockwise", "backend=te", "hardware=h100", export=True)
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in msg
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0")
    validate(compose_cfg("recipe=blockwise", "backend=te", "hardware=h100"), for_export=True)


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_gemm_gelu_fusion_needs_userbuffers_lowp_does_not_set_up(monkeypatch, recipe):
    """TE builds a GELU LayerNormMLP with NVTE_GEMM_GELU_FUSION=1 only once its userbuffers exist
    (TypeError otherwise): refused before any model is built, in one line naming the variable; a
    SwiGLU model never reads it."""
    monkeypatch.setenv("NVTE_GEMM_GELU_FUSION", "1")
    msg = error_of(f"recipe={recipe}", "backend=te", "hardware=h100", export=True)
    assert msg.startswith("environment NVTE_GEMM_GELU_FUSION=1: TE 2.20 fuses GELU into the FP8 fc1 GEMM")
    assert msg.endswith("; unset it")
    validate(
        compose_cfg(f"recipe={recipe}", "backend=te", "hardware=h100", "model=llama3_1b"), for_export=True
    )
    monkeypatch.setenv("NVTE_GEMM_GELU_FUSION", "0")
    validate(compose_cfg(f"recipe={recipe}", "backend=te", "hardware=h100"), for_export=True)


def test_mxfp8_param_gather_without_reuse_warns():
    notes = warnings_of("experiment=blackwell_fp8", "optimizer.reuse_grad_buf_for_mxfp8_param_ag=false")
    assert any("reuse_grad_buf_for_mxfp8_param_ag" in n for n in notes)
    assert not warnings_of("experiment=blackwell_fp8")


def test_recipe_needs_its_format():
    assert "recipe.fp8" in error_of("recipe=tensorwise", "recipe.fp8=null")
    assert "quantizer_factory" in error_of("recipe=custom", "recipe.quantizer_factory=null")


@pytest.mark.parametrize("override", ["model.num_layers=0", "model.hidden_size=-4", "micro_batch_size=0"])
def test_sizes_must_be_positive(override):
    assert override.split("=")[0] in error_of(override)


def test_batch_divisibility():
    assert "global_batch_size=10" in error_of("global_batch_size=10", "micro_batch_size=4")


def test_not_supported_yet_fails_clearly():
    assert "not supported yet" in error_of("optimizer=bf16_params", "backend=emulated")


def test_int4_qat_on_te_needs_master_weights():
    msg = error_of("recipe=int4_qat", "backend=te", "hardware=h100", "optimizer=bf16_params")
    assert "optimizer.master_weights=true" in msg
    validate(compose_cfg("recipe=int4_qat", "backend=te", "hardware=h100"))


@pytest.mark.slow
def test_cli_error_is_one_line_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    res = run_cli(
        ["-m", "harness.train", "recipe=tensorwise", "recipe.fp4=e2m1", "logger=none", f"hydra.run.dir={out}"]
    )
    assert res.returncode == 2, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "recipe.fp4=e2m1" in errors[0]
    assert not (out / "run.json").exists()


@pytest.mark.slow
def test_multirun_validates_every_job_before_the_first(tmp_path):
    res = run_cli(
        [
            "-m",
            "harness.train",
            "-m",
            "model=gpt_tiny",
            "steps=2",
            "logger=none",
            "recipe=bf16,delayed",
            "stability=none,first_last_bf16",
            f"hydra.sweep.dir={tmp_path}",
        ]
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "first_last_layers_bf16" in res.stderr
    assert not list(tmp_path.rglob("run.json"))  # job 0 (bf16, none) was valid but never started


def test_lm_head_loss_chunks_range():
    msg = error_of("model=gpt_tiny", "model.lm_head_loss_chunks=-1")
    assert "model.lm_head_loss_chunks=-1" in msg and "use 0" in msg
    cfg = compose_cfg("model=gpt_tiny", "model.lm_head_loss_chunks=4")
    validate(cfg)
