"""Numerics telemetry (numerics.jsonl), read only for the layer x tensor heatmaps."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from analysis import keys as K
from analysis.load import parse_jsonl
from analysis.run import Run, RunWarning


def load_numerics(run: Run) -> list[dict[str, Any]]:
    """Telemetry rows of numerics.jsonl; without that file, the `numerics/<layer>/<tensor>/<stat>`
    summaries of metrics.jsonl, as rows of the same shape. Empty when there is no telemetry."""
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
