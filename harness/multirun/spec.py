"""Named sweeps (sweeps/NAME.yaml) expanded into an explicit job list, BF16 baselines included.

A sweep file:

    overrides: [model=gpt_125m, steps=2000, ...]   # every job, baselines included
    seeds: [0, 1, 2]
    baseline: [backend=te, recipe=bf16]            # default [recipe=bf16]: one BF16 job per seed, added
    arms:                                          # named low-precision arms, each an override list
      delayed: [backend=te, recipe=delayed]
    grid:                                          # optional: a product of values; each point is an arm
      optimizer: [bf16_states, fp8_states]         # crossed with `arms` when both are given

The older form `params: {recipe: a,b, seed: 0,1}` reads as `grid` plus `seeds`. Every arm runs at every
seed; the BF16 baseline runs at the same seeds with the same fixed overrides, so model, data and token
budget match by construction: an arm may not change them (refused with the key named). A job that
equals a baseline (bf16 listed as an arm) runs once. A malformed file is refused in one line naming the file
and the problem.

Every value lowp puts into an override itself (run directory names, W&B groups, paths) goes through
`hydra_value`, so names and paths with spaces, commas, brackets, quotes, `=` or non-ASCII characters reach
Hydra unchanged.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness import recipes
from harness.config.paths import SWEEPS_DIR

# what makes two runs comparable (analysis groups by hardware, model, data and token budget)
BUDGET_KEYS = ("model", "data", "steps", "global_batch_size", "eval_tokens", "seed", "hardware")
BASELINE_NAME = "bf16"
# the keys of a sweep file and what each holds (params: the older form)
SPEC_KEYS = {
    "overrides": "a list of overrides",
    "seeds": "a list of integers",
    "baseline": "a list of overrides",
    "arms": "a mapping of arm name to a list of overrides",
    "grid": "a mapping of config key to a list of values",
    "params": "a mapping of config key to a comma-separated string",
}


class SweepError(ValueError):
    """A sweep file or its command line is wrong (exit code 2)."""


@dataclass
class Job:
    name: str
    overrides: list[str]
    arm: str
    seed: int
    skip: bool = False
    verdict: str = ""
    warnings: list[str] = field(default_factory=list)


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge(*lists: list[str]) -> list[str]:
    """Overrides in order, a later one replacing an earlier one of the same key (in its place)."""
    out: dict[str, str] = {}
    for ov in itertools.chain(*lists):
        out.pop(key_of(ov), None)
        out[key_of(ov)] = ov
    return list(out.values())


def known_sweeps() -> list[str]:
    return sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))


def spec_path(name: str) -> Path:
    """sweeps/NAME.yaml, or NAME itself when it is a path to a .yaml file (a sweep of your own)."""
    own = Path(name)
    return own if own.suffix == ".yaml" and own.exists() else SWEEPS_DIR / f"{name}.yaml"


def sweep_name(name: str) -> str:
    return Path(name).stem if name.endswith(".yaml") else name


def load_spec(name: str) -> dict:
    path = spec_path(name)
    if not path.exists():
        raise SweepError(f"sweep {name}: no {path}; choose one of {known_sweeps()}")
    spec = check_spec(path, _read_yaml(path))
    params = dict(spec.pop("params", None) or {})
    if params:  # legacy form: `key: a,b` Hydra sweep strings
        if "seed" in params:
            spec.setdefault("seeds", [int(s) for s in str(params.pop("seed")).split(",")])
        grid = spec.setdefault("grid", {})
        for k, v in params.items():
            grid[k] = [x.strip() for x in str(v).split(",")]
    return spec


def _read_yaml(path: Path):
    """The file's content as plain containers (OmegaConf's YAML reading, as Hydra reads configs)."""
    try:
        return OmegaConf.to_container(OmegaConf.load(path))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise SweepError(f"sweep {path}: not valid YAML: {exc.problem or exc.context}{where}") from None
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as exc:
        raise SweepError(f"sweep {path}: not a readable YAML file: {str(exc).splitlines()[0]}") from None


def check_spec(path: Path, spec) -> dict:
    """The sweep file's shape: a mapping of SPEC_KEYS, each of its type; else one line naming the key."""
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise SweepError(f"sweep {path}: expected a mapping with keys {', '.join(SPEC_KEYS)}; got a list")
    for key, value in spec.items():
        if key not in SPEC_KEYS:
            raise SweepError(f"sweep {path}: unknown key `{key}`; the keys are {', '.join(SPEC_KEYS)}")
        if value is not None and not _shaped(key, value):
            raise SweepError(f"sweep {path}: `{key}` must be {SPEC_KEYS[key]}, not {value!r}")
        for arm, overrides in (value or {}).items() if key == "arms" else ():
            if not _is_overrides(overrides):
                raise SweepError(f"sweep {path}: arm `{arm}` must be a list of overrides, not {overrides!r}")
    return spec


