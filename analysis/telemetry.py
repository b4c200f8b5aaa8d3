"""Numerics telemetry (numerics.jsonl): rows per run, per-arm cells for the heatmaps, outliers in words."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import keys as K
from analysis.reader import parse_jsonl
from analysis.run import Run, RunWarning


def load_numerics(run: Run) -> list[dict[str, Any]]:
    """Telemetry rows of the operands the run quantized (numerics.jsonl, counterfactual candidates'
    rows left out: `load_counterfactual`); without that file, the `numerics/<layer>/<tensor>/<stat>`
    summaries of metrics.jsonl, as rows of the same shape. Empty when there is no telemetry."""
    return [r for r in _load_rows(run) if K.TELEMETRY_CANDIDATE not in r]


def load_counterfactual(run: Run) -> list[dict[str, Any]]:
    """The counterfactual rows of numerics.jsonl (telemetry.candidates): each names its candidate."""
    return [r for r in _load_rows(run) if r.get(K.TELEMETRY_CANDIDATE) is not None]


def _load_rows(run: Run) -> list[dict[str, Any]]:
    issues: list[str] = []
    rows: list[dict[str, Any]] = []
    npath = Path(run.path) / K.NUMERICS_JSONL
    if npath.exists():
        rows = [r for r in parse_jsonl(npath, issues) if "layer" in r and "tensor" in r]
    elif (Path(run.path) / K.METRICS_JSONL).exists():
        by_key: dict[tuple, dict[str, Any]] = {}
        for r in parse_jsonl(Path(run.path) / K.METRICS_JSONL, issues):
            for k, v in r.items():
                if not k.startswith(K.NUMERICS_PREFIX):
                    continue
                parts = k[len(K.NUMERICS_PREFIX) :].split("/")
                if len(parts) < 3:
                    continue
                # Layer names may hold '/', tensor and stat never do.
                layer, tensor, stat = "/".join(parts[:-2]), parts[-2], parts[-1]
                key = (r.get(K.STEP), layer, tensor)
                by_key.setdefault(key, {"step": key[0], "layer": layer, "tensor": tensor})[stat] = v
        rows = list(by_key.values())
    for msg in issues:
        warnings.warn(f"run {run.name}: {msg}", RunWarning, stacklevel=2)
    return rows


def numerics_matrix(rows: list[dict[str, Any]], stat: str) -> tuple[list[str], list[str], np.ndarray]:
    """(layers in module order, tensors, mean of `stat` over telemetry steps) as a layer x tensor matrix."""
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    tensors = [t for t in K.TELEMETRY_TENSORS if any(r["tensor"] == t for r in rows)]
    tensors += sorted({r["tensor"] for r in rows} - set(tensors))
    li, ti = {name: i for i, name in enumerate(layers)}, {name: i for i, name in enumerate(tensors)}
    total = np.zeros((len(layers), len(tensors)))
    count = np.zeros_like(total)
    for r in rows:
        v = r.get(stat)
        if isinstance(v, (int, float)) and math.isfinite(v):
            total[li[r["layer"]], ti[r["tensor"]]] += v
            count[li[r["layer"]], ti[r["tensor"]]] += 1
    with np.errstate(invalid="ignore"):
        return layers, tensors, np.where(count > 0, total / np.maximum(count, 1), np.nan)


def group_cells(group, numerics: pd.DataFrame) -> pd.DataFrame:
    """Mean of every telemetry statistic per (arm, layer, tensor) over telemetry steps and seeds, for
    the low-precision arms of a compared group; `arm` is the arm's label."""
    labels = {r.name: a.name for a in group.arms if a.recipe != K.BASELINE_RECIPE for r in a.runs}
    df = numerics[numerics["run"].isin(labels)] if len(numerics) else numerics
    if not len(df):
        return pd.DataFrame(columns=["arm", K.TELEMETRY_LAYER, K.TELEMETRY_TENSOR, *K.TELEMETRY_STATS])
    df = df.assign(arm=df["run"].map(labels))
    stats = [s for s in K.TELEMETRY_STATS if s in df]
    df[stats] = df[stats].apply(pd.to_numeric, errors="coerce")
    return df.groupby(["arm", K.TELEMETRY_LAYER, K.TELEMETRY_TENSOR], sort=False, as_index=False)[
        stats
    ].mean()


OUTLIER_RULES = (
    ("underflow", 0.01, "flushes {span} of {tensor} elements to zero in {n} of {of} layers"),
    ("saturation", 0.001, "puts {span} of {tensor} elements at the largest code in {n} of {of} layers"),
)
"""(stat, threshold, sentence): a cell at or above the threshold (1% underflow, 0.1% saturation) is an
outlier: a fraction that large changes the arithmetic of the GEMM that consumes it."""
SQNR_LOW_DB = 15.0
"""Below ~15 dB the quantization noise is > 3% of the signal's RMS."""


def outliers(cells: pd.DataFrame) -> list[str]:
    """Sentences such as 'nvfp4 (emulated) flushes 6.1%-22% of grad elements to zero in 12 of 12 layers'."""
    out = []
    if not len(cells):
        return out
    for (arm, tensor), df in cells.groupby(["arm", K.TELEMETRY_TENSOR], sort=False):
        of = df[K.TELEMETRY_LAYER].nunique()
        for stat, threshold, text in OUTLIER_RULES:
            v = pd.to_numeric(df.get(stat), errors="coerce") if stat in df else None
            if v is None:
                continue
            hit = v[v >= threshold]
            if len(hit):
                lo, hi = _pct(hit.min()), _pct(hit.max())
                span = lo if lo == hi else f"{lo}-{hi}"
                out.append(f"{arm} " + text.format(span=span, tensor=tensor, n=len(hit), of=of))
        if "sqnr_db" in df:
            q = pd.to_numeric(df["sqnr_db"], errors="coerce")
            low = q[q < SQNR_LOW_DB]
            if len(low):
                out.append(f"{arm} {tensor}: SQNR {low.min():.1f}-{low.max():.1f} dB (< {SQNR_LOW_DB:g} dB) "
                           f"in {len(low)} of {of} layers")  # fmt: skip
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.2g}%"
