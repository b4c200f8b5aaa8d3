"""`python -m analysis.report DIR... [--out OUT] [--wandb]`: comparison.csv, runs.csv, gaps.csv,
report.md and a self-contained report.html (and moe.csv for MoE runs), all built from the DataFrames
of `analysis.frames`.

The first screen answers "which recipe?": per hardware/model group, one sentence and a table ranked by
verdict (worse / indistinguishable / better than BF16, with the 95% interval and the minimum detectable
gap), for MoE runs the load balance against BF16's seed band and the worst expert (`analysis.moe`),
then the speed-vs-gap chart of native runs; curves, telemetry, method and runs follow. The same
context renders through jinja2 twice: HTML (figures embedded as base64 PNG) and Markdown (next to them).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from analysis import keys as K
from analysis import stats as S
from analysis.frames import Runs, comparison_frame, gap_curves, load
from analysis.pairing import EARLY_FRAC, GRID_POINTS, PUBLIC_ANCHORS, SMOOTH_FRAC, Comparison, Group
from analysis.reader import RunWarning
from analysis.report_text import (
    decision,
    empty_columns,
    fmt_tokens,
    job_order,
    row_name,
    status_counts,
    telemetry_absent,
)

# --- cells -----------------------------------------------------------------------------------------


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ci(row: pd.Series, col: str, fmt: str, scale: float = 1.0, suffix: str = "") -> str | None:
    v = row.get(col)
    if not _num(v):
        return None
    lo, hi = row.get(f"{col}_lo"), row.get(f"{col}_hi")
    s = format(v * scale, fmt) + suffix
    if _num(lo) and _num(hi):
        s += f" [{format(lo * scale, fmt)}, {format(hi * scale, fmt)}]"
    return s


def display_frame(comp: pd.DataFrame) -> pd.DataFrame:
    """The ranked table's human-readable cells, one row per arm (baseline first)."""

    def cells(row: pd.Series) -> dict[str, str]:
        base = row["role"] == "baseline"
        metric = "eval" if row.get("gap_metric") == K.LOSS_EVAL else "train"
        gap = "—" if base else _ci(row, "gap_rel", "+.2f", 100, "%")
        mde = row.get("mde_rel") if not base else None
        note = row.get("speed_note") or ""
        eq = _ci(row, "speedup_equal_quality", ".2f", suffix="x")
        if eq is None and not base:
            eq = note or _withheld(row, "speedup") or "—"
        tok = _ci(row, "token_efficiency", ".2f", suffix="x")
        if tok is None and not base:
            tok = _withheld(row, "token efficiency") or "—"
        return {
            "rank": "BF16" if base else f"{int(row['rank'])}{'=' if row.get('rank_tied') else ''}",
            "recipe": row_name(row),
            "verdict": _short_verdict(row),
            "gap [95% CI]": f"{gap} ({metric})" if gap and gap != "—" else "—",
            "would detect ≥": f"{100 * mde:.2f}%" if _num(mde) else "—",
            "throughput vs BF16": "1.00x (reference)"
            if base and not note
            else _ci(row, "throughput_ratio", ".2f", suffix="x") or (note or "—"),
            "memory vs BF16": f"{row['memory_ratio']:.2f}x"
            if _num(row.get("memory_ratio"))
            else (note or "—"),
            "speedup @ equal loss": "—" if base else eq,
            "token efficiency": "—" if base else tok,
            "seeds × steps": f"{row['runs']} ({row['seeds']}) × {row['steps']}",
        }

    return pd.DataFrame([cells(r) for _, r in comp.iterrows()])


def _short_verdict(row: pd.Series) -> str:
    """The verdict without the interval and MDE, which have their own columns."""
    text = row.get("verdict_text") or row.get("verdict") or "—"
    if row.get("verdict") == "indistinguishable":
        return "indistinguishable from BF16 at this budget"
    if row.get("verdict") in ("worse", "better"):
        return f"{text.split(' [')[0]}, {S.materiality_text(row.get('materiality'))}"
    return text


def _withheld(row: pd.Series, what: str) -> str | None:
    note = row.get("equal_quality_note")
    if not isinstance(note, str) or not note:
        return None
    parts = [p for p in note.split("; ") if p.startswith(what) or p.startswith("one seed")]
    return "; ".join(parts) or None