def _is_overrides(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value)


def _shaped(key: str, value) -> bool:
    if key in ("overrides", "baseline"):
        return _is_overrides(value)
    if key == "seeds":
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if key == "grid":
        return isinstance(value, dict) and all(not isinstance(v, dict) for v in value.values())
    return isinstance(value, dict)  # arms (each checked by the caller), params


def hydra_value(text: str) -> str:
    """`text` as one Hydra override value that parses back to exactly `text`: as is where it already
    does (`0_bf16_s0`), else single-quoted with the grammar's escapes (a quote and the backslashes before
    it, trailing backslashes) and OmegaConf's (`${`), so `key=<value>` is never a sweep, list or number."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if re.fullmatch(r"[A-Za-z0-9_./-]+", text):
        try:
            if OverridesParser.create().parse_override(f"k={text}").value() == text:
                return text
        except Exception:  # noqa: BLE001 - Hydra's grammar error: quote it
            pass
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    body = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", body)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return f"'{body}'"


def _arms(spec: dict, name: str) -> dict[str, list[str]]:
    arms = {str(k): list(v) for k, v in (spec.get("arms") or {}).items()}
    grid = spec.get("grid") or {}
    if grid:
        keys = list(grid)
        points = [
            (("-".join(str(v) for v in values)), [f"{k}={v}" for k, v in zip(keys, values)])
            for values in itertools.product(
                *(grid[k] if isinstance(grid[k], list) else [grid[k]] for k in keys)
            )
        ]
        if arms:
            arms = {f"{a}-{p}": [*ov, *pov] for a, ov in arms.items() for p, pov in points}
        else:
            arms = dict(points)
    for arm, ovs in arms.items():
        for ov in ovs:
            k = key_of(ov)
            if k.split(".")[0] in BUDGET_KEYS:
                raise SweepError(
                    f"sweep {name}: arm {arm} sets {k}; model, data, hardware, seed and the token budget "
                    "are shared with the BF16 baseline: put it in `overrides` (or `seeds`)"
                )
    return arms


def expand(
    name: str, spec: dict, seeds: list[int] | None = None, extra: list[str] | None = None, tag: str = ""
) -> list[Job]:
    """The job list: every arm at every seed, then one BF16 baseline per seed (unless an arm is one)."""
    seeds = list(seeds if seeds is not None else spec.get("seeds") or [0])
    fixed = list(spec.get("overrides") or [])
    baseline = list(spec.get("baseline") or [f"recipe={BASELINE_NAME}"])
    extra = list(extra or [])
    jobs: list[Job] = []
    seen: set[tuple] = set()
    arms = {BASELINE_NAME: baseline, **_arms(spec, name)}
    for seed in seeds:
        for arm, ovs in arms.items():
            overrides = merge(fixed, ovs, [f"seed={seed}"], extra)
            ident = tuple(sorted(overrides))
            if ident in seen:
                continue
            seen.add(ident)
            jobs.append(Job(name="", overrides=overrides, arm=f"{arm}-{tag}" if tag else arm, seed=seed))
    if not (spec.get("arms") or spec.get("grid")):
        raise SweepError(f"sweep {name}: no `arms` or `grid`: nothing to compare with the BF16 baseline")
    return jobs


def number(jobs: list[Job]) -> list[Job]:
    """Run directory `<num>_<arm>_s<seed>` and W&B name `<arm>-s<seed>` of every job."""
    for num, job in enumerate(jobs):
        job.name = f"{num}_{job.arm}_s{job.seed}"
        job.overrides = [
            *job.overrides,
            f"name={hydra_value(f'{job.arm}-s{job.seed}')}",
            f"hydra.sweep.subdir={hydra_value(job.name)}",
        ]
    return jobs


def split_cli(extra: list[str]) -> tuple[list[int] | None, list[list[str]], list[str], list[str]]:
    """Command-line overrides -> (seeds, swept overrides, fixed overrides, Hydra/launcher overrides)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    seeds, swept, fixed, hydra_args = None, [], [], []
    parser = OverridesParser.create()
    for arg in extra:
        if arg.startswith("hydra.") or arg.startswith("hydra/"):
            hydra_args.append(arg)
            continue
        try:
            (ov,) = parser.parse_overrides([arg])
        except Exception as exc:  # noqa: BLE001 - Hydra's parser error, shown in one line
            raise SweepError(f"override {arg!r}: {str(exc).splitlines()[0]}") from exc
        if not ov.is_sweep_override():
            fixed.append(arg)
        elif ov.get_key_element() == "seed":
            seeds = [int(v) for v in ov.sweep_string_iterator()]
        else:
            swept.append([f"{ov.get_key_element()}={v}" for v in ov.sweep_string_iterator()])
    return seeds, swept, fixed, hydra_args


