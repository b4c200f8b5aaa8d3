"""Resuming a run in its own directory: what may differ, what the files keep, what each attempt adds.

A run resumes when it starts on a directory that holds a checkpoint (`resume=auto`, the default, or
`resume=must`). The checkpoint's config must equal the requested one in everything that changes the
result; the keys in RESULT_NEUTRAL (where logs go, how often, how many checkpoints) may differ.
`metrics.jsonl` and `numerics.jsonl` keep every row up to the checkpoint's step and drop the rows a
killed attempt wrote after it, so the resumed files read as if the run had never stopped.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shlex
import socket
import sys
from pathlib import Path

from harness.config.errors import ConfigError
from harness.lifecycle import checkpoint

log = logging.getLogger("lowp")

# config keys (dotted prefixes) that do not change the trained weights or the losses
RESULT_NEUTRAL = (
    "name",
    "logger",
    "log_interval",
    "eval_interval",
    "eval_tokens",
    "telemetry_interval",
    "checkpoint_interval",
    "checkpoint_keep",
    "resume",
    "bench_warmup_steps",
    "extras",
    "divergence",
    "hardware.peak_tflops",
    "hardware.measured_tflops",
)
ROW_FILES = ("metrics.jsonl", "numerics.jsonl")
MOVED_ASIDE = ("checkpoints", *ROW_FILES, "summary.json", "error.txt", "run.json")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _neutral(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in RESULT_NEUTRAL)


def config_diff(saved: dict, requested: dict) -> list[str]:
    """Dotted keys whose values differ and change the result (sorted)."""
    a, b = _flat(saved), _flat(requested)
    return sorted(
        k for k in set(a) | set(b) if not _neutral(k) and a.get(k, "<unset>") != b.get(k, "<unset>")
    )


def describe_diff(saved: dict, requested: dict, keys: list[str], run_dir: Path) -> str:
    """The one-line refusal: which keys differ (checkpoint -> requested) and how to start fresh."""
    a, b = _flat(saved), _flat(requested)
    shown = ", ".join(f"{k}: {a.get(k, '<unset>')} -> {b.get(k, '<unset>')}" for k in keys[:6])
    more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
    return (
        f"run dir {run_dir} holds a checkpoint of another config ({shown}{more}); resume with the same "
        "config, or start fresh with resume=never (moves the old files aside) or a new hydra.run.dir"
    )


def truncate_rows(run_dir: Path, step: int) -> dict[str, int]:
    """Drop the rows after `step` from metrics.jsonl/numerics.jsonl (atomically); returns rows dropped."""
    dropped = {}
    for name in ROW_FILES:
        path = Path(run_dir) / name
        if not path.exists():
            continue
        keep, drop = [], 0
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # the half-written last line of a killed attempt
                drop += 1
                continue
            if row.get("step", 0) <= step:
                keep.append(line)
            else:
                drop += 1
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
        dropped[name] = drop
    return dropped


def move_aside(run_dir: Path) -> Path | None:
    """resume=never on a used directory: the old artifacts go to `replaced_<time>/`, nothing is deleted."""
    run_dir = Path(run_dir)
    present = [n for n in MOVED_ASIDE if (run_dir / n).exists()]
    if not present:
        return None
    dest = run_dir / f"replaced_{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%S_%f')}"
    dest.mkdir()
    for name in present:
        os.replace(run_dir / name, dest / name)
    return dest


def attempt(resumed_from: int | None) -> dict:
    """One entry of run.json's `attempts`: when, where, from which step."""
    return {
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "resumed_from_step": resumed_from,
        "argv": sys.argv,
    }


def previous_run_json(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return None


def resume_command(run_dir: Path, overrides: list[str]) -> str:
    """The one command that resumes this run: the same overrides, in this run directory."""
    keep = [o for o in overrides if not o.startswith(("hydra.run.dir=", "resume="))]
    args = ["python", "-m", "harness.train", *keep, f"hydra.run.dir={Path(run_dir).resolve()}"]
    return " ".join(shlex.quote(a) for a in args)


def resume_point(mode: str, run_dir: Path, requested: dict) -> tuple[Path, int, dict] | None:
    """The checkpoint this run continues from (None: a fresh start), by the resume rule."""
    if mode not in ("auto", "never", "must"):
        raise ConfigError(f"resume={mode}: unknown; use auto, never or must")
    if mode == "never":
        moved = move_aside(run_dir)
        if moved:
            log.warning("resume=never: the earlier files of %s are kept in %s", run_dir, moved)
        return None
    found = checkpoint.load_latest(run_dir)
    if found is None and checkpoint.candidates(run_dir):
        raise checkpoint.CheckpointError(
            f"run dir {run_dir} holds checkpoints but none is usable (see the warnings above); start fresh "
            "with resume=never (moves them aside) or use a new hydra.run.dir"
        )
    if found is None:
        if mode == "must":
            raise ConfigError(
                f"resume=must but {run_dir} holds no usable checkpoint; "
                "check hydra.run.dir or use resume=auto"
            )
        return None
    saved = found[2]["config"]
    keys = config_diff(saved, requested)
    if keys:
        raise ConfigError(describe_diff(saved, requested, keys, run_dir))
    return found
