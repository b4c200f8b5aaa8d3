"""A ready Config for every entry point: compose, resolve, validate.

    cfg = load(["recipe=mxfp8", "model=gpt_tiny"])   # composed, resolved, validated Config

Every entry point gets its Config from `load` (or, under `@hydra.main`, passes Hydra's composed one
through `prepare`), so all of them see the same thing: hardware=auto replaced by this machine's
preset, each stability override's recipe resolved into its full fields (run.json records what each
module really ran), and the validation rules applied (ConfigError, exit code 2 at the entry point).
`compose` registers the schema and the `hf` resolver (model=hf reads a Hugging Face config.json).
"""

from __future__ import annotations

from harness import recipes
from harness.backends.hardware import resolve_hardware
from harness.config.paths import CONF_DIR
from harness.config.schema import Config
from harness.config.store import register_schema, to_config
from harness.interop.hf_config import hf_field
from harness.model import schedule
from harness.model.plan import OVERRIDE_FIELDS, load_plan, override_recipe
from harness.validation.rules import validate


def register() -> None:
    """The schema's `base_<group>` nodes and the `hf` resolver of conf/model/hf.yaml."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("hf", hf_field, replace=True)
    register_schema()


def compose(overrides: list[str] | None = None, config_name: str = "config"):
    """Compose the config tree outside of a Hydra app (tests, notebooks, the Megatron export)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def compose_config(overrides: list[str] | None = None) -> Config:
    """The typed Config for these overrides, as composed (nothing resolved or validated)."""
    return to_config(compose(list(overrides or [])))


def resolve_overrides(cfg: Config) -> None:
    """Fill each stability override's `resolved` with the full recipe that module runs: the run's
    own recipe where the override names it, else the registry's preset (conf/recipe agrees), with
    the override's `fields` on top. A precision plan file's overrides come first (load_plan)."""
    load_plan(cfg.stability)
    for ov in cfg.stability.overrides:
        if ov.resolved is not None or ov.recipe not in recipes.names() or set(ov.fields) - OVERRIDE_FIELDS:
            continue  # already resolved, or unknown (validation names it)
        ov.resolved = override_recipe(cfg.recipe, ov)


def prepare(cfg: Config, *, for_export: bool = False, warnings_out: list[str] | None = None) -> Config:
    """Resolve hardware and overrides, then validate (raises ConfigError); returns `cfg`. The config
    warnings (also emitted) are appended to `warnings_out` where given: run.json keeps them."""
    cfg.hardware = resolve_hardware(cfg.hardware)
    resolve_overrides(cfg)
    schedule.resolve(cfg.recipe, cfg.schedule)
    found = validate(cfg, for_export=for_export)
    if warnings_out is not None:
        warnings_out.extend(found)
    return cfg


def load(overrides: list[str] | None = None, *, for_export: bool = False) -> Config:
    """compose + to_object + resolve_hardware + resolved overrides + validate, for any entry point."""
    return prepare(compose_config(overrides), for_export=for_export)
