"""lowp analysis: reads run artifacts (never imports the harness) and compares recipes against BF16.

    import analysis
    runs = analysis.load(["multirun/2026-01-01/12-00-00"])  # run dirs and W&B offline runs
    runs.runs, runs.curves, runs.numerics                   # pandas DataFrames
    table = analysis.compare(runs)                          # one row per arm: verdict, gap [95% CI], ...

or `python -m analysis.report DIR... [--out OUT] [--wandb]`. One job per module: keys (the artifact
contract's names), run (one run's fields), reader (discovery, robust reading), columns (logged rows
as train/eval columns), wandb_offline (.wandb files), frames (the DataFrames, `load`, `compare`), curves
(smoothing, crossings, wall time), stats (t intervals, minimum detectable gap, verdicts), pairing
(groups, baselines, arms, pairing by seed, rows), telemetry (numerics rows, outliers in words), plots,
report (CLI, HTML/Markdown through jinja2), wandb_report (the comparison as a W&B table and artifact);
collect and seed_band (packed curves, for machines that return few files).

`load`, `compare` and `Runs` are imported on first use, so the modules that need only the standard
library and numpy (keys, collect, seed_band) load without pandas or scipy, as on a GPU node.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Runs", "compare", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from analysis import frames

        return getattr(frames, name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")
