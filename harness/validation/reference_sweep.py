"""The configs lowp's validation and Megatron export are held against: every shipped experiment
preset (and none) x every recipe x the guide's stability and optimizer knobs, one knob set at a time;
and every MoE model preset x every recipe x the MoE fields (MOE_KNOBS), one set at a time.

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


# Knob sets of the MoE model presets: each MoE field Megatron has a rule for, and the general knobs
# that meet the experts (BF16 ends, FP8 weights, an override of a whole expert group).
MOE_KNOBS: dict[str, list[str]] = {
    "none": [],
    "stability=first_last_bf16": KNOBS["stability=first_last_bf16"],
    "fp8_param_dist": KNOBS["fp8_param_dist"],
    "optimizer=bf16_states": KNOBS["optimizer=bf16_states"],
    "override_expert_group": ["stability.overrides=[{pattern: 'blocks.0.mlp.experts.fc1', recipe: bf16}]"],
    "router_padding": ["model.moe_router_padding_for_quantization=true"],
    "router_padding_capacity": [
        "model.moe_router_padding_for_quantization=true",
        "model.moe_expert_capacity_factor=1.25",
    ],
    "capacity_factor": ["model.moe_expert_capacity_factor=1.25"],
    "expert_bias_sigmoid": [
        "model.moe_router_score_function=sigmoid",
        "model.moe_router_enable_expert_bias=true",
        "model.moe_router_bias_update_rate=0.01",
    ],
    "expert_bias_softmax": ["model.moe_router_enable_expert_bias=true"],
    "sigmoid_scaled_seq_aux": [
        "model.moe_router_score_function=sigmoid",
        "model.moe_router_topk_scaling_factor=2.5",
        "model.moe_router_load_balancing_type=seq_aux_loss",
        "model.moe_aux_loss_coeff=0.0001",
    ],
    "topk1_softmax": ["model.moe_router_topk=1"],
    "topk1_pre_softmax": ["model.moe_router_topk=1", "model.moe_router_pre_softmax=true"],
    "no_balancing_z_loss": [
        "model.moe_router_load_balancing_type=none",
        "model.moe_aux_loss_coeff=0.0",
        "model.moe_z_loss_coeff=0.001",
    ],
    "router_fp64": ["model.moe_router_dtype=fp64"],
    "router_bf16": ["model.moe_router_dtype=null"],
    "shared_expert_gate": [
        "model.moe_shared_expert_intermediate_size=64",
        "model.moe_shared_expert_gate=true",
    ],
    "layer_freq_list": ["model.moe_layer_freq=[0, 1]"],
    "layer_freq_2": ["model.moe_layer_freq=2"],
    "layer_freq_short": ["model.moe_layer_freq=[1]"],
    "bias_linear": ["model.add_bias_linear=true"],
}


def presets() -> list[str | None]:
    from harness.config.store import presets as group_presets

    return [None, *group_presets("experiment")]


def moe_presets() -> list[str]:
    """The model presets with experts (conf/model/*.yaml that set num_moe_experts to a number;
    model=hf reads it from a Hugging Face config)."""
    from harness.config.store import presets as group_presets

    experts = {name: _yaml("model", name).get("num_moe_experts") for name in group_presets("model")}
    return [name for name, n in experts.items() if isinstance(n, int)]


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
def _composed(base: str) -> Config:
    """The base (`experiment=X`, `model=Y`, or "" for the defaults) composed by Hydra, as a typed
    Config."""
    from omegaconf import OmegaConf

    from harness.validation.load import compose

    group, _, name = base.partition("=")
    # `experiment=X recipe=Y` is X with Y's recipe as long as X sets no recipe field itself
    assert group != "experiment" or "recipe" not in _yaml(group, name), f"{name} sets recipe fields"
    return OmegaConf.to_object(compose([base] if base else []))


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


def _apply(cfg: Config, items: list[str]) -> None:
    for item in items:
        if item.startswith("@"):  # a group preset: its fields over the composed ones
            group, name = item[1:].split("/")
            for key, value in _yaml(group, name).items():
                _set(cfg, f"{group}.{key}", value)
        else:
            key, _, text = item.partition("=")
            _set(cfg, key, yaml.safe_load(text))


def build(preset: str | None, recipe: str, knob: str) -> Config:
    """The typed Config of one experiment-preset case (hardware as composed: no detection)."""
    return _build(f"experiment={preset}" if preset else "", recipe, KNOBS[knob])


def build_moe(model: str, recipe: str, knob: str) -> Config:
    """The typed Config of one MoE-preset case: `model=<model>` with a recipe and an MOE_KNOBS set."""
    return _build(f"model={model}", recipe, MOE_KNOBS[knob])


def _build(base: str, recipe: str, items: list[str]) -> Config:
    cfg = copy.deepcopy(_composed(base))
    cfg.recipe = copy.deepcopy(_recipe(recipe))
    _apply(cfg, items)
    return cfg


def label(preset: str | None, recipe: str, knob: str) -> str:
    return f"experiment={preset or '-'} recipe={recipe} knob={knob}"


def moe_label(model: str, recipe: str, knob: str) -> str:
    return f"model={model} recipe={recipe} knob={knob}"


def cases() -> Iterator[tuple[str, Config]]:
    """(label, Config) for every preset x recipe x knob set, then every MoE case."""
    for preset in presets():
        for recipe in recipes():
            for knob in KNOBS:
                yield label(preset, recipe, knob), build(preset, recipe, knob)
    yield from moe_cases()


def moe_cases() -> Iterator[tuple[str, Config]]:
    """(label, Config) for every MoE model preset x recipe x MoE knob set."""
    for model in moe_presets():
        for recipe in recipes():
            for knob in MOE_KNOBS:
                yield moe_label(model, recipe, knob), build_moe(model, recipe, knob)


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
