"""Can TE run this recipe here? Reasons come from TE itself where it is installed."""

from __future__ import annotations

import functools
import importlib.util

from harness import recipes
from harness.config.schema import ModelConfig, RecipeConfig, StabilityConfig
from harness.model.moe import moe_layer_pattern

LAYERNORM_MLP_OVERRIDE = (
    "TE 2.20.2's LayerNormMLP, which lowp's TE blocks use for their dense MLPs, asserts "
    "backward_override is None (transformer_engine/pytorch/module/layernorm_mlp.py:253; TE's fix is "
    "LayerNormLinear + Linear, which lowp's TE backend does not build)"
)


@functools.cache
def te_installed_version() -> str | None:
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        from importlib.metadata import version

        for dist in ("transformer_engine", "transformer-engine", "transformer_engine_cu13"):
            try:
                return version(dist)
            except Exception:
                continue
        import transformer_engine

        return transformer_engine.__version__
    except Exception:
        return None


def te_recipe_available(recipe: str) -> tuple[bool, str]:
    """TE's own answer (`is_*_available(return_reason=True)`) on this machine's GPU."""
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if te_installed_version() is None:
        return False, "transformer_engine is not installed"
    check = recipes.get(recipe).te_check
    if check is None:
        return True, ""
    import transformer_engine.pytorch as te

    fn = getattr(te, check)
    try:
        ok, reason = fn(return_reason=True)
    except TypeError:
        ok, reason = fn(), ""
    return bool(ok), str(reason)


def te_backward_override(recipe: RecipeConfig, stability: StabilityConfig) -> str | None:
    """The backward_override TE runs the recipe with: the field, else high_precision for
    stability.fp8_wgrad=false on a quantizing recipe (TE ignores Megatron's --no-fp8-wgrad)."""
    if recipe.backward_override is not None:
        return recipe.backward_override
    if not stability.fp8_wgrad and recipes.get(recipe.name).quantizes_gemms:
        return "high_precision"
    return None


def te_blocker(recipe: RecipeConfig, stability: StabilityConfig, model: ModelConfig) -> str | None:
    """Why lowp's TE model cannot run these recipe options (None: it can): a backward_override (the
    run's, or a stability override's) with dense MLP blocks."""
    asked = [te_backward_override(recipe, stability)]
    asked += [te_backward_override(ov.resolved, stability) for ov in stability.overrides if ov.resolved]
    if not any(asked) or (isinstance(model.moe_layer_freq, int) and model.moe_layer_freq < 1):
        return None  # nothing asked, or a layer pattern validation refuses by itself
    if 0 in moe_layer_pattern(model):
        return f"backward_override={next(a for a in asked if a)}: {LAYERNORM_MLP_OVERRIDE}"
    return None


def resolve_backend_name(backend: str, recipe: str, te_blocked: str | None = None) -> str:
    """te or emulated, from backend.name (auto: te where it can run the recipe natively and
    `te_blocked`, te_blocker's answer, names nothing lowp's TE model cannot run)."""
    if backend != "auto":
        return backend
    ok, _ = te_recipe_available(recipe)
    return "te" if ok and te_blocked is None else "emulated"


def runs_on_te(backend: str, recipe: str, hardware: str, te_blocked: str | None = None) -> bool:
    """backend=te, or auto on a GPU preset where it would resolve to te (validation's question)."""
    if backend == "auto" and hardware != "cpu":
        return resolve_backend_name(backend, recipe, te_blocked) == "te"
    return backend == "te"


def auto_note(backend: str, hardware: str, te_blocked: str | None) -> str | None:
    """The warning of backend=auto on a GPU preset when te_blocker's answer sends it to the emulator."""
    if backend == "auto" and hardware != "cpu" and te_blocked is not None:
        return f"backend=auto runs the emulated backend: {te_blocked}"
    return None