def group_sentence(g: Group, df: pd.DataFrame) -> str:
    """The group's answer in one paragraph (`report_text.decision`)."""
    return decision(g, df)


# --- method ------------------------------------------------------------------------------------------


def method_items(smooth_frac: float) -> list[str]:
    anchors = "; ".join(text for _, text in PUBLIC_ANCHORS.values())
    return [
        "Groups: (hardware, model, data, token budget); nothing is compared across groups. Token budget = "
        "summary.tokens of a completed run, else steps x global_batch_size x seq_length.",
        "Arms: one per recipe label (the numerics family, then each recipe field that differs from the "
        "family's preset, e.g. 'tensorwise + fast accumulation'), presets and backend. Fields that still "
        "differ between runs of one arm's label, family and presets are named in {...} after the presets.",
        f"Baseline: the completed BF16 runs of the group with presets {K.DEFAULT_VARIANT} (else the most "
        "common BF16 variant).",
        "Gap: run minus BF16, relative to the BF16 seed mean. The headline gap is the final eval loss when "
        "every run has one, else the final smoothed train loss; both are in comparison.csv.",
        f"Interval: two-sided {100 * S.LEVEL:g}% Student t over seeds. Paired t on the per-seed differences "
        "when every run of an arm has a BF16 run of the same seed (same init and data order); Welch t "
        "(arm seeds vs BF16 seeds) otherwise. The interval column of comparison.csv names the one used.",
        f"Minimum detectable gap ('would detect >='): (t(0.975, df) + t({S.POWER:g}, df)) x SE, the gap "
        f"this design calls non-zero with {100 * S.POWER:g}% power at the 5% level.",
        "Verdict: 'worse'/'better' when the interval excludes 0; 'indistinguishable at this budget' when "
        "it holds 0 (not 'equal': smaller than the design resolves); 'diverged at step N' when a seed "
        "diverged; 'one seed' when no interval exists. A resolved gap is 'material' when its point estimate "
        f"is at least {100 * S.MATERIAL_REL:g}% of the BF16 loss (the largest gap DeepSeek-V3 accepted for "
        "FP8), "
        "else 'resolved, negligible'. Ranked: better, then the arms whose interval holds 0 (one shared rank, "
        "'N=', listed alphabetically: their point estimates do not order them), worse, diverged; resolved "
        "arms by gap.",
        f"Smoothing: train loss is a trailing mean over the last {100 * smooth_frac:g}% of the token "
        f"budget; curves are interpolated onto a {GRID_POINTS}-point token grid spanning the BF16 runs; "
        f"curve statistics skip the first {100 * EARLY_FRAC:g}% of tokens. The gap band is the same "
        "interval per grid point.",
        "Tokens to BF16 loss: first crossing of the BF16 final smoothed train loss by the run's curve. "
        "Equal quality: both sides at the worse of the two final losses; token efficiency = BF16 tokens / "
        "run tokens to it; speedup @ equal loss = BF16 wall time / run wall time to it (native runs only). "
        "Each is a t interval over seeds, or withheld with the reason.",
        "Speed and memory: summary.tokens_per_s and summary.peak_mem_gib of native (te) runs over the mean "
        "of native BF16 runs on the same hardware; throughput's interval is over the arm's seeds. Emulated "
        "runs contribute numerics only.",
        "Gap forecasts: per seed, the raw train-loss gap to the BF16 run of the same seed past the early "
        "transient, fitted by a constant or a + b (t/t0)^-c (c = 0.5 or 1), the member chosen by hold-out "
        "(last 30% of the points); the arm's forecast is the t interval over the per-seed predictions. "
        "Refused with fewer than 5 points, when the chosen fit fails its own hold-out, or beyond "
        "analysis.forecast.VALIDATED_RATIO x the measured tokens (benchmarks/RESULTS.md 'Gap forecasts').",
        "Loss floor: summary.loss_floor, the data's entropy rate (markov), drawn on the loss curves. Units "
        f"are nats. Public reference lines (anchors.md, far larger scale): {anchors}.",
    ]


