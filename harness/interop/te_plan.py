"""A precision plan as a Transformer Engine `CustomRecipe` factory, for TE users without Megatron.

    from transformer_engine.common.recipe import CustomRecipe
    from harness.interop.te_plan import plan_qfactory
    recipe = CustomRecipe(qfactory=plan_qfactory("plan.yaml"))
    with te.autocast(recipe=recipe): ...      # the model's Linears built with name="blocks.3.mlp.fc1"

TE asks the factory for each quantizer slot with a `QuantizerRole` (TE 2.20.2
pytorch/quantization.py:57-96) whose `name` is the module's `name=` argument (Linear's
`get_quantizer_roles`, module/linear.py:2255-2281). The factory finds that module in the plan (its
lowp name, or its Megatron path `decoder.layers.3.mlp.linear_fc1`, with any prefix; a GroupedLinear's
roles carry the group's name for every expert, grouped_linear.py:1848-1873, so an expert group
`blocks.3.mlp.experts.fc1` takes its plan recipe whole) and returns the
quantizer of TE's own factory for the module's recipe at TE's defaults
(custom_recipes/quantizer_factories.py: current_scaling_factory, float8_block_scaling_factory,
mxfp8_factory, nvfp4_factory); BF16 modules, unnamed slots and modules the plan does not name get
TE's IdentityQuantizer (high precision). A plan module whose recipe sets fields away from its preset
is refused when the factory is made, in one line (as the Megatron file refuses it).
"""

from __future__ import annotations

from harness import recipes
from harness.backends.te_recipe import FACTORY_OF, HIGH_PRECISION, ModuleFactories
from harness.interop.megatron_precision import NotExpressible, megatron_path
from harness.model.plan import read_plan


def module_factories(path: str) -> dict[str, str]:
    """Module name (lowp's and Megatron's path) -> the TE factory name its plan recipe uses."""
    plan = read_plan(path)
    out: dict[str, str] = {}
    for ov in plan["overrides"]:
        name, spec = ov["pattern"], recipes.get(ov["recipe"])
        if ov.get("fields"):
            raise NotExpressible(f"module {name}: {ov['recipe']} with fields {ov['fields']}; TE's factories "
                                 "mirror the recipes' defaults only")  # fmt: skip
        factory = HIGH_PRECISION if spec.scheme is None else FACTORY_OF.get(spec.te_recipe_class or "")
        if factory is None:
            raise NotExpressible(f"module {name}: {ov['recipe']} has no TE factory at its defaults")
        out[name] = factory
        try:
            out[megatron_path(name)] = factory
        except NotExpressible:
            pass
    return out


def plan_qfactory(path: str) -> ModuleFactories:
    """TE `CustomRecipe(qfactory=...)`: role -> the TE quantizer the plan gives that module's slot
    (picklable, as TE's checkpoints need)."""
    return ModuleFactories(module_factories(path))
