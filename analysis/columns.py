"""Logged rows as columns: train and eval columns sorted by step, one numpy array per metric key.

Both readers end here: a run directory's metrics.jsonl (`reader.py`, by rows or by pyarrow's columns)
and a W&B offline run's history records (`wandb_offline.py`), so a run reads the same from either.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from analysis import keys as K


def _columns(rows: list[dict[str, Any]], keys: list[str]) -> dict[str, np.ndarray]:
    cols = {}
    for k in keys:
        vals = [r.get(k) for r in rows]
        try:
            cols[k] = np.array(vals, dtype=float)  # JSON null -> NaN
        except (TypeError, ValueError):
            cols[k] = np.array([v if isinstance(v, (int, float)) else math.nan for v in vals], dtype=float)
    return cols


def _sorted_by_step(cols: dict[str, np.ndarray], what: str, issues: list[str]) -> dict[str, np.ndarray]:
    """Sort by step and merge rows of the same step: per key, the last non-NaN value wins.

    Repeated steps come from a resumed run (the later row counts) or from rows that carry only some
    keys of a step (e.g. telemetry summaries logged apart from the losses).
    """
    step = cols[K.STEP]
    if len(step) < 2 or np.all(np.diff(step) > 0):
        return cols
    order = np.argsort(step, kind="stable")
    starts = np.flatnonzero(np.diff(step[order], prepend=-np.inf) != 0)
    idx = np.arange(len(step))
    out = {}
    clashes = 0
    for k, v in cols.items():
        v = v[order]
        finite = np.isfinite(v)
        last = np.maximum.reduceat(np.where(finite, idx, -1), starts)
        out[k] = np.where(last >= 0, v[np.maximum(last, 0)], np.nan)
        if k in (K.LOSS_TRAIN, K.LOSS_EVAL):
            clashes += int((np.add.reduceat(finite.astype(int), starts) > 1).sum())
    if clashes:
        issues.append(
            f"{what}: {clashes} step(s) logged more than once (resumed run?); kept the later values"
        )
    return out


def rows_to_columns(
    rows: list[dict[str, Any]], what: str, issues: list[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Split logged rows into train and eval columns, sorted by step (the last row wins a repeated step).

    Eval rows are those with `loss/eval`; a row with `loss/train` too is in both. Rows without a
    numeric step and tokens are skipped (they cannot be placed on the x-axis).
    """
    keys = set().union(*map(dict.keys, rows)) if rows else set()
    keys = sorted(k for k in keys | {K.STEP, K.TOKENS} if not k.startswith(K.NUMERICS_PREFIX))
    cols = _columns(rows, keys)
    present = {k: np.array([k in r for r in rows], dtype=bool) for k in (K.LOSS_TRAIN, K.LOSS_EVAL)}
    return train_eval(cols, present, len(rows), what, issues)


def train_eval(
    cols: dict[str, np.ndarray], present: dict[str, np.ndarray], n: int, what: str, issues: list[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Train and eval columns from all rows' columns; `present[key]`: rows that hold that loss key."""
    ok = np.isfinite(cols[K.STEP]) & np.isfinite(cols[K.TOKENS])
    if not ok.all():
        issues.append(f"{what}: skipped {int((~ok).sum())} row(s) without numeric step and tokens")
    none = np.zeros(n, bool)
    has_eval = np.isfinite(cols[K.LOSS_EVAL]) if K.LOSS_EVAL in cols else none
    has_train = present.get(K.LOSS_TRAIN, none)
    is_eval = present.get(K.LOSS_EVAL, none)
    tr, ev = ok & (has_train | ~is_eval), ok & is_eval & has_eval
    train = {k: v[tr] for k, v in cols.items() if k != K.LOSS_EVAL}
    ev_cols = {
        k: cols[k][ev] if k in cols else np.zeros(int(ev.sum())) for k in (K.STEP, K.TOKENS, K.LOSS_EVAL)
    }
    return _sorted_by_step(train, what, issues), _sorted_by_step(ev_cols, f"{what} (eval)", issues)
