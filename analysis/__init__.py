"""lowp analysis: reads run artifacts (never imports the harness) and compares recipes against BF16.

    import analysis
    runs = analysis.load(["multirun/2026-01-01/12-00-00"])  # run dirs and W&B offline runs
    runs.runs, runs.curves, runs.numerics                   # pandas DataFrames
    table = analysis.compare(runs)                          # one row per arm: verdict, gap [95% CI], ...

or `python -m analysis.report DIR... [--out OUT] [--wandb]`. One job per module: keys (the artifact
contract's names), run (one run's fields), reader (discovery, robust reading), wandb_offline (.wandb
files), frames (the DataFrames, `load`, `compare`), curves (smoothing, crossings, wall time), stats
(t intervals, minimum detectable gap, verdicts), pairing (groups, baselines, pairing by seed, rows),
telemetry (numerics rows, outliers in words), plots, report (CLI, HTML/Markdown through jinja2),
wandb_report (the comparison as a W&B table and artifact).
"""

from analysis.frames import Runs, compare, load

__all__ = ["Runs", "compare", "load"]
