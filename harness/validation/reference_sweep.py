"""The configs lowp's validation and Megatron export are held against: every shipped experiment
preset (and none) x every recipe x the guide's stability and optimizer knobs, one knob set at a time.

Used by tests/test_megatron.py (lowp's decision against the flag-level rule table, on a CPU) and by
benchmarks/megatron_lm.py (the same configs fed to Megatron-LM's own argument checks). Hydra composes
each preset once; a case is a copy with the recipe preset swapped in and the knob set applied to the
typed config (group presets as their YAML fields), which keeps ~2,000 cases within seconds.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import cache

import yaml

from harness.config.schema import Config, ModuleOverride, RecipeConfig

EXAMPLE_FACTORY = "harness.numerics.custom:tensorwise_factory"

# Knob sets: each one a list of dotted overrides, labelled by its first entry where unnamed.
KNOBS: dict[str, list[str]] = {
    "none": [],
    "stability=first_last_bf16": ["@stability/first_last_bf16"],
    "stability=conservative": ["@stability/conservative"],
    "fp8_margin": ["stability.fp8_margin=1"],
    "no_fp8_wgrad": ["stability.fp8_wgrad=false"],
    "bf16_ends_2": [
        "stability.first_last_layers_bf16=true",
        "stability.num_layers_at_start_in_bf16=2",
        "stability.num_layers_at_end_in_bf16=0",
    ],
    "bf16_ends_negative": [
        "stability.first_last_layers_bf16=true",
        "stability.num_layers_at_start_in_bf16=-1",
    ],
    "bf16_ends_all": [
        "stability.first_last_layers_bf16=true",
        "stability.num_layers_at_start_in_bf16=40",
        "stability.num_layers_at_end_in_bf16=40",
    ],
    "override_first_block": ["stability.overrides=[{pattern: 'blocks.0.*', recipe: bf16}]"],
    "history_16_recent": ["recipe.fp8_amax_history_len=16", "recipe.fp8_amax_compute_algo=most_recent"],
    "power_2_scales": ["recipe.power_2_scales=true"],
    "fp32_block_scales": ["recipe.power_2_scales=false"],
    "amax_epsilon": ["recipe.amax_epsilon=1e-12"],
    "x_block_2d": ["recipe.x_block_dim=2"],
    "grad_block_2d": ["recipe.grad_block_dim=2"],
    "x_block_2d_w_1d": ["recipe.x_block_dim=2", "recipe.w_block_dim=1"],
    "nvfp4_no_rht_sr": ["recipe.disable_rht=true", "recipe.disable_stochastic_rounding=true"],
    "optimizer=bf16_states": ["@optimizer/bf16_states"],
    "optimizer=fp8_states": ["@optimizer/fp8_states"],
    "optimizer=min_memory": ["@optimizer/min_memory"],
    "optimizer=bf16_params": ["@optimizer/bf16_params"],
    "bf16_states_no_dist": ["@optimizer/bf16_states", "optimizer.use_distributed_optimizer=false"],
    "fp8_param": ["optimizer.fp8_param=true"],
    "fp8_param_dist": ["optimizer.fp8_param=true", "optimizer.use_distributed_optimizer=true"],
    "fp8_param_dist_reuse": [
        "optimizer.fp8_param=true",
        "optimizer.use_distributed_optimizer=true",
        "optimizer.reuse_grad_buf_for_mxfp8_param_ag=true",
    ],
    "reuse_only": ["optimizer.reuse_grad_buf_for_mxfp8_param_ag=true"],
    "no_fp8_param": ["optimizer.fp8_param=false"],
    "cpu_offload": ["optimizer.optimizer_cpu_offload=true"],
    "cpu_offload_pao": [
        "optimizer.optimizer_cpu_offload=true",
        "optimizer.use_precision_aware_optimizer=true",
        "optimizer.use_distributed_optimizer=true",
    ],
    "no_pao": ["optimizer.use_precision_aware_optimizer=false"],
    "act_fp8_store": ["optimizer.activation_func_fp8_input_store=true"],
    "act_fp8_store_swiglu": ["optimizer.activation_func_fp8_input_store=true", "model.activation=swiglu"],
    "min_lr_above_lr": ["optimizer.min_lr=0.01"],
    "odd_float_lr": ["optimizer.lr=0.0012345678", "optimizer.min_lr=1.2345678e-05"],
    "seed_7": ["seed=7"],
}


def presets() -> list[str | None]:
    from harness.config.store import presets as group_presets

    return [None, *group_presets("experiment")]


def recipes() -> list[str]:
    from harness.config.store import presets as group_presets

    return group_presets("recipe")


def _yaml(group: str, name: str) -> dict:
    """A preset's own fields (conf/<group>/<name>.yaml without its defaults list)."""
    from omegaconf import OmegaConf

    from harness.config.store import CONF_DIR

    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
    raw.pop("defaults", None)
    return raw


@cache
def _composed(preset: str | None) -> Config:
    """The preset composed by Hydra, as a typed Config."""
    from omegaconf import OmegaConf

    from harness.validation.load import compose

    # `experiment=X recipe=Y` is X with Y's recipe as long as X sets no recipe field itself
    assert not preset or "recipe" not in _yaml("experiment", preset), f"{preset} sets recipe fields"
    return OmegaConf.to_object(compose([f"experiment={preset}"] if preset else []))


@cache
def _recipe(name: str) -> RecipeConfig:
    from omegaconf import OmegaConf

    from harness import recipes

    fields = _yaml("recipe", name)
    if recipes.get(name).needs_factory:  # the shipped preset leaves the factory to the user (???)
        fields["quantizer_factory"] = EXAMPLE_FACTORY
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), fields))


def _set(cfg: Config, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    if last == "overrides":  # the one list-of-dataclass field a knob sets
        value = [ModuleOverride(**v) for v in value]
    setattr(obj, last, value)


def _apply(cfg: Config, knob: str) -> None:
    for item in KNOBS[knob]:
        if item.startswith("@"):  # a group preset: its fields over the composed ones
            group, name = item[1:].split("/")
            for key, value in _yaml(group, name).items():
                _set(cfg, f"{group}.{key}", value)
        else:
            key, _, text = item.partition("=")
            _set(cfg, key, yaml.safe_load(text))


def build(preset: str | None, recipe: str, knob: str) -> Config:
    """The typed Config of one sweep case (hardware as composed: no detection)."""
    cfg = copy.deepcopy(_composed(preset))
    cfg.recipe = copy.deepcopy(_recipe(recipe))
    _apply(cfg, knob)
    return cfg


def label(preset: str | None, recipe: str, knob: str) -> str:
    return f"experiment={preset or '-'} recipe={recipe} knob={knob}"


def cases() -> Iterator[tuple[str, Config]]:
    """(label, Config) for every preset x recipe x knob set."""
    for preset in presets():
        for recipe in recipes():
            for knob in KNOBS:
                yield label(preset, recipe, knob), build(preset, recipe, knob)


def verdict(cfg: Config) -> str | None:
    """lowp's decision on one sweep case for the export: None when accepted, else the refusal
    (warnings silenced: the sweep reads decisions, not advice)."""
    import warnings

    from harness.validation.rules import ConfigError, validate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate(cfg, for_export=True)
        except ConfigError as exc:
            return str(exc)
    return None
