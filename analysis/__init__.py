"""lowp analysis: reads run artifacts (never imports the harness) and compares recipes against BF16.

    from analysis import compare, load, report
    runs = load.load_runs(["multirun/2026-01-01/12-00-00"])  # run dirs and W&B offline runs
    comparison = compare.compare(runs)                       # groups, pairing, bands, gaps, speed
    report.write_report(comparison, "report", inputs)        # csv, md, self-contained html, plots

or `python -m analysis.report DIR... [--out OUT]`. Modules: keys (artifact names), load, compare,
plots, report, wandb_offline, bench_load. Submodules are not re-exported as functions here, so
`analysis.compare` is always the module.
"""
