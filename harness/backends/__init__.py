"""Backends execute a recipe: `emulated` (pure PyTorch) and `te` (Transformer Engine).

backend = build_backend(BackendSpec(name, recipe, stability, model, optimizer, seed), device)
"""

from __future__ import annotations

import torch

from harness.backends.base import Backend, BackendSpec
from harness.backends.capability import resolve_backend_name


def build_backend(spec: BackendSpec, device: torch.device) -> Backend:
    if spec.name == "te":
        from harness.backends.te import TEBackend

        return TEBackend(spec, device)
    from harness.backends.emulated import EmulatedBackend

    return EmulatedBackend(spec, device)


__all__ = ["Backend", "BackendSpec", "build_backend", "resolve_backend_name"]
