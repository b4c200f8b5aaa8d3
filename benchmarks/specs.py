"""Named benchmark specs: `benchmarks/specs/<name>.yaml`, read into a frozen `Spec` and an options object.

A spec file says which benchmark module runs it and with what:

    benchmark: throughput              # benchmarks/<benchmark>.py (dots for subpackages)
    description: one line for RESULTS.md and --list
    overrides: [experiment=h200_1b]    # config overrides of every run
    options: {anchor: true, bare: false}   # the module's own options (its Options dataclass)
    runs:                              # optional: label -> this run's overrides
      bf16: [recipe=bf16]

Each module's command line takes `--spec NAME` (or a path), its options as flags (a flag given there
wins over the spec) and config overrides last (they apply to every run, after the spec's). Bad specs
stop with one line naming the file, the key and the fix (exit code 2), before any run starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import yaml

SPEC_DIR = Path(__file__).resolve().parent / "specs"
KEYS = ("benchmark", "description", "overrides", "options", "runs")


class SpecError(ValueError):
    """A spec file or a benchmark option is wrong; the message names it and the fix."""


@dataclass(frozen=True)
class Spec:
    name: str
    benchmark: str
    """Module under benchmarks/ that runs it (`throughput`, `fidelity.te_vs_emulated`, ...)."""
    description: str = ""
    overrides: tuple[str, ...] = ()
    """Config overrides of every run."""
    options: Mapping = field(default_factory=lambda: MappingProxyType({}))
    """The benchmark module's own options, checked against its Options dataclass."""
    runs: Mapping = field(default_factory=lambda: MappingProxyType({}))
    """label -> that run's config overrides (after `overrides`), in file order."""

    def run_overrides(self, extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
        """label -> the full override list of that run: the spec's, the run's own, then `extra`."""
        return {label: [*self.overrides, *own, *extra] for label, own in self.runs.items()}


def names() -> list[str]:
    """The spec files' names, sorted."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.yaml"))


def _path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        return p
    return SPEC_DIR / f"{name_or_path}.yaml"


def _strings(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{where}: expected a list of override strings like [recipe=bf16], got {value!r}")
    return tuple(value)


def load_spec(name_or_path: str | Path) -> Spec:
    """Read and check the shape of one spec file (its options are checked by `options_for`)."""
    path = _path(name_or_path)
    if not path.exists():
        raise SpecError(f"spec {name_or_path!r}: no such file {path}; choose one of {names()}")
    raw = yaml.safe_load(path.read_text()) or {}
    where = str(path.relative_to(SPEC_DIR.parent.parent)) if path.is_relative_to(SPEC_DIR) else str(path)
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a mapping with keys {KEYS}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {unknown}; a spec has only {KEYS}")
    if not isinstance(raw.get("benchmark"), str):
        raise SpecError(f"{where}: 'benchmark' must name the module that runs it, e.g. benchmark: throughput")
    options, runs = raw.get("options") or {}, raw.get("runs") or {}
    if not isinstance(options, dict) or not isinstance(runs, dict):
        raise SpecError(f"{where}: 'options' and 'runs' must be mappings")
    return Spec(
        name=path.stem,
        benchmark=raw["benchmark"],
        description=str(raw.get("description") or ""),
        overrides=_strings(raw.get("overrides"), f"{where}: overrides"),
        options=MappingProxyType(dict(options)),
        runs=MappingProxyType({str(k): _strings(v, f"{where}: runs.{k}") for k, v in runs.items()}),
    )


def _coerce(value, default, where: str):
    """A spec or CLI value in the type of the option's default (lists for tuples)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise SpecError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(default, tuple):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise SpecError(f"{where}: expected a list, got {value!r}")
        kind = type(default[0]) if default else str
        return tuple(kind(v) for v in items if str(v) != "")
    try:
        return type(default)(value) if default is not None else value
    except (TypeError, ValueError):
        raise SpecError(f"{where}: expected a {type(default).__name__}, got {value!r}") from None


def options_for(cls, values: Mapping, where: str):
    """An Options dataclass instance from a mapping; unknown keys name the known ones."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise SpecError(f"{where}: unknown option(s) {unknown}; this benchmark knows {sorted(fields)}")
    defaults = cls()
    kw = {k: _coerce(v, getattr(defaults, k), f"{where}: option {k}") for k, v in values.items()}
    return dataclasses.replace(defaults, **kw)


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """--spec, --out, --work, one flag per option of `cls`, and trailing config overrides."""
    parser.add_argument("--spec", help=f"a spec name ({', '.join(names())}) or a path to a spec file")
    out = Path(os.environ.get("OUT", "."))
    parser.add_argument(
        "--out", type=Path, default=out, help="folder of the result JSON (default: $OUT or .)"
    )
    parser.add_argument("--work", type=Path, default=None, help="scratch folder for run dirs (default: temp)")
    defaults = cls()
    for f in dataclasses.fields(cls):
        flag, default = "--" + f.name.replace("_", "-"), getattr(defaults, f.name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        text = (f.metadata.get("help") or "") + f" (default: {shown})"
        if isinstance(default, bool):
            flip = argparse.BooleanOptionalAction
            parser.add_argument(flag, dest=f.name, action=flip, default=None, help=text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=text)
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. steps=12")


def from_args(args: argparse.Namespace, cls, benchmark: str) -> tuple[Spec, object]:
    """The spec named by --spec (or an empty one for `benchmark`) with the command line applied."""
    spec = load_spec(args.spec) if args.spec else Spec(name=benchmark.rsplit(".", 1)[-1], benchmark=benchmark)
    if spec.benchmark != benchmark:
        raise SpecError(f"spec {spec.name} is for benchmarks.{spec.benchmark}; run it with that module")
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    given = {k: v for k, v in given.items() if v is not None}
    opts = options_for(cls, {**spec.options, **given}, f"spec {spec.name}")
    return dataclasses.replace(spec, overrides=(*spec.overrides, *args.overrides)), opts


def load_config(overrides: list[str]):
    """A composed, typed, resolved and validated Config (harness.config.load: what every entry point
    trains); raises ConfigError."""
    from harness.validation import load

    return load(list(overrides))


def compose_only(overrides: list[str]):
    """The typed Config without hardware resolution or validation: names and types checked only."""
    from harness.validation import compose_config

    return compose_config(list(overrides))


def machine_tag() -> str:
    """h200, cpu, ... (hardware preset names), or the GPU's name as a slug when no preset matches."""
    from harness.backends.hardware import detect_preset

    tag = detect_preset()
    if tag == "unknown_gpu":
        import torch

        tag = re.sub(r"[^a-z0-9]+", "", torch.cuda.get_device_name().lower())
    return tag


def result_path(out: Path, spec: Spec) -> Path:
    """OUT/<spec>_<machine>_<date>.json, the name benchmarks/results/ keeps it under."""
    return Path(out) / f"{spec.name}_{machine_tag()}_{dt.date.today().isoformat()}.json"


def meta(spec: Spec, opts) -> dict:
    """What every result file starts with: the spec as run, versions, the GPU and the commit."""
    import time

    import torch

    from harness.lifecycle.artifacts import git_state

    return {
        "spec": spec.name,
        "benchmark": spec.benchmark,
        "overrides": list(spec.overrides),
        "options": dataclasses.asdict(opts),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **git_state(),
    }


def write_json(path: Path, obj) -> None:
    """Atomic (NaN as null): a kill while writing leaves the previous version, never half a file."""
    from harness.lifecycle.artifacts import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, obj)