# --- the report ---------------------------------------------------------------------------------------


HTML = jinja2.Template(
    """<!doctype html><html><head><meta charset='utf-8'><title>lowp: which recipe?</title><style>
body{font-family:system-ui,sans-serif;max-width:1400px;margin:1em auto;padding:0 1em;color:#222}
h1{font-size:22px;margin:.2em 0}h2{font-size:17px;margin:1.2em 0 .3em}h3{font-size:14px}
table{border-collapse:collapse;font-size:12px;margin:.4em 0}td,th{border:1px solid #ccc;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%}figure{margin:1em 0}
figcaption,.small{font-size:12px;color:#555}.answer{font-size:14px;background:#f7f7ee;padding:6px 10px;
border-left:4px solid #b90}.worse{color:#a00;font-weight:600}.better{color:#070;font-weight:600}
.diverged{color:#a00;font-weight:700}.negligible{color:#555}.warn{color:#850}li{margin:.2em 0}
</style></head><body>
<h1>lowp: which recipe? Low-precision recipes against BF16</h1>
<p class=small>{{ intro }}</p>
{% for g in groups %}
<h2>{{ g.title }}</h2>
<p class=answer>{{ g.sentence }}</p>
<table><tr>{% for h in g.table.columns %}<th>{{ h }}</th>{% endfor %}</tr>
{% for cells, v in g.rows %}<tr>{% for c in cells %}
<td{% if loop.index == 3 %} class="{{ v }}"{% endif %}>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% for d in g.dropped %}<p class=small>{{ d }}</p>{% endfor %}
{% if g.forecasts %}<h3>Gap forecasts (fit on the measured gap, extrapolated in tokens)</h3>
<ul>{% for f in g.forecasts %}<li>{{ f }}</li>{% endfor %}</ul>{% endif %}
{% if g.moe %}<h3>MoE: load balance and experts</h3>
<table><tr>{% for h in g.moe.table.columns %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in g.moe.table.itertuples(index=False) %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% for w in g.moe.warnings %}<p class=warn>warning: {{ w }}</p>{% endfor %}
{% if g.moe.experts %}<ul>{% for e in g.moe.experts %}<li>{{ e }}</li>{% endfor %}</ul>{% endif %}
{% endif %}
{% for f in g.figures %}{% if f.png %}
<figure><img alt="{{ f.caption }}" src="data:image/png;base64,{{ f.png }}">
<figcaption>{{ f.caption }}</figcaption></figure>
{% else %}<p class=small>{{ f.name }}: absent ({{ f.absent }}).</p>{% endif %}
{% if f.name == 'telemetry' and g.outliers %}
<ul>{% for o in g.outliers %}<li>{{ o }}</li>{% endfor %}</ul>{% endif %}
{% endfor %}
{% endfor %}
<h2>How every number was obtained</h2><ul>{% for m in method %}<li>{{ m }}</li>{% endfor %}</ul>
<h2>Warnings</h2>
{% if issues %}<ul>{% for w in issues %}<li>{{ w }}</li>{% endfor %}</ul>{% else %}<p>none</p>{% endif %}
<h2>Runs</h2><table><tr>{% for h in runs.columns %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in runs.itertuples(index=False) %}<tr>
{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}</table>
{% for d in runs_dropped %}<p class=small>{{ d }}</p>{% endfor %}
</body></html>
""",
    autoescape=True,
)

