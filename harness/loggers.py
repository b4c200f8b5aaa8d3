"""W&B through the real client (offline by default); local files are always written by RunWriter.

Each run opens and closes its own W&B run, grouped per sweep, job_type = recipe, with `tokens` as the
x-axis of every metric. wandb is imported lazily: logger=none never touches it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from harness.config.schema import LoggerConfig
from harness.metrics import TOKENS


class NullLogger:
    run_id = None

    def log(self, row: dict) -> None:
        pass

    def summary(self, summary: dict) -> None:
        pass

    def describe(self) -> dict | None:
        return None


class WandbLogger:
    def __init__(self, run):
        self.run = run
        self.run_id = run.id
        run.define_metric(TOKENS)
        run.define_metric("*", step_metric=TOKENS)

    def log(self, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if v is not None})

    def summary(self, summary: dict) -> None:
        for k, v in summary.items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                self.run.summary[k] = v

    def describe(self) -> dict:
        return {
            "run_id": self.run.id,
            "project": self.run.project,
            "group": self.run.group,
            "mode": self.run.settings.mode,
            "dir": str(self.run.dir),
            "name": self.run.name,
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
        "recipe": name(cfg.get("recipe")), "variant": variant,
        "model": name(cfg.get("model")), "data": name(cfg.get("data")), "seed": cfg.get("seed"),
        "config_warnings": len(run_json.get("config_warnings") or []),
    }  # fmt: skip
    return {**cfg, "resolved": resolved}


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
):
    """Yield a logger; the W&B run is finished when the block exits (also on failure)."""
    if cfg.name == "none" or cfg.wandb.mode == "disabled":
        yield NullLogger()
        return
    os.environ.setdefault("WANDB_SILENT", "true")  # lowp prints its own one-line progress
    import wandb

    w = cfg.wandb
    run = wandb.init(
        project=w.project,
        entity=w.entity,
        group=w.group or group,
        job_type=job_type,
        name=name,
        tags=sorted(set(tags) | set(w.tags)),
        config=config,
        dir=str(run_dir),
        mode=w.mode,
        reinit="finish_previous",
    )
    logging.getLogger("lowp").info("W&B %s run %s in %s", w.mode, run.id, run.dir)
    exit_code = 1
    try:
        yield WandbLogger(run)
        exit_code = 0
    finally:
        run.finish(exit_code=exit_code)
