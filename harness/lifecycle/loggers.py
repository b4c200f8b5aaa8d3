"""W&B through the real client (offline by default); local files are always written by RunWriter.

Each run opens and closes its own W&B run, grouped per sweep, job_type = recipe, with `tokens` as the
x-axis of every metric. wandb is imported lazily: logger=none never touches it.

Each of project, entity, group and mode is resolved as W&B users expect: an explicit `logger.wandb.*`
override, else its W&B variable (WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_GROUP, WANDB_MODE), else the
preset's value (the group: the sweep's); run.json's `wandb.sources` says which won for each. Under a
W&B sweep agent (WANDB_SWEEP_ID set) the agent owns the run: project, entity and the run id are left to
it, and the mode defaults to online (an explicit override or WANDB_MODE still wins, e.g. offline in
tests). The W&B id is recorded in run.json, so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from harness.config.errors import ConfigError
from harness.config.schema import LoggerConfig, WandbConfig
from harness.lifecycle.metrics import TOKENS


class NullLogger:
    run_id = None

    def log(self, row: dict) -> None:
        pass

    def summary(self, summary: dict) -> None:
        pass

    def describe(self) -> dict | None:
        return None

    def mark_preempting(self) -> None:
        pass

    def update_config(self, config: dict) -> None:
        pass


class WandbLogger:
    def __init__(self, run, sources: dict | None = None):
        self.run = run
        self.run_id = run.id
        self.sources = sources or {}
        self.lost = False
        run.define_metric(TOKENS)
        run.define_metric("*", step_metric=TOKENS)

    def _call(self, what: str, fn) -> None:
        """A lost W&B service never fails the run: under Slurm a SIGTERM (requeue, preemption) reaches
        wandb's service process too, while the loop still runs to its step boundary. The run dir's own
        files keep every row; the resumed attempt logs on to the same W&B run."""
        if self.lost:
            return
        try:
            fn()
        except (ConnectionError, BrokenPipeError, OSError) as exc:
            self.lost = True
            logging.getLogger("lowp").warning("W&B %s failed (%s); local files go on", what, exc)

    def log(self, row: dict) -> None:
        self._call("log", lambda: self.run.log({k: v for k, v in row.items() if v is not None}))

    def summary(self, summary: dict) -> None:
        def write():
            for k, v in summary.items():
                if isinstance(v, (int, float, str, bool)) or v is None:
                    self.run.summary[k] = v

        self._call("summary", write)

    def update_config(self, config: dict) -> None:
        """Known once the backend is built (the backend that ran, TE's version): W&B config keys."""
        self._call("config", lambda: self.run.config.update(config, allow_val_change=True))

    def mark_preempting(self) -> None:
        """W&B shows the run as preempted (not crashed); the resumed attempt continues it."""
        self._call("mark_preempting", self.run.mark_preempting)

    def describe(self) -> dict:
        return {
            "run_id": self.run.id,
            "project": self.run.project,
            "group": self.run.group,
            "mode": self.run.settings.mode,
            "dir": str(self.run.dir),
            "name": self.run.name,
            "entity": self.run.entity or None,
            "sweep_id": getattr(self.run, "sweep_id", None),
            "sources": self.sources,
        }


def wandb_config(run_json: dict) -> dict:
    """The resolved config plus a `resolved` section of flat keys to filter and group runs by in W&B
    (`resolved.backend` is the backend that ran, not `auto`; recipe fields are `recipe.*` already)."""
    cfg, prov = run_json.get("config") or {}, run_json.get("provenance") or {}
    name = lambda v: v.get("name") if isinstance(v, dict) else v
    variant = f"{name(cfg.get('stability'))}+{name(cfg.get('optimizer'))}"
    resolved = {
        "backend": prov.get("backend"), "hardware": prov.get("hardware"), "te_version": prov.get("te"),
        "torch_version": prov.get("torch"), "cuda": prov.get("cuda"), "gpu_name": prov.get("gpu_name"),
        "recipe": name(cfg.get("recipe")), "recipe_label": prov.get("recipe_label"), "variant": variant,
        "model": name(cfg.get("model")), "data": name(cfg.get("data")), "seed": cfg.get("seed"),
        "config_warnings": len(run_json.get("config_warnings") or []),
    }  # fmt: skip
    return {**cfg, "resolved": resolved}


WANDB_TAG_MAX = 64
"""W&B refuses a tag longer than this (its Settings validation): longer ones are cut."""


@contextlib.contextmanager
def open_logger(
    cfg: LoggerConfig,
    *,
    run_dir: Path,
    name: str,
    group: str | None,
    job_type: str,
    tags: list[str],
    config: dict,
    run_id: str | None = None,
):
    """Yield a logger; the W&B run is finished when the block exits (also on failure).

    `run_id`: a resumed run's W&B id (kept in run.json): the same W&B run continues (resume="allow")."""
    if cfg.name == "none":
        yield NullLogger()
        return
    settings, sources = resolve_settings(cfg.wandb, explicit_keys(cfg.wandb), os.environ, group)
    if settings["mode"] == "disabled":
        yield NullLogger()
        return
    os.environ.setdefault("WANDB_SILENT", "true")  # lowp prints its own one-line progress
    import wandb

    run = _init(
        wandb,
        settings["mode"],
        project=settings["project"],
        entity=settings["entity"],
        group=settings["group"],
        job_type=job_type,
        name=name,
        tags=sorted({t[:WANDB_TAG_MAX] for t in (*tags, *cfg.wandb.tags)}),
        config=config,
        dir=str(run_dir),
        reinit="finish_previous",
        id=run_id,  # under an agent, none but a resumed run's own: the agent's WANDB_RUN_ID
        resume="allow" if run_id else None,
    )
    from harness.lifecycle.artifacts import slurm_env

    # the Slurm job of this attempt (a requeued job keeps its W&B run; restart_count says which attempt)
    run.config.update({"slurm": slurm_env()}, allow_val_change=True)
    logging.getLogger("lowp").info("W&B %s run %s in %s", settings["mode"], run.id, run.dir)
    exit_code = 1
    try:
        yield WandbLogger(run, sources)
        exit_code = 0
    finally:
        try:
            run.finish(exit_code=exit_code)
        except Exception as exc:  # noqa: BLE001 - e.g. its service process took the same SIGTERM
            # the run's own files are complete; W&B's shutdown must not turn a clean stop into a failure
            logging.getLogger("lowp").warning("W&B run %s did not finish cleanly: %s", run.id, exc)


WANDB_VARS = {
    "project": "WANDB_PROJECT",
    "entity": "WANDB_ENTITY",
    "group": "WANDB_RUN_GROUP",
    "mode": "WANDB_MODE",
}
WANDB_MODES = {
    "online": "online",
    "offline": "offline",
    "disabled": "disabled",
    "run": "online",
    "dryrun": "offline",
}
AGENT = "sweep agent"


def explicit_keys(w: WandbConfig) -> set[str]:
    """The `logger.wandb.*` settings given explicitly: named in the command line's (or the sweep job's)
    overrides where Hydra composed the run, else those that differ from the schema's default."""
    try:
        from hydra.core.hydra_config import HydraConfig

        given = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}
        return {k for k in WANDB_VARS if f"logger.wandb.{k}" in given}
    except ValueError:  # no Hydra (a run started from Python)
        default = WandbConfig()
        return {k for k in WANDB_VARS if getattr(w, k) != getattr(default, k)}


