"""A test-only transform: outlier feature channels in one linear's input (not a model option).

LLM.int8() (Dettmers et al. 2022, section 4) finds that from ~6.7B parameters on, a few hidden
dimensions of the inputs to the attention and FFN projections carry values up to 20x larger than
the rest in every layer, and then 60x: "emergent outlier features". `outliers_in(name)` makes the
model built inside the block (on the emulated backend) multiply `channels` input channels of the
linear `name` so that each one's mean magnitude is 20x to 60x the median channel's, in every forward
(gradients flow through the scaling). Every recipe's run sees the same channels, so the comparison
between arms stays fair; only the numerics of that one layer's input change.
"""

from __future__ import annotations

import contextlib

import torch

from harness.backends.emulated import EmulatedBackend

MAGNITUDE = (20.0, 60.0)
"""LLM.int8()'s emergent features: 20x to 60x the median channel."""


def outlier_hook(channels: int, seed: int = 0):
    """A forward pre-hook that turns `channels` input channels (chosen by `seed`) into outliers."""
    g = torch.Generator().manual_seed(seed)
    factors = MAGNITUDE[0] + (MAGNITUDE[1] - MAGNITUDE[0]) * torch.rand(channels, generator=g)
    state: dict[str, torch.Tensor] = {}

    def hook(mod, args):
        (x,) = args
        k = x.shape[-1]
        if "idx" not in state:
            state["idx"] = torch.randperm(k, generator=g)[:channels]
        idx = state["idx"].to(x.device)
        with torch.no_grad():
            mag = x.detach().float().abs().reshape(-1, k).mean(0)  # (K,) mean |x| per channel
            want = factors.to(x.device) * mag.median()
            gain = torch.ones(k, device=x.device)
            gain[idx] = want / mag[idx].clamp_min(1e-12)
        return (x * gain.to(x.dtype),)

    return hook


@contextlib.contextmanager
def outliers_in(name: str, channels: int = 4, seed: int = 0):
    """Models the emulated backend builds inside the block get outlier channels in `name`'s input."""
    original = EmulatedBackend.build_model

    def build_model(self):
        model = original(self)
        dict(model.named_modules())[name].register_forward_pre_hook(outlier_hook(channels, seed))
        return model

    EmulatedBackend.build_model = build_model
    try:
        yield
    finally:
        EmulatedBackend.build_model = original
