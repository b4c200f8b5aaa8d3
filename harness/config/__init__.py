"""Config: typed schema (schema.py), Hydra registration (store.py), validation, Megatron export."""

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