MARKDOWN = jinja2.Template(
    """# lowp: which recipe? Low-precision recipes against BF16

{{ intro }}
{% for g in groups %}
## {{ g.title }}

**{{ g.sentence }}**

{{ md_table(g.table) }}
{% for d in g.dropped %}
{{ d }}
{% endfor %}
{% if g.forecasts %}
### Gap forecasts (fit on the measured gap, extrapolated in tokens)

{% for f in g.forecasts %}- {{ f }}
{% endfor %}{% endif %}
{% if g.moe %}
### MoE: load balance and experts

{{ md_table(g.moe.table) }}
{% for w in g.moe.warnings %}
**warning:** {{ w }}
{% endfor %}
{% for e in g.moe.experts %}- {{ e }}
{% endfor %}{% endif %}
{% for f in g.figures %}{% if f.path %}
![{{ f.caption }}]({{ f.path }})

*{{ f.caption }}* ([SVG]({{ f.path[:-4] }}.svg))
{% else %}
{{ f.name }}: absent ({{ f.absent }}).
{% endif %}{% if f.name == 'telemetry' and g.outliers %}
{% for o in g.outliers %}- {{ o }}
{% endfor %}{% endif %}{% endfor %}
{% endfor %}
## How every number was obtained

{% for m in method %}- {{ m }}
{% endfor %}
## Warnings

{% for w in issues %}- {{ w }}
{% else %}none
{% endfor %}
## Runs

{{ md_table(runs) }}
{% for d in runs_dropped %}
{{ d }}
{% endfor %}
""",
    autoescape=False,
)


