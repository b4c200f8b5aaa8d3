"""Entry point: compose, validate, train one run, write its artifacts.

    lowp-train [group=preset ...] [key=value ...]       one run
    lowp-train -m recipe=bf16,tensorwise seed=0,1       a multirun (every job validated first)
    lowp-train --help                                   the groups, their presets, Hydra's flags

(`python -m harness.train ...` in a checkout.) `harness.training.job.run(cfg, run_dir) -> Summary` is
the testable core (re-exported here with the Trainer); `main` only adapts Hydra to it. torch and the
trainer are imported when a run starts, not at module load: `--help` and tab completion (Hydra's
`--shell-completion`) compose the config only.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import io
import logging
import math
import os
import shutil
import sys
import textwrap
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from harness import recipes
from harness.config.errors import ConfigError, ConfigWarning
from harness.config.paths import CONF_DIR
from harness.config.schema import Config
from harness.config.store import GROUPS, register_schema, to_config
from harness.interop.hf_config import hf_field
from harness.lifecycle.runlock import EXCL as RUN_LOCK_EXCL
from harness.lifecycle.runlock import NAME as RUN_LOCK
from harness.lifecycle.runlock import RunDirLocked, RunLock
from harness.lifecycle.signals import StopRequest, exit_after_preemption
from harness.multirun.callbacks import JobFailed

_LAZY = {"run": "harness.training.job", "USER_ERRORS": "harness.training.job"}
_LAZY.update(Trainer="harness.training.trainer", backend_spec="harness.training.trainer")


def __getattr__(name: str):
    """`harness.train.run` (the API), `Trainer` and `backend_spec`: imported on first use (torch)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def _concise_warnings() -> None:
    default = warnings.formatwarning
    warnings.formatwarning = lambda msg, cat, *a, **k: (
        f"warning: {msg}\n" if issubclass(cat, ConfigWarning) else default(msg, cat, *a, **k)
    )


HELP_GROUPS = (*GROUPS, "experiment", "hydra/launcher")
"""The groups `--help` lists and a mistyped preset is checked against (Hydra's others keep its error)."""


def presets(group: str) -> list[str]:
    """A group's presets: conf/<group>/*.yaml and the site's gitignored conf/local/<group>/*.yaml
    (the `base_<group>` schema nodes are not presets); hydra/launcher adds the launcher plugins'."""
    names = {p.stem for d in (CONF_DIR / group, CONF_DIR / "local" / group) for p in d.glob("*.yaml")}
    if group == "hydra/launcher":
        from hydra.core.config_store import ConfigStore
        from hydra.core.plugins import Plugins

        Plugins.instance()  # the plugins store their launchers' configs when they are discovered
        importlib.import_module("hydra_plugins.lowp_launcher.config")  # which an editable install hides
        names |= {Path(n).stem for n in ConfigStore.instance().list(group)}
    return sorted(names)


def _group_line(group: str) -> str:
    """One line on a group: the first sentence of its schema dataclass's docstring."""
    if group == "experiment":
        return "Whole-run presets (# @package _global_): the guide's cookbook and the H200 anchor runs."
    if group == "hydra/launcher":
        return "Where a multirun's jobs run (-m, lowp-sweep): here one at a time, N at a time, or on Slurm."
    text = " ".join((GROUPS[group].__doc__ or "").split("\n\n")[0].split())
    for end in (". ", "; "):
        text = text.split(end)[0]
    return text.rstrip(".") + "."


def help_groups() -> str:
    """The `--help` table (conf/hydra/help/lowp.yaml): each group, its line, its presets with the
    chosen one in brackets."""
    from hydra.core.hydra_config import HydraConfig

    chosen = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    rows = []
    for group in HELP_GROUPS:
        names = [f"[{n}]" if chosen.get(group) == n else n for n in presets(group)]
        rows.append(f"  {group:<15}{_group_line(group)}")
        rows += textwrap.wrap(" ".join(names), 104, initial_indent=" " * 17, subsequent_indent=" " * 17)
    return "\n".join(rows)