def resolve_settings(
    w: WandbConfig, explicit: set[str], env, sweep_group: str | None = None
) -> tuple[dict, dict]:
    """(project, entity, group, mode) and, for each, what set it: `override`, its WANDB_* variable,
    `preset` (the group: `sweep` where the sweep's), or `sweep agent` (WANDB_SWEEP_ID set: project and
    entity are the agent's, passed as None so that W&B takes them from the agent's environment; the mode
    defaults to online)."""
    agent = bool(env.get("WANDB_SWEEP_ID"))
    values, sources = {}, {}
    for key, var in WANDB_VARS.items():
        if agent and key in ("project", "entity"):
            values[key], sources[key] = None, AGENT
        elif key in explicit:
            values[key], sources[key] = getattr(w, key), "override"
        elif env.get(var):
            values[key], sources[key] = env[var], var
        elif key == "mode" and agent:
            values[key], sources[key] = "online", AGENT
        elif key == "group" and not w.group and sweep_group:
            values[key], sources[key] = sweep_group, "sweep"
        else:
            values[key], sources[key] = getattr(w, key), "preset"
    if values["mode"] not in WANDB_MODES:
        said = "WANDB_MODE" if sources["mode"] == "WANDB_MODE" else "logger.wandb.mode"
        raise ConfigError(f"{said}={values['mode']}: not a W&B mode; use online, offline or disabled")
    values["mode"] = WANDB_MODES[values["mode"]]
    return values, sources


def _init(wandb, mode: str, **kwargs):
    """wandb.init; no credentials or no connection for an online run is one line naming the fix
    (a ConfigError, before the run writes anything)."""
    try:
        return wandb.init(mode=mode, **kwargs)
    except (wandb.errors.UsageError, wandb.errors.AuthenticationError, wandb.errors.CommError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"logger.wandb.mode={mode}: W&B refused to start ({first}); log in with `wandb login` "
            "(or set WANDB_API_KEY), or use logger.wandb.mode=offline and `wandb sync` later"
        ) from exc


def sweep_group(run_dir: Path) -> str | None:
    """Multirun jobs share a W&B group named after their sweep directory, `<parent>/<name>`: for Hydra's
    default multirun/<date>/<time> that is `<date>/<time>` (unique across days); harness.multirun.launch sets
    `<sweep>/<date_time>` explicitly (logger.wandb.group)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        if hc.mode and hc.mode.name == "MULTIRUN":
            sweep_dir = Path(hc.sweep.dir)
            return f"{sweep_dir.parent.name}/{sweep_dir.name}"
    except ValueError:
        pass
    return None
