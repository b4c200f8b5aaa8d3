"""The DataFrames every analysis product is built from: `load(paths) -> Runs`, `compare(runs)`.

    import analysis
    runs = analysis.load(["multirun/2026-01-01/12-00-00"])  # run dirs and W&B offline runs
    runs.runs       # one row per run: status, backend, hardware, versions, config.*, summary fields
    runs.curves     # long format: run, step, tokens, metric, value (NaN-free)
    runs.numerics   # telemetry rows: run, recipe, recipe_label, step, layer, tensor, amax, underflow, ...
    analysis.compare(runs)  # one row per (group, recipe label, variant, backend): verdict, gap [CI], ...

`recipe` is the numerics family (bf16, delayed, tensorwise, ...); `recipe_label` is the family and the
recipe fields that differ from its preset (e.g. `tensorwise + fast accumulation`), the arm's name.

`Runs.objects` keeps the `Run` records the frames were made from, for `pairing.compare`, which does the
grouping, pairing and intervals; the report, the CSVs and the notebook read the frames below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from analysis import keys as K
from analysis import pairing
from analysis.reader import load_runs
from analysis.run import Run

CURVE_METRICS = (K.LOSS_TRAIN, K.LOSS_EVAL, K.LR, K.GRAD_NORM, K.STEP_MS, K.TOKENS_PER_S, K.PEAK_MEM_GIB)
"""Metrics of `Runs.curves` by default; `load(..., metrics=None)` keeps every logged metric."""

_RUN_FIELDS = ("name", "status", "recipe", "recipe_label", "variant", "backend", "hardware", "model", "data",
               "seed", "steps", "token_budget", "final_eval_loss", "tokens_per_s", "peak_mem_gib",
               "loss_floor", "source")  # fmt: skip
_VERSIONS = ("torch", "te", "cuda", "gpu_name", "python", "git_sha", "git_dirty")


@dataclass
class Runs:
    """Runs as DataFrames. `numerics` is read on first use (numerics.jsonl can be large)."""

    objects: list[Run]
    runs: pd.DataFrame
    curves: pd.DataFrame
    issues: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.objects)

    @cached_property
    def numerics(self) -> pd.DataFrame:
        return numerics_frame(self.objects)

    @cached_property
    def comparison(self) -> pairing.Comparison:
        """The grouped comparison (groups, baselines, per-arm bands) that `compare` tabulates."""
        return pairing.compare(self.objects)


def load(paths, *, metrics: tuple[str, ...] | None = CURVE_METRICS, workers: int | None = None) -> Runs:
    """Every run under `paths` (directories or `.wandb` files) as DataFrames; see `Runs`."""
    objects = load_runs(paths, workers=workers)
    return Runs(objects, runs_frame(objects), curves_frame(objects, metrics),
                [f"run {r.name}: {m}" for r in objects for m in r.issues])  # fmt: skip


def runs_frame(objects: list[Run]) -> pd.DataFrame:
    """One row per run: the fields analysis uses, provenance versions, the summary and `config.*`."""
    recs = []
    for r in objects:
        rec = {f: getattr(r, f) for f in _RUN_FIELDS}
        rec["run"] = rec.pop("name")
        rec["final_train_loss"] = r.summary_number("final_train_loss")
        rec["wall_time_s"] = r.summary_number("wall_time_s")
        rec["diverged_step"] = (r.summary or {}).get("diverged_step")
        rec["divergence_cause"] = (r.summary or {}).get("divergence_cause")
        rec["config_warnings"] = "; ".join(r.config_warnings)
        rec["path"] = str(r.path)
        rec.update({f"version.{v}": r.provenance.get(v) for v in _VERSIONS})
        rec.update({f"config.{k}": v for k, v in _flatten(r.config).items()})
        recs.append(rec)
    df = pd.DataFrame.from_records(recs)
    return df if len(df) else pd.DataFrame(columns=["run", *_RUN_FIELDS[1:]])


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if not isinstance(v, list) else str(v)
    return out


def curves_frame(objects: list[Run], metrics: tuple[str, ...] | None = CURVE_METRICS) -> pd.DataFrame:
    """Long format (run, step, tokens, metric, value), NaN values dropped; `run` and `metric` categorical.

    Built from each run's numpy columns by one concatenation per column, cast on the way, and handed
    to pandas without a copy: 200 runs x 10,000 steps (12M rows) take well under a second.
    """
    parts = []
    for r in objects:
        for cols in (r.train, r.eval):
            for key, vals in cols.items():
                if key in (K.STEP, K.TOKENS) or (metrics is not None and key not in metrics):
                    continue
                ok = np.isfinite(vals)
                if ok.all():
                    parts.append((r.name, key, cols[K.STEP], cols[K.TOKENS], vals))
                elif ok.any():
                    parts.append((r.name, key, cols[K.STEP][ok], cols[K.TOKENS][ok], vals[ok]))
    if not parts:
        return pd.DataFrame({"run": pd.Categorical([]), "step": np.zeros(0, np.int64),
                             "tokens": np.zeros(0, np.int64), "metric": pd.Categorical([]),
                             "value": np.zeros(0)})  # fmt: skip
    names = list(dict.fromkeys(p[0] for p in parts))
    mets = list(dict.fromkeys(p[1] for p in parts))
    sizes = [len(p[2]) for p in parts]

    def codes(labels: list[str], of: int) -> np.ndarray:
        index = {v: i for i, v in enumerate(labels)}
        dtype = np.int8 if len(labels) < 2**7 else np.int16 if len(labels) < 2**15 else np.int32
        return np.repeat(np.array([index[p[of]] for p in parts], dtype=dtype), sizes)

    def column(of: int, dtype: type) -> np.ndarray:
        return np.concatenate([p[of] for p in parts], dtype=dtype, casting="unsafe")

    return pd.DataFrame({
        "run": pd.Categorical.from_codes(codes(names, 0), names),
        "step": column(2, np.int64),
        "tokens": column(3, np.int64),
        "metric": pd.Categorical.from_codes(codes(mets, 1), mets),
        "value": column(4, np.float64),
    }, copy=False)  # fmt: skip


def numerics_frame(objects: list[Run]) -> pd.DataFrame:
    """Telemetry rows of every run (numerics.jsonl, else the `numerics/...` keys of metrics.jsonl)."""
    from analysis.telemetry import load_numerics

    frames = []
    for r in objects:
        rows = load_numerics(r)
        if rows:
            df = pd.DataFrame.from_records(rows)
            df.insert(0, "run", r.name)
            df.insert(1, "recipe", r.recipe)
            df.insert(2, "recipe_label", r.recipe_label)
            df.insert(3, "variant", r.variant)
            df.insert(4, "backend", r.backend)
            df.insert(5, "seed", r.seed)
            frames.append(df)
    cols = ["run", "recipe", "recipe_label", "variant", "backend", "seed", "step", K.TELEMETRY_LAYER,
            K.TELEMETRY_TENSOR, *K.TELEMETRY_STATS]  # fmt: skip
    if not frames:
        return pd.DataFrame(columns=cols)
    df = pd.concat(frames, ignore_index=True)
    for c in cols:
        if c not in df:
            df[c] = np.nan
    return df


def compare(runs: Runs | list[Run], *, smooth_frac: float = pairing.SMOOTH_FRAC) -> pd.DataFrame:
    """The comparison: one row per arm of every group, columns `pairing.COLUMNS` (verdict, gap [CI])."""
    comp = comparison_of(runs, smooth_frac)
    return comparison_frame(comp)


def comparison_of(runs: Runs | list[Run], smooth_frac: float = pairing.SMOOTH_FRAC) -> pairing.Comparison:
    objects = runs.objects if isinstance(runs, Runs) else list(runs)
    if isinstance(runs, Runs) and smooth_frac == pairing.SMOOTH_FRAC:
        return runs.comparison
    return pairing.compare(objects, smooth_frac=smooth_frac)


def comparison_frame(comp: pairing.Comparison) -> pd.DataFrame:
    return pd.DataFrame.from_records(comp.rows, columns=list(pairing.COLUMNS))


def gap_curves(comp: pairing.Comparison) -> pd.DataFrame:
    """Long format of every arm's relative gap along tokens with its interval: group, recipe,
    recipe_label, variant, backend, metric (`loss/train` smoothed or `loss/eval`), tokens, gap_rel,
    gap_rel_lo, gap_rel_hi."""
    recs = []
    for g in comp.groups:
        for a in g.arms:
            for metric, band in ((K.LOSS_TRAIN, a.train_band), (K.LOSS_EVAL, a.eval_band)):
                if band is None:
                    continue
                recs.append(pd.DataFrame({
                    "group": str(g.key), "recipe": a.recipe, "recipe_label": a.recipe_label,
                    "variant": a.variant, "backend": a.backend,
                    "metric": metric, "tokens": band["tokens"], "gap_rel": band["mean"],
                    "gap_rel_lo": band["lo"], "gap_rel_hi": band["hi"],
                }))  # fmt: skip
    cols = [
        "group",
        "recipe",
        "recipe_label",
        "variant",
        "backend",
        "metric",
        "tokens",
        "gap_rel",
        "gap_rel_lo",
        "gap_rel_hi",
    ]
    return pd.concat(recs, ignore_index=True) if recs else pd.DataFrame(columns=cols)


def sweep_paths(value: str) -> list[str]:
    """A notebook/CLI parameter holding one or several directories (separated by os.pathsep)."""
    return [p for p in value.split(os.pathsep) if p]
