"""lowp analysis: reads run artifacts (never imports the harness) and compares recipes against BF16.

    runs = load_runs(["multirun/2026-01-01/12-00-00"])   # load.py: run dirs and W&B offline runs
    comparison = compare(runs)                           # compare.py: groups, pairing, bands, gaps
    write_report(comparison, "report", inputs)           # report.py: csv, md, html (+ plots.py)

or `python -m analysis.report DIR... [--out OUT]`.
"""

from analysis.compare import COLUMNS, Comparison, compare
from analysis.load import Run, RunWarning, load_numerics, load_runs


def __getattr__(name: str):
    # report.py is imported on first use, so `python -m analysis.report` runs it only once.
    if name in ("main", "print_table", "write_report"):
        from analysis import report

        return getattr(report, name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")


__all__ = [
    "COLUMNS",
    "Comparison",
    "Run",
    "RunWarning",
    "compare",
    "load_numerics",
    "load_runs",
    "main",
    "print_table",
    "write_report",
]