def fail(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


def module(benchmark: str):
    """The benchmark module a spec names: benchmarks.<benchmark>."""
    import importlib

    if not re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", benchmark):
        raise SpecError(f"benchmark {benchmark!r}: expected a module name like throughput or fidelity.grads")
    try:
        return importlib.import_module(f"benchmarks.{benchmark}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("benchmarks"):
            path = f"benchmarks/{benchmark.replace('.', '/')}.py"
            raise SpecError(f"benchmark {benchmark!r}: no module {path}") from None
        raise


def check(spec: Spec, opts, validate: bool = True) -> dict[str, list[str]]:
    """Compose (and with `validate`, resolve and validate) every config the spec's runs will use, before
    any of them starts; returns label -> overrides. A bad name or illegal combination is a SpecError."""
    from harness.validation.rules import ConfigError

    mod = module(spec.benchmark)
    plan = mod.plan(spec, opts)
    if validate and hasattr(mod, "preflight"):  # files the run needs on this machine (e.g. the anchor)
        mod.preflight(spec, opts)
    for label, overrides in plan.items():
        try:
            (load_config if validate else compose_only)(overrides)
        except ConfigError as exc:
            raise SpecError(f"spec {spec.name}, run {label}: {exc}") from None
        except Exception as exc:  # Hydra/OmegaConf: unknown group, key or value type
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            ov = " ".join(overrides)
            raise SpecError(f"spec {spec.name}, run {label}: {first} (overrides: {ov})") from None
    return plan


def cli(mod, argv: list[str] | None) -> int:
    """The command line of one benchmark module: parse, check every config up front, run, write JSON."""
    # the module's import name also under `python -m benchmarks.X`, where __name__ is "__main__"
    full = mod.__spec__.name if getattr(mod, "__spec__", None) else mod.__name__
    name = full.removeprefix("benchmarks.")
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=f"python -m {full}", description=mod.__doc__, formatter_class=raw)
    add_arguments(parser, mod.Options)
    args = parser.parse_args(argv)
    try:
        spec, opts = from_args(args, mod.Options, name)
        check(spec, opts)
    except SpecError as exc:
        return fail(exc)
    path = result_path(args.out, spec)
    work = args.work or Path(tempdir(spec.name))
    print(f"[{spec.name}] results -> {path}", flush=True)
    mod.run(spec, opts, path, work)
    return 0


def tempdir(name: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=f"lowp-{name}-")
