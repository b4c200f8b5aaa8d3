"""Config, the ground floor: the typed schema (schema.py), its Hydra registration and preset files
(store.py, paths.py) and the error types (errors.py). Nothing here imports a layer above it; the
rules and `load()` that give every entry point a ready Config live in `harness.validation`."""

from __future__ import annotations

from harness.config.schema import (  # noqa: F401
    BackendConfig,
    Config,
    DataConfig,
    HardwareConfig,
    LoggerConfig,
    ModelConfig,
    ModuleOverride,
    OptimizerConfig,
    RecipeConfig,
    StabilityConfig,
)
