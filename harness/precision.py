"""Which recipe each module runs: the recipe, minus first/last BF16 blocks, plus per-module overrides.

Pure and shared by both backends, so the emulated and TE models quantize the same modules.
The LM head, embeddings, norms and attention are never quantized (numerics.md section 1).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from harness.config.schema import ModelConfig, RecipeConfig, StabilityConfig

_LAYER = re.compile(r"^blocks\.(\d+)\.")


def layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def bf16_layers(stability: StabilityConfig, num_layers: int) -> set[int]:
    """Block indices kept out of the quantized autocast (Megatron --first-last-layers-bf16)."""
    if not stability.first_last_layers_bf16:
        return set()
    start, end = stability.num_layers_at_start_in_bf16, stability.num_layers_at_end_in_bf16
    return {i for i in range(num_layers) if i < start or i >= num_layers - end}


@dataclass(frozen=True)
class PrecisionPlan:
    recipe: RecipeConfig
    stability: StabilityConfig
    model: ModelConfig

    def recipe_for(self, name: str) -> RecipeConfig | None:
        """The recipe of module `name`, or None where it runs unquantized (BF16)."""
        if name == "lm_head" or layer_index(name) is None:
            return None
        chosen: RecipeConfig | None = None if self.recipe.name == "bf16" else self.recipe
        if layer_index(name) in bf16_layers(self.stability, self.model.num_layers):
            chosen = None
        for ov in self.stability.overrides:
            if fnmatch.fnmatchcase(name, ov.pattern):
                chosen = None if ov.recipe == "bf16" else self._preset(ov.recipe)
        return chosen

    def _preset(self, name: str) -> RecipeConfig:
        if name == self.recipe.name:
            return self.recipe
        from harness.config.store import load_preset

        return load_preset("recipe", name)

    def quantized_modules(self, names: list[str]) -> dict[str, str]:
        """name -> recipe name ('bf16' where unquantized), for run.json."""
        return {n: (r.name if (r := self.recipe_for(n)) is not None else "bf16") for n in names}
