"""Backends execute a recipe: `emulated` (pure PyTorch) and `te` (Transformer Engine)."""

from harness.backends.base import Backend, build_backend, resolve_backend_name  # noqa: F401