def build_jobs(name: str, extra: list[str]) -> tuple[list[Job], list[str]]:
    """Jobs of sweep `name` with the command line applied; returns (jobs, Hydra/launcher overrides)."""
    spec = load_spec(name)
    seeds, swept, fixed, hydra_args = split_cli(extra)
    jobs: list[Job] = []
    for point in itertools.product(*swept):  # no swept override: one empty point
        tag = "-".join(p.split("=", 1)[1] for p in point)
        jobs += expand(name, spec, seeds, [*fixed, *point], tag)
    for job in jobs:
        removed = recipes.legacy_in(job.overrides)
        if removed:
            raise SweepError(f"sweep {name}, arm {job.arm}: {removed}")
    return number(jobs), hydra_args


def jobs_text(sweep: str, stamp: str, jobs: list[Job]) -> str:
    """jobs.yaml: the sweep's name and stamp and every job (name, arm, seed, overrides), in launch order."""
    rows = [{"name": j.name, "arm": j.arm, "seed": j.seed, "overrides": j.overrides} for j in jobs]
    return OmegaConf.to_yaml(OmegaConf.create({"sweep": sweep, "stamp": stamp, "jobs": rows}))


def read_jobs(path: Path) -> tuple[str, str, list[Job]]:
    """jobs.yaml read back; a damaged one (unreadable, a job without its fields, jobs not numbered
    0..N-1 in order) is refused, never shortened."""
    try:
        spec = OmegaConf.to_container(OmegaConf.load(path))
        jobs = [
            Job(name=j["name"], overrides=list(j["overrides"]), arm=j["arm"], seed=j["seed"])
            for j in spec["jobs"]
        ]
        ok = isinstance(spec["sweep"], str) and all(
            isinstance(j.name, str) and j.name.startswith(f"{num}_") and _is_overrides(j.overrides)
            for num, j in enumerate(jobs)
        )
    except (OSError, yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise SweepError(f"{path} is damaged ({type(exc).__name__}: {exc}); it is not used") from None
    if not ok or not jobs:
        raise SweepError(
            f"{path} is damaged (its jobs are not numbered 0..N-1 with their overrides); not used"
        )
    return spec["sweep"], str(spec["stamp"]), jobs
