"""lowp analysis: reads run artifacts (never imports the harness) and compares recipes against BF16.

    from analysis import compare, load, report
    runs = load.load_runs(["multirun/2026-01-01/12-00-00"])  # run dirs and W&B offline runs
    comparison = compare.compare(runs)                       # groups, pairing, bands, gaps, speed
    report.write_report(comparison, "report", inputs)        # csv, md, self-contained html, plots

or `python -m analysis.report DIR... [--out OUT]`. One job per module: keys (the artifact contract's
names), run (one run's fields), load (discovery, robust reading), wandb_offline (.wandb files),
curves (smoothing, crossings, wall time), compare (groups, pairing, bands, rows), telemetry
(numerics.jsonl), plots, report (CLI), bench_load (the 200-run benchmark). Functions are not
re-exported here, so `analysis.compare` is always the module.
"""
