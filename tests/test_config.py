"""Every conf/ file composes against its schema; presets carry the anchor shapes and guide values."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from harness import recipes
from harness.config import schema
from harness.config.store import CONF_DIR, GROUPS, load_preset, presets
from harness.validation.load import compose
from tests.helpers import REPO, compose_cfg

HF_TINY = REPO / "tests" / "assets" / "hf" / "llama_tiny"
ALL_PRESETS = [(g, n) for g in GROUPS for n in presets(g)]


@pytest.mark.parametrize("group,name", ALL_PRESETS)
def test_every_group_preset_composes_typed(group, name):
    # model=hf reads its shape from a config.json, and is named after it
    extra = [f"model.hf_config={HF_TINY}"] if (group, name) == ("model", "hf") else []
    cfg = compose([f"{group}={name}", *extra])
    obj = OmegaConf.to_object(cfg)
    assert isinstance(getattr(obj, group), GROUPS[group])
    assert getattr(obj, group).name == (f"hf:{HF_TINY.name}" if extra else name)


@pytest.mark.parametrize("name", presets("experiment"))
def test_every_experiment_composes(name):
    cfg = compose_cfg(f"experiment={name}")
    assert isinstance(cfg, schema.Config)


def test_groups_have_the_required_presets():
    want = {
        "hardware": {"cpu", "a100", "h100", "h200", "b200", "gb200", "auto"},
        "recipe": set(recipes.names()),
        "stability": {"none", "first_last_bf16", "conservative"},
        "optimizer": {"adamw_fp32", "bf16_states", "fp8_states", "min_memory"},
        "model": {"gpt_tiny", "gpt_small", "gpt_125m", "gpt_350m", "gpt_1b", "gpt_8b_slice"},
        "data": {"synthetic", "markov", "stdlib_bytes", "memmap", "megatron"},
        "backend": {"te", "emulated", "auto"},
        "logger": {"wandb", "none"},
        "experiment": {
            "hopper_fp8",
            "blackwell_fp8",
            "blackwell_fp4",
            "fp8_cpu_offload",
            "min_memory_optimizer",
            "h200_1b",
            "h200_8b_slice",
        },
    }
    for group, names in want.items():
        assert names <= set(presets(group)), group


def test_every_yaml_starts_from_its_schema():
    for group in GROUPS:
        for path in (CONF_DIR / group).glob("*.yaml"):
            raw = OmegaConf.load(path)
            assert list(raw.defaults) == [f"base_{group}"], path


@pytest.mark.parametrize("override", ["recipe.fp8_margn=1", "recipe.fp8_amax_history_len=abc"])
def test_schema_rejects_unknown_fields_and_wrong_types(override):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose([override])


def test_anchor_shapes_match_anchors_md():
    big = compose_cfg("experiment=h200_1b").model
    assert (
        big.hidden_size,
        big.num_layers,
        big.num_attention_heads,
        big.ffn_hidden_size,
        big.seq_length,
        big.vocab_size,
    ) == (2048, 24, 16, 8192, 2048, 50304)
    assert compose_cfg("experiment=h200_1b").micro_batch_size == 8
    sl = compose_cfg("experiment=h200_8b_slice")
    m = sl.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.ffn_hidden_size, m.seq_length) == (
        4096,
        6,
        32,
        16384,
        4096,
    )
    assert sl.micro_batch_size == 2 and sl.hardware.name == "h200"


def test_recipe_presets_expand_to_te_defaults():
    assert load_preset("recipe", "delayed").fp8_amax_history_len == 1024
    assert load_preset("recipe", "delayed").fp8_amax_compute_algo == "max"
    assert load_preset("recipe", "delayed").fp8 == "hybrid"
    assert load_preset("recipe", "tensorwise").power_2_scales is False
    bw = load_preset("recipe", "blockwise")
    assert (bw.fp8, bw.power_2_scales, bw.x_block_dim, bw.w_block_dim, bw.grad_block_dim) == (
        "e4m3",
        True,
        1,
        2,
        1,
    )
    assert load_preset("recipe", "mxfp8").fp8 == "e4m3"
    assert load_preset("recipe", "nvfp4").fp4 == "e2m1"


def test_hardware_peaks():
    h200 = load_preset("hardware", "h200")
    assert h200.peak_tflops == {"bf16": 989.0, "fp8": 1979.0, "fp4": None}
    assert h200.measured_tflops == {"bf16": 798.0, "fp8": 1462.0}
    b200 = load_preset("hardware", "b200")
    assert b200.peak_tflops == {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0}
    assert "mxfp8" in b200.native_recipes and "mxfp8" not in h200.native_recipes
    assert load_preset("hardware", "a100").peak_tflops["fp8"] is None
    assert load_preset("hardware", "cpu").peak_tflops["bf16"] is None


def test_unknown_preset_keeps_hydras_error():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException):
        compose(["recipe=fp6"])


def test_slurm_launcher_preset_composes():
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.validation.load import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hcompose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("LowpSlurmLauncher")
    # runs on any Slurm as shipped: no GPU gres, modest CPUs and memory, requeue on time limits
    assert launcher.gpus_per_node is None and launcher.gres is None and launcher.partition is None
    assert launcher.cpus_per_task <= 4 and launcher.mem_gb <= 16
    assert launcher.max_num_timeout > 0 and 0 < launcher.signal_delay_s <= launcher.timeout_min * 60 / 10
