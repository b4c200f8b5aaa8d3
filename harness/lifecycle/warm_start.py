"""A warm start (`warm_start=PATH`): a new run that continues another run's training from one of its
checkpoints, possibly in another recipe (docs/schedules.md, "The reference: two plain runs").

Not a resume: the run writes its own directory, its recipe (and schedule) may differ from the
checkpoint's, and the recipe's scale state is not loaded unless both recipes use delayed scaling;
everything else a resume loads is: weights, optimizer state, the step (so the LR schedule goes on),
the data position, the metrics' and divergence monitor's state, and every RNG. What defines the
training stream must match the checkpoint's config (WARM_KEYS), and the data its fingerprint.
"""

from __future__ import annotations

from pathlib import Path

from harness.config.errors import ConfigError
from harness.config.schema import RecipeConfig
from harness.lifecycle import checkpoint
from harness.lifecycle import resume as R

WARM_KEYS = ("model", "data", "optimizer", "seed", "micro_batch_size", "global_batch_size")
"""Config keys (dotted prefixes) a warm start must share with its checkpoint: the model it loads,
the token stream it continues, the optimizer state it keeps."""


def find(path: str) -> tuple[Path, int, dict]:
    """(checkpoint path, step, state) of `path`: a checkpoints/step_N directory, or a run directory
    (its newest usable checkpoint); ConfigError naming warm_start when there is none."""
    where = Path(path).expanduser()
    try:
        if (where / checkpoint.MANIFEST).is_file():
            return (where, *checkpoint.load_one(where))
        found = checkpoint.load_latest(where)
    except (OSError, ValueError, checkpoint.CheckpointError) as exc:
        raise ConfigError(
            f"warm_start={path}: the checkpoint does not load ({exc}); point it at another one"
        ) from exc
    if found is None:
        raise ConfigError(
            f"warm_start={path}: no usable checkpoint there; give a run directory that holds "
            "checkpoints/ or one of its checkpoints/step_N directories"
        )
    return found


def recipe_of(found: tuple[Path, int, dict]) -> RecipeConfig:
    """The recipe the checkpoint's run was in at its step (its schedule's phase, else its recipe),
    as today's schema reads it: the warm start keeps its scale state only between delayed recipes."""
    path, _, state = found
    saved = (state.get("schedule") or {}).get("recipe") or R.stored_config(state["config"], path)["recipe"]
    return RecipeConfig(name=saved["name"])


def check(found: tuple[Path, int, dict], requested: dict) -> None:
    """Refuse (ConfigError) a checkpoint whose training stream differs from the requested run's, or
    one at or past the run's last step."""
    path, step, state = found
    saved = R.stored_config(state["config"], path)
    diff = R.config_diff(saved, requested)
    keys = [k for k in diff if any(k == p or k.startswith(p + ".") for p in WARM_KEYS)]
    if keys:
        a, b = R._flat(saved), R._flat(requested)
        shown = ", ".join(f"{k}: {a.get(k, '<unset>')} -> {b.get(k, '<unset>')}" for k in keys[:4])
        raise ConfigError(
            f"warm_start={path}: its run trained another stream ({shown}); a warm start keeps the model, "
            "data, optimizer, seed and batch sizes of its checkpoint: set them as that run did"
        )
    if step >= requested["steps"]:
        raise ConfigError(
            f"warm_start={path} is at step {step}, not before steps={requested['steps']}: raise steps"
        )
    R.check_same_data(state, requested, saved, path)
