"""The public entry point for notebooks and tests: `quantize(x, recipe, role=...)`."""

from __future__ import annotations

import dataclasses

import torch

from harness import recipes
from harness.config.schema import RecipeConfig
from harness.numerics.qtensor import Quantized
from harness.numerics.quantizers import make_quantizer

_FIELDS = {f.name for f in dataclasses.fields(RecipeConfig)}


def resolve_recipe(recipe: str | RecipeConfig, **fields) -> RecipeConfig:
    """A recipe name (its registry preset, the fields conf/recipe/<name>.yaml holds) or a
    RecipeConfig, with fields overridden. No Hydra: names resolve through `harness.recipes`."""
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown recipe fields {unknown}; RecipeConfig has {sorted(_FIELDS)}")
    base = recipe if isinstance(recipe, RecipeConfig) else recipes.default_fields(recipe)
    return dataclasses.replace(base, **fields)


def quantize(
    x: torch.Tensor,
    recipe: str | RecipeConfig,
    *,
    role: str,
    columnwise: bool = False,
    generator: torch.Generator | None = None,
    scale: torch.Tensor | float | None = None,
    **fields,
) -> Quantized:
    """Quantize x as TE would for `role` ("input", "weight" or "grad") under `recipe`.

    `fields` override recipe fields by their canonical names (e.g. power_2_scales=False, fp8="e4m3");
    delayed scaling takes its `scale` explicitly; `generator` seeds NVFP4 stochastic rounding.
    Returns an object with `.dequantize()` (float32, x's shape and orientation), `.data` and
    `.scale_inv` in TE's layouts, and `.amax` (NVFP4 global amax) / `.scale` (INT4 group scales).
    """
    cfg = resolve_recipe(recipe, **fields)
    if recipes.get(cfg.name).scheme is None:
        raise ValueError(f"recipe={cfg.name} does not quantize; pick a quantized recipe")
    if scale is not None and not torch.is_tensor(scale):
        scale = torch.tensor([float(scale)], dtype=torch.float32, device=x.device)
    qz = make_quantizer(cfg, role, scale=scale, generator=generator)
    return qz.quantize(x, columnwise)
