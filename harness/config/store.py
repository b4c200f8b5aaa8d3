"""Register the schema in Hydra's ConfigStore: `base_<group>` nodes that every YAML starts from."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from harness.config import schema
from harness.config.errors import ConfigError
from harness.config.paths import CONF_DIR

GROUPS = {
    "recipe": schema.RecipeConfig,
    "stability": schema.StabilityConfig,
    "optimizer": schema.OptimizerConfig,
    "hardware": schema.HardwareConfig,
    "model": schema.ModelConfig,
    "data": schema.DataConfig,
    "backend": schema.BackendConfig,
    "logger": schema.LoggerConfig,
    "parallel": schema.ParallelConfig,
    "objective": schema.ObjectiveConfig,
    "schedule": schema.ScheduleConfig,
}


def register_schema() -> None:
    """The `base_<group>` nodes every YAML starts from (Hydra's ConfigStore)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=schema.Config)
    for group, node in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=node)


def to_config(dcfg):
    """OmegaConf.to_object of a composed tree; a ConfigError that a resolver raised (model=hf's
    reading of a config.json) comes out as itself, not wrapped in OmegaConf's multi-line error."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    try:
        return OmegaConf.to_object(dcfg)
    except InterpolationResolutionError as exc:
        cause = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise cause from None


def presets(group: str) -> list[str]:
    """Preset names of a group, from the YAML files under conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def load_preset(group: str, name: str):
    """One group preset as its typed dataclass (no Hydra app needed): used by numerics.quantize."""
    from omegaconf import OmegaConf

    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"{group}={name}: no such preset; choose one of {presets(group)}")
    raw = OmegaConf.load(path)
    raw.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(GROUPS[group]), raw)
    return OmegaConf.to_object(merged)