def print_help(overrides: list[str]) -> None:
    """`lowp-train --help [overrides]`: the help template (conf/hydra/help/lowp.yaml, Hydra's
    `hydra.help`) rendered as Hydra renders it, with the groups of `help_groups`. Hydra's own --help
    also lists every group its way, copying its config repository once per group: 2 CPU-seconds."""
    import string

    from hydra import compose, initialize_config_dir
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import get_args_parser
    from hydra.core.hydra_config import HydraConfig

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        print(
            string.Template(cfg.hydra.help.template).safe_substitute(
                FLAGS_HELP=Hydra.format_args_help(get_args_parser()),
                APP_CONFIG_GROUPS=help_groups(),
                HYDRA_CONFIG_GROUPS="",
                CONFIG=OmegaConf.to_yaml(job),
            )
        )


def register() -> None:
    """What composing lowp's config needs, without torch: the schema's `base_<group>` nodes, the `hf`
    resolver of conf/model/hf.yaml (as harness.validation.load.register) and the help's table."""
    OmegaConf.register_new_resolver("hf", hf_field, replace=True)
    OmegaConf.register_new_resolver("lowp_help_groups", help_groups, replace=True)
    register_schema()


register()


def unknown_preset(overrides: list[str]) -> str | None:
    """The refusal line for the first `group=preset` override naming no preset of a lowp group, with
    the closest names (Hydra's own error is 25 lines and exit code 1). Sweeps (`a,b`) are checked
    name by name; sweep functions (`choice(...)`) and an added search path are left to Hydra."""
    if any(ov.lstrip("+").startswith("hydra.searchpath") for ov in overrides):
        return None
    for ov in overrides:
        group, sep, value = ov.lstrip("+~").partition("=")
        if not sep or group not in HELP_GROUPS or "(" in value:
            continue
        known = presets(group)
        for name in (v.strip() for v in value.split(",")):
            if name in known or name in ("null", ""):
                continue
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.75)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            return f"{group}={name}: no such preset; {hint}{group} presets: {', '.join(known)}"
    return None


def main() -> float | None:
    """`lowp-train`: a removed recipe name, or a preset that does not exist, is refused (exit 2)
    before Hydra looks for it; `--help` is `print_help`."""
    _plugins_on_path()  # before anything asks Hydra for its plugins (it lists them once)
    refused = recipes.legacy_in(sys.argv[1:]) or unknown_preset(sys.argv[1:])
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        sys.exit(2)
    args = _hydra_args(sys.argv[1:])
    if args is not None and args.help and not (args.config_name or args.config_dir or args.config_path):
        return print_help(args.overrides)  # another config tree (-cn/-cd/-cp): Hydra's own help
    if args is not None and args.shell_completion and any(o.startswith("query=") for o in args.overrides):
        return _complete()
    return _main()


