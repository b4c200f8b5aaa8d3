"""Find run directories and read their artifacts, keeping going past broken ones.

A run directory is any directory holding `run.json`; W&B offline runs (`offline-run-*/run-*.wandb`) that
live outside every run directory are read too (`wandb_offline.py`); both turn their rows into columns
with `columns.py`. Nothing is dropped silently: every problem becomes a `RunWarning` naming the run and
what was skipped, and stays in `Run.issues` for the report. `numerics.jsonl` is not read here: only
`telemetry.py` reads it, for the heatmaps.
"""

from __future__ import annotations

import json
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from analysis import keys as K
from analysis.columns import rows_to_columns, train_eval
from analysis.run import Run, RunWarning
from analysis.wandb_offline import read_offline_run

_SKIP_DIRS = {"checkpoints", ".hydra", "__pycache__", ".git"}
PARALLEL_MIN_BYTES = 64 * 2**20
"""metrics.jsonl bytes below which a process pool costs more than it saves: pyarrow parses ~100 MiB/s
a core and the columns are pickled back, so 20 MiB of runs took 0.13 s in one process and 0.18 s in
two (12 fixture runs: 3 ms and 65 ms)."""


# --- discovery ------------------------------------------------------------------------------------


def discover(paths: list[str | os.PathLike]) -> tuple[list[Path], list[Path]]:
    """Run directories (holding run.json) and W&B offline files outside them, under `paths`."""
    run_dirs: list[Path] = []
    wandb_files: list[Path] = []
    for root in map(Path, paths):
        if root.is_file() and root.suffix == ".wandb":
            wandb_files.append(root)
            continue
        if not root.is_dir():
            raise FileNotFoundError(f"no such directory: {root}")
        for dirpath, dirnames, filenames in os.walk(root):
            if K.RUN_JSON in filenames:
                run_dirs.append(Path(dirpath))
                dirnames[:] = []  # a run's wandb/ and checkpoints/ belong to it
                continue
            wb = sorted(f for f in filenames if f.startswith("run-") and f.endswith(".wandb"))
            if wb:
                wandb_files.extend(Path(dirpath) / f for f in wb)
                dirnames[:] = []
                continue
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    return sorted(set(run_dirs)), sorted(set(wandb_files))


def _run_name(path: Path, roots: list[Path]) -> str:
    for root in roots:
        try:
            rel = path.resolve().relative_to(root.resolve())
        except ValueError:
            continue
        prefix = root.resolve().name if len(roots) > 1 else ""
        parts = [p for p in (prefix, rel.as_posix()) if p and p != "."]
        return "/".join(parts) or root.resolve().name
    return path.as_posix()


# --- reading --------------------------------------------------------------------------------------


def _read_json(path: Path, what: str, issues: list[str]) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        issues.append(f"{what} unreadable ({type(e).__name__}: {e}); skipped")
        return None
    if not isinstance(obj, dict):
        issues.append(f"{what} is not a JSON object; skipped")
        return None
    return obj


def parse_jsonl(path: Path, issues: list[str]) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; bad lines are skipped and counted in `issues`.

    The whole file is parsed in one `json.loads` call (an array of the lines): several times faster
    than one call per line. Only when that fails is it parsed line by line, to find the bad lines.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    try:
        rows = json.loads("[" + ",".join(lines) + "]")
    except ValueError:
        rows, bad = [], []
        for i, ln in enumerate(lines, 1):
            try:
                rows.append(json.loads(ln))
            except ValueError:
                bad.append(i)
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        issues.append(f"{path.name}: skipped {len(bad)} unparseable line(s) (non-empty line {shown})")
    good = [r for r in rows if isinstance(r, dict)]
    if len(good) != len(rows):
        issues.append(f"{path.name}: skipped {len(rows) - len(good)} line(s) that are not JSON objects")
    return good


