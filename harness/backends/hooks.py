"""Recipe hooks: behaviour a recipe adds to the training step, composed by both backends.

A recipe names its hook in the registry (`RecipeSpec.hook`); the backends call the hook instead of
testing the recipe's name (torchtitan's model converters: `convert` + `post_optimizer_hook`).
"""

from __future__ import annotations

import torch

from harness.config.schema import RecipeConfig
from harness.numerics.int4 import fake_int4


class Int4FakeQuant:
    """miles' INT4 QAT: GEMMs read fake_int4(W), gradients pass straight through to W.

    Emulated: `weight()` runs inside each block linear's forward. TE (whose GEMMs read the bf16
    params): the params hold W-hat and TE FusedAdam's fp32 masters hold W, so `prepare` seeds the
    masters from the real weights and `after_optimizer_step` re-derives W-hat after each step.
    """

    fuses_wgrad = False
    """The emulated block linears keep a bf16 weight gradient under it (docs/numerics.md section 9)."""

    def __init__(self, recipe: RecipeConfig):
        self.group_size = recipe.int4_group_size

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        return fake_int4(w, self.group_size)

    def prepare(self, weights: list[torch.nn.Parameter], optimizer) -> None:
        for p in optimizer.params:  # masters seeded from the real weights before they are fake-quantized
            optimizer.inner.initialize_state(p, False)
        self.after_optimizer_step(weights)

    @torch.no_grad()
    def after_optimizer_step(self, weights: list[torch.nn.Parameter]) -> None:
        for p in weights:
            p.copy_(self.weight(p))

    def __repr__(self) -> str:
        return f"int4_qat(group={self.group_size}, ste, bf16 gemm)"


HOOKS = {"int4_fake_quant": Int4FakeQuant}


def make_hook(hook: str | None, recipe: RecipeConfig):
    """The hook object the registry names for `recipe` (None: the recipe needs none)."""
    return None if hook is None else HOOKS[hook](recipe)
