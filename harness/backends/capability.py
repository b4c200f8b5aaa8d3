"""Can TE run this recipe here? Reasons come from TE itself where it is installed."""

from __future__ import annotations

import functools
import importlib.util

_TE_CHECKS = {
    "delayed": "is_fp8_available",
    "tensorwise": "is_fp8_available",
    "blockwise": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
    "nvfp4": "is_nvfp4_available",
}


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
    check = _TE_CHECKS.get(recipe)
    if check is None:
        return True, ""
    import transformer_engine.pytorch as te

    fn = getattr(te, check)
    try:
        ok, reason = fn(return_reason=True)
    except TypeError:
        ok, reason = fn(), ""
    return bool(ok), str(reason)