def read_metrics(path: Path, issues: list[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train columns, eval columns) of a metrics.jsonl; `numerics/...` keys are not kept.

    A file of plain numeric rows is parsed by pyarrow's JSON reader straight into columns (several
    times faster than Python dicts); anything else (bad lines, nulls, strings, nested values, or no
    pyarrow) takes the row-by-row path, which gives the same columns and names what it skipped.
    """
    fast = _arrow_columns(path.read_bytes())
    if fast is None:
        return rows_to_columns(parse_jsonl(path, issues), path.name, issues)
    cols, present = fast
    return train_eval(cols, present, len(cols[K.STEP]), path.name, issues)


def _arrow_columns(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """(float columns, rows holding each loss key) of a JSON-lines text read by pyarrow, or None
    where the row path must decide.

    None when some value is null (the row path tells a null from an absent key, which decides train
    and eval rows; here both are arrow nulls) or not a number, when a line is not a JSON object, or
    without pyarrow. Absent keys become NaN, as in the row path.
    """
    if not data.strip() or b"null" in data:
        return None
    try:
        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        return None
    try:
        table = pj.read_json(pa.BufferReader(data))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    cols, present = {}, {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        if name.startswith(K.NUMERICS_PREFIX):
            continue
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            return None
        cols[name] = col.to_numpy().astype(float, copy=False)
        if name in (K.LOSS_TRAIN, K.LOSS_EVAL):
            present[name] = ~col.is_null().to_numpy(zero_copy_only=False)
    for k in (K.STEP, K.TOKENS):
        cols.setdefault(k, np.full(table.num_rows, np.nan))
    return dict(sorted(cols.items())), present


def read_run_dir(path: str | os.PathLike, name: str | None = None) -> Run:
    """Read one run directory. Never raises for broken artifacts: see `Run.issues`."""
    path = Path(path)
    issues: list[str] = []
    rj = _read_json(path / K.RUN_JSON, K.RUN_JSON, issues) or {}
    summary = _read_json(path / K.SUMMARY_JSON, K.SUMMARY_JSON, issues)
    if summary is None and not (path / K.SUMMARY_JSON).exists():
        issues.append("no summary.json: reported as incomplete")
    train: dict[str, np.ndarray] = {K.STEP: np.zeros(0), K.TOKENS: np.zeros(0)}
    ev: dict[str, np.ndarray] = {K.STEP: np.zeros(0), K.TOKENS: np.zeros(0), K.LOSS_EVAL: np.zeros(0)}
    mp = path / K.METRICS_JSONL
    if mp.exists():
        try:
            train, ev = read_metrics(mp, issues)
        except OSError as e:
            issues.append(f"metrics.jsonl unreadable ({e}); no curves")
    else:
        issues.append("no metrics.jsonl: no curves")
    config = rj.get("config") if isinstance(rj.get("config"), dict) else {}
    prov = rj.get("provenance") if isinstance(rj.get("provenance"), dict) else {}
    wb = rj.get("wandb") if isinstance(rj.get("wandb"), dict) else None
    extra = {k: v for k, v in rj.items() if k not in ("config", "provenance", "wandb")}
    return Run(path, name or path.name, config, prov, wb, summary, train, ev, issues, extra=extra)


def _read_many(args: list[tuple[Path, str]]) -> list[Run]:
    return [read_run_dir(p, n) for p, n in args]


def load_runs(paths: list[str | os.PathLike] | str | os.PathLike, *, workers: int | None = None) -> list[Run]:
    """Every run under `paths` (run directories, then W&B offline runs not already loaded).

    Each problem is warned about (`RunWarning`) and kept in `Run.issues`. Runs are read in `workers`
    processes; by default, all cores where the metrics files add up to PARALLEL_MIN_BYTES, else this
    process alone.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    roots = [Path(p) for p in paths]
    run_dirs, wandb_files = discover(roots)
    jobs = [(p, _run_name(p, roots)) for p in run_dirs]
    if workers is None:
        size = sum((p / K.METRICS_JSONL).stat().st_size for p in run_dirs if (p / K.METRICS_JSONL).is_file())
        workers = (os.cpu_count() or 1) if size >= PARALLEL_MIN_BYTES else 1
    if workers > 1 and len(jobs) > 1:
        chunks = [jobs[i::workers] for i in range(workers)]
        with ProcessPoolExecutor(workers) as ex:
            runs = [r for part in ex.map(_read_many, chunks) for r in part]
    else:
        runs = _read_many(jobs)
    known_ids = {r.wandb.get("run_id") for r in runs if r.wandb}
    if wandb_files:
        from_wandb: dict[str, int] = {}
        for f in wandb_files:
            run = read_offline_run(f, name=_run_name(f.parent, roots))
            if (run.wandb or {}).get("job_type") == "analysis":
                continue  # the report's own W&B run (`lowp-report --wandb`), not a training run
            rid = (run.wandb or {}).get("run_id")
            if rid and rid in from_wandb and run.config and not runs[from_wandb[rid]].config:
                runs[from_wandb[rid]] = run  # the run itself, found after a resumed file of its id
                continue
            if rid and rid in known_ids:
                continue  # the same run, read from its run directory or a resumed file of its id
            known_ids.add(rid)
            if rid:
                from_wandb[rid] = len(runs)
            runs.append(run)
    runs.sort(key=lambda r: r.name)
    for r in runs:
        for msg in r.issues:
            warnings.warn(f"run {r.name}: {msg}", RunWarning, stacklevel=2)
    return runs