def _complete() -> None:
    """A tab press (`-sc query=SHELL`): Hydra's suggestions without the schema's `base_<group>` nodes,
    which Hydra offers beside the presets (`recipe=base_recipe`)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            _main()
    finally:
        for line in out.getvalue().splitlines():
            words = line.split(" ")
            print(" ".join(w for w in words if not _schema_node(w)))


def _schema_node(word: str) -> bool:
    group, sep, value = word.lstrip("+~").partition("=")
    return bool(sep) and group in GROUPS and value == f"base_{group}"


def _plugins_on_path() -> None:
    """Hydra finds plugins by listing the folders of `hydra_plugins` on sys.path, and an editable
    install's import hook lists none: `lowp-train -m hydra/launcher=serial` would not find lowp's
    launcher. The folder that holds it goes on the path (as harness.multirun.launch does for its jobs)."""
    root = str(Path(importlib.import_module("hydra_plugins.lowp_launcher").__file__).parents[2])
    if root not in sys.path:
        sys.path.append(root)


def _hydra_args(argv: list[str]):
    """Hydra's parse of the command line, None where it would refuse it (Hydra then says why)."""
    from hydra._internal.utils import get_args_parser

    with contextlib.suppress(SystemExit):
        return get_args_parser().parse_args(argv)
    return None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _main(dcfg: DictConfig) -> float | JobFailed | None:
    """Adapts Hydra to `run`: exit 2 for a config error, 1 for a runtime one (a multirun's job
    returns instead, so the launcher goes on; harness.multirun.callbacks sets the exit code at the
    end), 128+signal after a preemption, 0 otherwise. A run refused before it wrote anything leaves
    no run directory."""
    from hydra.core.hydra_config import HydraConfig

    from harness.lifecycle import artifacts as A
    from harness.lifecycle import resume as R
    from harness.training.job import run
    from harness.validation.rules import check_known_keys

    _concise_warnings()
    hc = HydraConfig.get()
    multirun = hc.mode is not None and hc.mode.name == "MULTIRUN"
    run_dir = Path(hc.runtime.output_dir)
    stop = StopRequest().install()
    try:
        check_known_keys(dcfg)
        cfg: Config = to_config(dcfg)
        summary = run(cfg, run_dir, stop, R.resume_command(run_dir, list(hc.overrides.task)))
    except KeyboardInterrupt:
        print("error: interrupted twice; the last checkpoint is kept, restart to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - recorded in the run dir by run(); here the line and exit code
        code = 2 if isinstance(exc, ConfigError) else 1
        line = _error_line(exc, run_dir)
        _say(line)
        _remove_if_bare(run_dir, {hc.output_subdir, f"{hc.job.name}.log"})
        if multirun:
            return JobFailed(code, line)  # the launcher goes on with the next job
        sys.exit(code)
    finally:
        stop.restore()
    if summary.status == A.PREEMPTED:
        exit_after_preemption(stop.signum, stop.previous.get(stop.signum))
    loss = summary.final_eval_loss if summary.final_eval_loss is not None else summary.final_train_loss
    return loss if loss is not None and math.isfinite(loss) else None


def _error_line(exc: Exception, run_dir: Path) -> str:
    """The one `error:` line: a config error as its message; anything else with its type, a
    file-system error with its path, cause and fix, and where its traceback is when run() wrote one."""
    from harness.lifecycle import artifacts as A
    from harness.training.job import USER_ERRORS

    if isinstance(exc, ConfigError):
        return f"error: {exc}"
    text = A.os_error_text(exc, run_dir) if isinstance(exc, OSError) else str(exc)
    error_txt = run_dir / "error.txt"
    where = ""
    if not isinstance(exc, USER_ERRORS) and _written_for(error_txt, exc):
        where = f" (traceback in {error_txt})"
    return f"error: {type(exc).__name__}: {text}{where}"


def _written_for(error_txt: Path, exc: Exception) -> bool:
    """Whether error.txt records this failure (run() writes it unless the directory holds an earlier
    run that the failed attempt had not touched yet)."""
    try:
        return error_txt.read_text().startswith(f"{type(exc).__name__}: {exc}".strip())
    except OSError:
        return False


def _say(line: str) -> None:
    """The error line on stderr and in the job's log file (train.log), where a multirun's job keeps it."""
    print(line, file=sys.stderr)
    record = logging.LogRecord("lowp", logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _remove_if_bare(run_dir: Path, hydra_files: set[str | None]) -> None:
    """A run refused before it wrote anything leaves no run directory: what Hydra made for it (the
    job's .hydra/ and log) and an unheld run lock go, then the directory if that emptied it. Anything
    else there, or a lock that another process holds, keeps all of it."""
    try:
        names = {p.name for p in run_dir.iterdir()}
        hydra = set(os.listdir(run_dir / ".hydra")) if ".hydra" in names else set()
    except OSError:
        return
    locks = {RUN_LOCK, RUN_LOCK_EXCL}  # flock's file, and the fallback's where flock does not work
    if not names <= {*hydra_files, *locks} or not hydra <= {"config.yaml", "hydra.yaml", "overrides.yaml"}:
        return
    try:
        lock = RunLock(run_dir).acquire()
    except (RunDirLocked, OSError):
        return
    try:
        for name in names - locks:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    except OSError:
        return
    finally:
        lock.release()
    with contextlib.suppress(OSError):
        (run_dir / RUN_LOCK).unlink()
        run_dir.rmdir()


if __name__ == "__main__":
    main()
