"""Resuming a run in its own directory: what may differ, what the files keep, what each attempt adds.

A run resumes when it starts on a directory that holds a checkpoint (`resume=auto`, the default, or
`resume=must`). The checkpoint's config, read as today's schema (`harness.config.upgrades`: fields
added since filled with the value that reproduces the old lowp, removed options checked and dropped,
removed recipe names as their family), must equal the requested one in everything that changes the
result; the keys in RESULT_NEUTRAL (where logs go, how often, how many checkpoints) may differ. The
data is compared by its content fingerprint, not by where its files are (LOCATION): files staged to
node-local scratch resume, changed files are refused. These refusals come before the run writes
anything: a completed run re-run on changed data keeps its summary.
`metrics.jsonl` and `numerics.jsonl` keep every row up to the checkpoint's step and drop the rows a
killed attempt wrote after it, so the resumed files read as if the run had never stopped.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
import os
import re
import shlex
import socket
import sys
from pathlib import Path

from harness import recipes
from harness.config import upgrades
from harness.config.errors import ConfigError
from harness.config.schema import DataConfig
from harness.data import data_fingerprint
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
    "hardware.native_recipes",  # what validation allows on the part; the requested config is validated
)
LOCATION = ("data.path", "data.eval_path", "data.cache_dir")
"""Where the data files are: the data is compared by its content fingerprint instead."""
ROW_FILES = ("metrics.jsonl", "numerics.jsonl")
MOVED_ASIDE = ("checkpoints", *ROW_FILES, "summary.json", "error.txt", "run.json")


def _flat(tree: dict, prefix: str = "") -> dict:
    """Dotted key -> value; a list of dicts (the stability overrides) by index: `overrides.0.recipe`."""
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            value = {str(i): v for i, v in enumerate(value)}
        if isinstance(value, dict) and value:
            out.update(_flat(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_diff(saved: dict, requested: dict) -> list[str]:
    """Dotted keys whose values differ and change the result (sorted); the data's location is
    left to the fingerprint check, and backend.moe_experts is compared by what it runs here."""
    a, b = _resolved(_flat(saved)), _resolved(_flat(requested))
    return sorted(
        k
        for k in set(a) | set(b)
        if not _under(k, RESULT_NEUTRAL + LOCATION) and a.get(k, "<unset>") != b.get(k, "<unset>")
    )


def _resolved(flat: dict) -> dict:
    """backend.moe_experts as the kernels it picks for the model on this machine (`auto` is `te` for a
    dense model and below 128 experts: a run stored with `te` resumes under the presets' `auto`)."""
    key = "backend.moe_experts"
    if key not in flat:
        return flat
    from harness.backends.te_moe import resolve

    return {**flat, key: resolve(flat[key], flat.get("model.num_moe_experts"))}


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
    """The one command that resumes this run: the same overrides, in this run directory. The path is
    quoted for Hydra's override grammar (hydra_value) and then, like every argument, for the shell;
    the overrides are kept as the user wrote them (already in Hydra's grammar)."""
    keep = [o for o in overrides if not o.startswith(("hydra.run.dir=", "resume="))]
    run_dir_arg = f"hydra.run.dir={hydra_value(str(Path(run_dir).resolve()))}"
    return shlex.join([*train_command(), *keep, run_dir_arg])


def train_command() -> list[str]:
    """How to start lowp-train again (console_command)."""
    return console_command("lowp-train", "harness.train")


def console_command(script: str, module: str) -> list[str]:
    """How to start a lowp command again: `script` (lowp-train, lowp-sweep) where that is on PATH,
    the console script as it was called where it is not (`.venv/bin/lowp-sweep`), else `python -m
    module` (a checkout)."""
    import shutil

    on_path = shutil.which(script)
    called = sys.argv[0] if Path(sys.argv[0]).name == script else None
    if on_path and (called is None or Path(on_path).resolve() == Path(called).resolve()):
        return [script]
    return [called] if called else ["python", "-m", module]


_PLAIN = re.compile(r"[A-Za-z0-9_/.+@%-]+")
"""Characters that Hydra's override grammar and the shell both take unquoted in a path."""


def hydra_value(path: str) -> str:
    """`path` as an override value Hydra reads back as exactly `path`: as it is where every character
    is plain, else single-quoted. Inside quotes Hydra un-escapes only backslashes before a quote (its
    QUOTED_VALUE token: 2k+1 backslashes and a quote are k and the quote, 2k before the closing quote
    are k) and OmegaConf resolves `${...}`, so those are escaped; spaces, commas, brackets, `=`,
    quotes and any Unicode character then stand as they are."""
    if _PLAIN.fullmatch(path):
        return path
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", path)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return "'" + body.replace("${", "\\${") + "'"


def stored_config(saved: dict, run_dir: Path) -> dict:
    """A checkpoint's config as today's schema (upgrades.upgrade) with its removed recipe names as
    their families; ConfigError naming the key when it set an option that left lowp otherwise than
    at the value that behaves as lowp does today."""
    config, refusals = upgrades.upgrade(_as_families(saved))
    if refusals:
        keys = ", ".join(f"{r.key}={_shown(r.value)}" for r in refusals)
        why = "; ".join(dict.fromkeys(f"{r.change.why}; removed in {r.change.since}" for r in refusals))
        raise ConfigError(
            f"run dir {run_dir} holds a checkpoint whose config sets {keys}, which this lowp no longer "
            f"has ({why}); finish that run with the lowp that wrote it (its run.json names the commit), "
            "or start fresh with resume=never (moves the old files aside) or a new hydra.run.dir"
        )
    return config


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _as_families(saved: dict) -> dict:
    """A copy of `saved` in which each removed recipe name (recipes.LEGACY) is its family with the
    fields it stood for (the stored fields win; its removed options are checked by the upgrade)."""
    config = copy.deepcopy(saved)
    stored = [config.get("recipe")]
    for ov in (config.get("stability") or {}).get("overrides") or []:
        stored.append(ov.get("resolved"))
        old = recipes.LEGACY.get(ov.get("recipe"))
        if old is not None:
            ov["recipe"], ov["fields"] = old.family, {**old.fields, **(ov.get("fields") or {})}
    for recipe in stored:
        old = recipes.LEGACY.get((recipe or {}).get("name"))
        if old is not None:
            recipe["name"] = old.family
            for key, value in {**old.fields, **old.removed}.items():
                recipe.setdefault(key, value)
    return config


def check_same_data(state: dict, requested: dict, saved: dict, run_dir: Path) -> None:
    """The requested data must be what the checkpoint was trained on: the same content fingerprint,
    wherever its files are now; refused before anything is written (a source that cannot be built too)."""
    data = requested["data"]
    try:
        now = data_fingerprint(
            DataConfig(**data),
            vocab_size=requested["model"]["vocab_size"],
            seq_length=requested["model"]["seq_length"],
        )
    except ValueError as exc:  # the source's one-line config error (a missing file)
        raise ConfigError(str(exc)) from exc
    was = state["data"]["fingerprint"]
    located = {key: data[key.removeprefix("data.")] for key in LOCATION}
    if now != was:
        where = "".join(f", {key}={value}" for key, value in located.items() if value is not None)
        raise ConfigError(
            f"run dir {run_dir} holds a checkpoint trained on other data: data.name={data['name']}{where} "
            f"has content fingerprint {now[:12]}, the checkpoint's {was[:12]} (its content changed since); "
            "resume with the data it was trained on, or start fresh with resume=never (moves the old files "
            "aside) or a new hydra.run.dir"
        )
    moved = [key for key, value in located.items() if saved["data"].get(key.removeprefix("data.")) != value]
    if moved:
        log.info("data moved (%s), same content (fingerprint %s): resuming", ", ".join(moved), now[:12])


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
    saved = stored_config(found[2]["config"], run_dir)
    keys = config_diff(saved, requested)
    if keys:
        raise ConfigError(describe_diff(saved, requested, keys, run_dir))
    check_same_data(found[2], requested, saved, run_dir)
    return found
