"""Pack every run directory under DIR into one JSON file: summary, provenance and loss curves.

    python -m analysis.collect DIR OUT.json

For shipping results off a machine that returns few files (a GPU node's job output, a device's
result folder): one file holds what analysis and benchmarks/RESULTS.md need from each run. Rows that
do not parse (a torn last line of a killed run) are skipped, as analysis.load does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from analysis import keys as K

PROVENANCE = ("backend", "recipe_repr", "te", "torch", "gpu_name", "git_sha", "hardware")


def _rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _curve(rows: list[dict], key: str) -> list[list]:
    return [[r[K.STEP], r[key]] for r in rows if r.get(key) is not None and K.STEP in r]


def collect_run(run_dir: Path) -> dict:
    """One run directory's summary (None if the run has none yet), provenance and curves."""
    cfg = json.loads((run_dir / K.RUN_JSON).read_text())
    summary_path = run_dir / K.SUMMARY_JSON
    metrics = _rows(run_dir / K.METRICS_JSONL)
    return {
        "summary": json.loads(summary_path.read_text()) if summary_path.exists() else None,
        "provenance": {k: cfg.get("provenance", {}).get(k) for k in PROVENANCE},
        "train": _curve(metrics, K.LOSS_TRAIN),
        "eval": _curve(metrics, K.LOSS_EVAL),
    }


def collect(root: Path) -> dict:
    """Every run directory below `root` (found by its run.json), keyed by its path relative to root."""
    root = Path(root)
    return {str(p.parent.relative_to(root)): collect_run(p.parent) for p in sorted(root.rglob(K.RUN_JSON))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=Path, help="a directory holding run directories (at any depth)")
    p.add_argument("out", type=Path, help="the JSON file to write")
    args = p.parse_args(argv)
    if not args.root.is_dir():
        msg = f"error: {args.root}: not a directory; pass the folder that holds the run directories"
        print(msg, file=sys.stderr)
        return 2
    result = collect(args.root)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"collected {len(result)} runs into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