def md_table(df: pd.DataFrame) -> str:
    cell = lambda v: str("—" if v is None or (isinstance(v, float) and math.isnan(v)) else v).replace(
        "|", "\\|").replace("\n", " ")  # fmt: skip
    lines = ["| " + " | ".join(map(cell, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


RUN_COLUMNS = ("run", "recipe", "recipe_label", "variant", "backend", "hardware", "seed", "status", "steps",
               "token_budget", "final_train_loss", "final_eval_loss", "tokens_per_s", "peak_mem_gib",
               "diverged_step")  # fmt: skip


def runs_table(runs: Runs) -> tuple[pd.DataFrame, list[str]]:
    """The runs in job order; an emulated run's tokens/s marked as not the recipe's speed; columns
    with no value for any run dropped, with one line each saying why."""
    df = job_order(runs.runs.reindex(columns=list(RUN_COLUMNS)))
    for c in ("final_train_loss", "final_eval_loss"):
        df[c] = df[c].map(lambda v: f"{v:.4f}" if _num(v) else "—")
    emulated = df["backend"] == K.EMULATED_BACKEND
    tps = df["tokens_per_s"].map(lambda v: f"{v:.4g}" if _num(v) else "—")
    df["tokens_per_s"] = tps.where(~emulated | (tps == "—"), tps + " (emulated: not the recipe's speed)")
    df["peak_mem_gib"] = df["peak_mem_gib"].map(lambda v: f"{v:.4g}" if _num(v) else "—")
    df = df.astype(object).where(df.notna(), "—")
    why = {"peak_mem_gib": "no run recorded a device's peak memory (CPU runs record resident memory only)",
           "diverged_step": "no run diverged"}  # fmt: skip
    return empty_columns(df, list(RUN_COLUMNS), why)


ARM_SPEED_COLUMNS = ["throughput vs BF16", "memory vs BF16", "speedup @ equal loss"]


def group_table(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The ranked table of a group without the speed columns that carry nothing for any arm (e.g. a
    CPU-only group: emulated speed is not the recipe's speed), and one line per dropped column."""
    table = display_frame(df)
    arms = table[df["role"].to_numpy() != "baseline"]
    kept, lines = empty_columns(arms, ARM_SPEED_COLUMNS, {})
    return table[[c for c in table.columns if c in kept.columns]], lines


def write_report(runs: Runs, comparison: Comparison, out: str | Path, inputs: list[str], *,
                 figures: bool = True, target_tokens: float | None = None,
                 target_loss: float | None = None) -> Path:  # fmt: skip
    """Write comparison.csv, gaps.csv, runs.csv, report.md, plots/ and report.html; returns the html."""
    from analysis import plots, precision_ranking, precision_report
    from analysis.moe import frame as moe_frame
    from analysis.moe import moe_section
    from analysis.telemetry import group_cells, outliers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    comp = comparison_frame(comparison)
    comp.to_csv(out / "comparison.csv", index=False)
    gap_curves(comparison).to_csv(out / "gaps.csv", index=False)
    runs.runs.to_csv(out / "runs.csv", index=False)
    numerics = runs.numerics
    groups, moe_sections = [], []
    for g in comparison.groups:
        df = group_rows(comp, g)
        cells = group_cells(g, numerics)
        moe = moe_section(g, numerics)
        if moe is not None:
            moe_sections.append((g, moe))
        figs = []
        for name, fig, caption in plots.group_figures(g, numerics) if figures else []:
            entry = {"name": name, "caption": caption, "png": None, "path": None, "absent": None}
            if fig is None:
                entry["absent"] = plots.absent_reason(g, name)
            else:
                png, _svg = plots.save(fig, out / "plots", f"{g.key.slug}_{name}")
                entry["png"] = base64.b64encode(png.read_bytes()).decode("ascii")
                entry["path"] = png.relative_to(out).as_posix()
            figs.append(entry)
        table, dropped = group_table(df)
        groups.append({
            "title": f"{g.key.hardware} / {g.key.model} / {g.key.data} / {fmt_tokens(g.key.tokens)} tokens",
            "sentence": group_sentence(g, df), "table": table, "dropped": dropped,
            "rows": list(zip(table.itertuples(index=False), verdict_classes(df), strict=True)),
            "figures": figs, "outliers": telemetry_absent(g, cells) + outliers(cells), "moe": moe,
            "forecasts": forecast_lines(g, target_tokens, target_loss),
        })  # fmt: skip
    if moe_sections:
        moe_frame(moe_sections).to_csv(out / "moe.csv", index=False)
    intro = (f"{status_counts(runs.objects)}, in {len(comparison.groups)} group(s), read from "
             f"{', '.join(inputs)} on {dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}. Gaps are % of the "
             f"BF16 loss (nats); [..] is the {100 * S.LEVEL:g}% interval over seeds; positive = worse than "
             "BF16.")  # fmt: skip
    runs_df, runs_dropped = runs_table(runs)
    ctx = dict(intro=intro, groups=groups, method=method_items(comparison.smooth_frac),
               issues=warning_lines(runs, comparison), runs=runs_df, runs_dropped=runs_dropped,
               md_table=md_table)  # fmt: skip
    (out / "report.md").write_text(MARKDOWN.render(**ctx), encoding="utf-8")
    precision_ranking.append_to_report(runs, out)  # counterfactual telemetry's module ranking, if any
    html_path = out / "report.html"
    html = precision_report.into_html(HTML.render(**ctx), runs)  # the plans and the ranking, if any
    html_path.write_text(html, encoding="utf-8")
    return html_path


def forecast_lines(g: Group, target_tokens: float | None, target_loss: float | None) -> list[str]:
    """The group's gap forecasts (`analysis.forecast`), and equal quality at `target_loss` if asked."""
    from analysis.forecast import equal_quality, group_forecasts

    lines = [f.text() for f in group_forecasts(g, target_tokens)]
    return lines + (equal_quality(g, target_loss) if target_loss else [])


def verdict_classes(df: pd.DataFrame) -> list[str]:
    """The CSS class of each row's verdict cell: a resolved but negligible gap is not shouted."""
    return [
        "negligible" if m == "negligible" else str(v or "")
        for v, m in zip(df["verdict"], df["materiality"], strict=True)
    ]


def warning_lines(runs: Runs, comparison: Comparison) -> list[str]:
    """The report's one warnings list: config warnings printed during the runs (with their group), what
    the loader found, and each group's notes; every line once."""
    lines = []
    for g in comparison.groups:
        seen = dict.fromkeys(w for r in g.runs for w in r.config_warnings)
        where = f"[{g.key.model}, {fmt_tokens(g.key.tokens)} tokens]"
        lines += [f"{where} printed during the runs: {w}" for w in seen]
    return list(dict.fromkeys(lines + runs.issues + comparison.notes))


def group_rows(comp: pd.DataFrame, g: Group) -> pd.DataFrame:
    """The comparison rows of group `g` (None-safe: keys are compared as strings)."""
    key = [str(k) for k in (g.key.hardware, g.key.model, g.key.data, g.key.tokens)]
    cols = ["hardware", "model", "data", "tokens"]
    text = lambda v: "None" if v is None or v != v else str(int(v) if isinstance(v, float) else v)
    as_str = comp[cols].astype(object).map(text)
    return comp[(as_str == key).all(axis=1)]


def terminal_table(comparison: Comparison, numerics: pd.DataFrame | None = None) -> str:
    """The ranked table per group; for an MoE group also its load-balance table, warnings and worst
    experts (from `numerics`, the telemetry rows, when given)."""
    from analysis.moe import moe_section

    comp = comparison_frame(comparison)
    parts = []
    for g in comparison.groups:
        df = group_rows(comp, g)
        table, dropped = group_table(df)
        cols = ["rank", "recipe", "verdict", "gap [95% CI]", "would detect ≥", "throughput vs BF16",
                "seeds × steps"]  # fmt: skip
        disp = table[[c for c in cols if c in table]]
        base = f"BF16 seeds {','.join(map(str, g.baseline.seeds))}" if g.baseline else "NONE"
        parts.append(f"\n== {g.key}  (baseline: {base})\n" + disp.to_string(index=False))
        parts += dropped
        moe = moe_section(g, numerics if numerics is not None else pd.DataFrame())
        if moe is not None:
            parts.append("-- MoE load balance\n" + moe["table"].to_string(index=False))
            parts += [f"warning: {w}" for w in moe["warnings"]] + moe["experts"]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 1 no runs found, 2 bad arguments)."""
    p = argparse.ArgumentParser(
        prog="lowp-report",  # python -m analysis.report in a checkout
        description="Compare the low-precision runs under DIR... with their BF16 baselines and write "
        "comparison.csv, gaps.csv, runs.csv, report.md and a self-contained report.html. Reads run "
        "directories (run.json) and W&B offline runs (wandb/offline-run-*/run-*.wandb) from disk only.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="sweep or run directories, searched recursively")
    p.add_argument("--out", help="output directory (default: DIR/report for the first DIR)")
    p.add_argument(
        "--smooth-frac",
        type=float,
        default=SMOOTH_FRAC,
        help="trailing smoothing window as a fraction of the token budget (default %(default)s)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the figures (tables only)")
    p.add_argument("--target-tokens", type=float, metavar="N",
                   help="forecast every arm's gap to BF16 at N tokens per run (default: the largest "
                        "validated extrapolation ratio x the measured budget); refused beyond it, with the "
                        "reason")  # fmt: skip
    p.add_argument("--target-loss", type=float, metavar="L",
                   help="also forecast the tokens BF16 and each arm need to reach loss L (nats) and "
                        "their ratio (token efficiency at equal loss)")  # fmt: skip
    p.add_argument("--wandb", action="store_true",
                   help="also log the comparison (wandb.Table), the report (artifact) and each run's verdict "
                        "to W&B, in the sweep's group (WANDB_MODE decides offline/online)")  # fmt: skip
    args = p.parse_args(argv)
    if not 0 < args.smooth_frac < 1:
        print(f"error: --smooth-frac={args.smooth_frac}: must be in (0, 1), e.g. 0.05", file=sys.stderr)
        return 2
    for opt, v in (("--target-tokens", args.target_tokens), ("--target-loss", args.target_loss)):
        if v is not None and not (math.isfinite(v) and v > 0):
            print(f"error: {opt}={v:g}: must be a positive number, e.g. {opt}=1e6", file=sys.stderr)
            return 2
    out = Path(args.out) if args.out else Path(args.dirs[0]) / "report"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RunWarning)
        try:
            runs = load(args.dirs)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if not len(runs):
        print(f"error: no run directories (run.json) or W&B offline runs under {' '.join(args.dirs)}",
              file=sys.stderr)  # fmt: skip
        return 1
    from analysis.frames import comparison_of

    comparison = comparison_of(runs, args.smooth_frac)
    html_path = write_report(runs, comparison, out, [str(d) for d in args.dirs], figures=not args.no_plots,
                             target_tokens=args.target_tokens, target_loss=args.target_loss)  # fmt: skip
    print(terminal_table(comparison, runs.numerics))
    for g in comparison.groups:
        lines = forecast_lines(g, args.target_tokens, args.target_loss)
        print("\n".join(f"forecast: {line}" for line in lines))
    for note in comparison.notes:
        print(f"note: {note}")
    if args.wandb:
        from analysis.wandb_report import log_to_wandb

        print(log_to_wandb(runs, comparison, out))
    print(f"\nreport: {html_path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
