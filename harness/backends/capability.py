"""Can TE run this recipe here? Reasons come from TE itself where it is installed."""

from __future__ import annotations

import functools
import importlib.util

from harness import recipes


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


def resolve_backend_name(backend: str, recipe: str) -> str:
    """te or emulated, from backend.name (auto: te where it can run the recipe natively)."""
    if backend != "auto":
        return backend
    ok, _ = te_recipe_available(recipe)
    return "te" if ok else "emulated"


def runs_on_te(backend: str, recipe: str, hardware: str) -> bool:
    """backend=te, or auto on a GPU preset where it would resolve to te (validation's question)."""
    if backend == "auto" and hardware != "cpu":
        return resolve_backend_name(backend, recipe) == "te"
    return backend == "te"
