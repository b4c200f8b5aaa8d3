"""A precision plan as Megatron-LM's per-module precision file (`--te-precision-config-file`).

Megatron's format (megatron/core/quantization/quant_config.py, `RecipeConfig.from_yaml_file`; the
payload parsed by `TEQuantizationParams.parse_from_config` in megatron/core/extensions/
transformer_engine.py:183-253, Megatron-LM d98e8a6): `configs` name TE payloads, `matchers` (in order,
the first enabled match wins) glob module paths of the GPTModel's `named_modules()`
(gpt_model.py:304-307) onto a config. A payload's `training_recipe` is a `TEQuantizationRecipe`:
`fp8_quantization_recipe` (tensorwise, blockwise, mxfp8, custom; delayed is refused by Megatron),
`fp4_quantization_recipe` (nvfp4, custom), `fp8_format`, `custom_recipe_factory` (a dotted path
Megatron imports and hands to TE's CustomRecipe), and `{}` for BF16. Megatron builds each class
with TE's defaults and the format only (transformer_engine.py:258-300), so a module whose recipe
sets any other field is expressible only as `custom` naming a factory lowp ships for it (TE's
hybrid zoo, harness.numerics.hybrid); anything else is refused in one line.

Each plan module gets its own matcher (its exact Megatron path behind `*`, for wrappers such as
`module.`), with `override_nonquantized_autocast: true` so the plan holds in layers Megatron's
global flags leave in BF16 (--first-last-layers-bf16).
"""

from __future__ import annotations

import re

from harness import recipes
from harness.config.schema import RecipeConfig
from harness.numerics.hybrid import te_path

CONFIG_TYPE = "TEQuantizationParams"
_NAMES = (  # lowp module name -> Megatron GPTModel module path (the mcore GPT layer spec's names)
    (re.compile(r"^blocks\.(\d+)\.attn\.qkv$"), r"decoder.layers.\1.self_attention.linear_qkv"),
    (re.compile(r"^blocks\.(\d+)\.attn\.proj$"), r"decoder.layers.\1.self_attention.linear_proj"),
    (re.compile(r"^blocks\.(\d+)\.mlp\.fc([12])$"), r"decoder.layers.\1.mlp.linear_fc\2"),
    (re.compile(r"^blocks\.(\d+)\.mlp\.experts\.fc([12])$"), r"decoder.layers.\1.mlp.experts.linear_fc\2"),
    (re.compile(r"^blocks\.(\d+)\.mlp\.shared_experts\.fc([12])$"),
     r"decoder.layers.\1.mlp.shared_experts.linear_fc\2"),
)  # fmt: skip
_FIELDS_MEGATRON_SETS = {"fp8", "fp4"}
"""Recipe fields Megatron's payload carries (fp8_format; FP4's format is its only one)."""


class NotExpressible(ValueError):
    """The plan names a module recipe that Megatron's per-module file cannot carry."""


_ONE_EXPERT = re.compile(r"^(blocks\.\d+\.mlp\.experts\.fc[12])\.\d+$")


def megatron_path(name: str) -> str:
    """blocks.3.mlp.fc1 -> decoder.layers.3.mlp.linear_fc1; ValueError for a module Megatron lacks.
    An expert group (blocks.3.mlp.experts.fc1) is one TEGroupedLinear in Megatron, matched by its
    path decoder.layers.3.mlp.experts.linear_fc1 (TEGroupedMLP names it so, experts.py:217-251, and
    TEGroupedLinear.__init__ asks get_quant_config_or_none for it, transformer_engine.py:2505): a
    plan moves a whole group, so one expert of it has no path."""
    for pattern, repl in _NAMES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    if m := _ONE_EXPERT.match(name):
        raise NotExpressible(
            f"module {name}: one expert of a group; Megatron's per-module file matches the group's "
            f"TEGroupedLinear only: plan the whole group {m.group(1)}"
        )
    raise NotExpressible(f"module {name}: no Megatron GPTModel path for it")


def training_recipe(r: RecipeConfig | None) -> dict:
    """The `training_recipe` payload of one module's recipe (None or bf16: `{}`)."""
    if r is None or recipes.get(r.name).scheme is None:
        return {}
    spec, label = recipes.get(r.name), recipes.label(r)
    if spec.megatron.quantizer_factory:  # custom: a TE factory lowp ships (TE's zoo)
        path = te_path(r.quantizer_factory)
        if path is None:
            raise NotExpressible(
                f"{label}: Megatron imports a TE qfactory; {r.quantizer_factory} is a lowp quantizer "
                "factory, not a TE one (use one of harness.numerics.hybrid's)"
            )
        key = "fp4_quantization_recipe" if r.fp4 else "fp8_quantization_recipe"
        return {key: "custom", "custom_recipe_factory": path, "fp8_format": r.fp8 or "e4m3",
                "override_nonquantized_autocast": True}  # fmt: skip
    if spec.delayed_scaling:
        raise NotExpressible(f"{label}: Megatron refuses delayed scaling in its per-module file "
                             "(transformer_engine.py:190); plan with tensorwise instead")  # fmt: skip
    extra = sorted(set(recipes.changed_fields(r)) - _FIELDS_MEGATRON_SETS)
    if extra or spec.te_recipe_class is None:
        why = f"sets {', '.join(extra)}" if extra else "is no TE recipe"
        raise NotExpressible(
            f"{label}: {why}; Megatron's per-module file builds TE's recipe classes with their "
            "defaults only: keep the preset, or make it a custom recipe with a TE factory"
        )
    if spec.fp4_family:
        return {
            "fp4_quantization_recipe": spec.megatron.fp4_recipe or r.name,
            "override_nonquantized_autocast": True,
        }
    return {"fp8_quantization_recipe": spec.megatron.fp8_recipe, "fp8_format": r.fp8,
            "override_nonquantized_autocast": True}  # fmt: skip


def precision_config(modules: dict[str, RecipeConfig | None]) -> dict:
    """Megatron's `--te-precision-config-file` contents for module name -> recipe (None = BF16), one
    matcher per module in the given order; NotExpressible names the first module it cannot carry."""
    configs: dict[str, dict] = {}
    matchers: dict[str, dict] = {}
    for i, (name, r) in enumerate(modules.items()):
        try:
            payload = training_recipe(r)
        except NotExpressible as e:
            raise NotExpressible(f"module {name}: {e}") from None
        key = "bf16" if not payload else re.sub(r"[^a-z0-9]+", "_", recipes.label(r).lower()).strip("_")
        configs.setdefault(key, {"transformer_engine_config_type": CONFIG_TYPE, "training_recipe": payload})
        matchers[f"m{i:03d}_{name.replace('.', '_')}"] = {
            "config": key, "type": "glob", "pattern": f"*{megatron_path(name)}", "enabled": True,
        }  # fmt: skip
    return {"configs": configs, "matchers": matchers}
