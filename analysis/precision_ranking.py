"""Which modules each candidate format hurts: ranking tables from counterfactual telemetry and ablations.

    cf = counterfactual_frame(runs)          # every run's candidate rows (telemetry.candidates)
    scores = module_scores(cf)               # one row per (module, candidate), worst first
    gains = ablation_gains(runs)             # a plan_ablation sweep: the loss each BF16 group saves

A module's score for a candidate is, in dB, the worst of three figures averaged over telemetry steps
and runs: the SQNR of its GEMM outputs (-20 log10 of the relative error against the high-precision
GEMM, over fprop, dgrad and wgrad), the SQNR of its operands (input, weight, grad), and the flush
figure -10 log10(fraction of non-zeros flushed to zero): a format that zeroes most of a tensor loses
information that the energy-weighted SQNR hides when a few large channels carry the energy (LLM.int8()'s
outlier features). Saturation and the spread of block scales are shown, not scored: a block format
puts each block's largest element at the largest code by design.

These are tables only; `python -m harness.plan` turns them into a plan.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis import keys as K

SCORE = "score_db"
GEMM_SQNR = "gemm_sqnr_db"
OPERAND_SQNR = "operand_sqnr_db"
FLUSH = "flush_db"
MODULE_COLUMNS = (
    K.TELEMETRY_LAYER, K.TELEMETRY_CANDIDATE, SCORE, GEMM_SQNR, OPERAND_SQNR, FLUSH, "worst_gemm",
    "worst_operand", "flushed_operand", "underflow", "saturation", K.TELEMETRY_SCALE_SPREAD, "runs",
)  # fmt: skip


def counterfactual_frame(runs) -> pd.DataFrame:
    """The candidates' rows of every run of `runs` (analysis.load), with the run's name and seed."""
    from analysis.telemetry import load_counterfactual

    frames = []
    for r in runs.objects:
        rows = load_counterfactual(r)
        if rows:
            df = pd.DataFrame.from_records(rows)
            df.insert(0, "run", r.name)
            df.insert(1, "seed", r.seed)
            frames.append(df)
    if not frames:
        return pd.DataFrame(
            columns=["run", "seed", "step", K.TELEMETRY_LAYER, K.TELEMETRY_TENSOR, K.TELEMETRY_CANDIDATE]
        )
    return pd.concat(frames, ignore_index=True)


def _db(x: float, scale: float) -> float:
    """-scale * log10(x): inf where x is 0."""
    return math.inf if x <= 0 else -scale * math.log10(x)


def module_scores(cf: pd.DataFrame) -> pd.DataFrame:
    """One row per (module, candidate): score_db and its parts, worst first (lowest score_db)."""
    if not len(cf):
        return pd.DataFrame(columns=list(MODULE_COLUMNS))
    cf = cf.copy()
    for col in ("sqnr_db", "underflow", "saturation", K.TELEMETRY_REL_ERR, K.TELEMETRY_SCALE_SPREAD):
        cf[col] = pd.to_numeric(cf[col], errors="coerce") if col in cf else np.nan
    keys = [K.TELEMETRY_LAYER, K.TELEMETRY_CANDIDATE]
    # the mean over telemetry steps and runs, per (module, candidate, tensor)
    finite = cf.replace([np.inf, -np.inf], np.nan)
    mean = finite.groupby([*keys, K.TELEMETRY_TENSOR], sort=False).agg(
        sqnr_db=("sqnr_db", "mean"), underflow=("underflow", "mean"), saturation=("saturation", "mean"),
        rel_err=(K.TELEMETRY_REL_ERR, "mean"), spread=(K.TELEMETRY_SCALE_SPREAD, "mean"),
        runs=("run", "nunique"),
    ).reset_index()  # fmt: skip
    out = []
    for (layer, cand), g in mean.groupby(keys, sort=False):
        gemms = g[g[K.TELEMETRY_TENSOR].isin(K.TELEMETRY_GEMMS)]
        ops = g[~g[K.TELEMETRY_TENSOR].isin(K.TELEMETRY_GEMMS)]
        gemm_db = {t: _db(e, 20) for t, e in zip(gemms[K.TELEMETRY_TENSOR], gemms["rel_err"]) if e == e}
        op_db = {t: s for t, s in zip(ops[K.TELEMETRY_TENSOR], ops["sqnr_db"]) if s == s}
        has_flush = len(ops) and ops["underflow"].notna().any()
        flush = float(ops["underflow"].max()) if has_flush else 0.0
        flushed = (
            ops[K.TELEMETRY_TENSOR].iloc[int(ops["underflow"].to_numpy().argmax())] if has_flush else None
        )
        worst_gemm = min(gemm_db, key=gemm_db.get) if gemm_db else None
        worst_op = min(op_db, key=op_db.get) if op_db else None
        parts = (gemm_db.get(worst_gemm, math.inf), op_db.get(worst_op, math.inf), _db(flush, 10))
        out.append({
            K.TELEMETRY_LAYER: layer, K.TELEMETRY_CANDIDATE: cand, SCORE: min(parts), GEMM_SQNR: parts[0],
            OPERAND_SQNR: parts[1], FLUSH: parts[2], "worst_gemm": worst_gemm, "worst_operand": worst_op,
            "flushed_operand": flushed, "underflow": flush,
            "saturation": float(ops["saturation"].max()) if len(ops) else np.nan,
            K.TELEMETRY_SCALE_SPREAD: float(ops["spread"].max()) if len(ops) else np.nan,
            "runs": int(g["runs"].max()),
        })  # fmt: skip
    return pd.DataFrame(out).sort_values([SCORE, K.TELEMETRY_LAYER], kind="stable").reset_index(drop=True)


def ablation_gains(runs, uniform_arm: str = "uniform", metric: str = "final_eval_loss") -> pd.DataFrame:
    """A plan_ablation sweep (arms `uniform` and `bf16-<group>`, each moving one module group to BF16):
    per group, the mean `metric` over seeds and its gain (the uniform arm's minus the group's: > 0 when
    BF16 there helps), best first. Arms are read from the run names (`<arm>-s<seed>`)."""
    df = runs.runs.copy()
    if not len(df):
        return pd.DataFrame(columns=["group", "loss", "gain", "seeds"])
    arm = df["config.name"].astype(str).str.replace(r"-s\d+$", "", regex=True)
    df = df.assign(arm=arm, loss=pd.to_numeric(df[metric], errors="coerce"))
    means = df.groupby("arm")["loss"].agg(["mean", "count"])
    if uniform_arm not in means.index:
        return pd.DataFrame(columns=["group", "loss", "gain", "seeds"])
    base = means.loc[uniform_arm, "mean"]
    patterns = (
        df.groupby("arm")["config.stability.overrides"].first() if "config.stability.overrides" in df else {}
    )
    rows = [
        {"group": a.removeprefix("bf16-"), "loss": m["mean"], "gain": base - m["mean"],
         "seeds": int(m["count"]),
         "patterns": [o["pattern"] for o in (patterns.get(a) or []) if isinstance(o, dict)]}
        for a, m in means.iterrows()
        if a.startswith("bf16-")
    ]  # fmt: skip
    return pd.DataFrame(rows).sort_values("gain", ascending=False, kind="stable").reset_index(drop=True)


PLAN_VARIANT = "plan+"
"""A run under `stability=plan` (its variant starts with the stability preset's name)."""


def plan_verdicts(table: pd.DataFrame) -> list[str]:
    """plan_check: per recipe, the plan arm's verdict against BF16 beside the uniform arm's (the same
    recipe without a plan), from analysis.compare's table; e.g. 'nvfp4 with the plan: within noise of
    BF16 (gap +0.1%); uniform nvfp4: worse than BF16 (gap +2.3%)'."""
    out = []
    if not len(table) or "variant" not in table:
        return out
    arms = table[table["recipe"] != K.BASELINE_RECIPE]
    for label, g in arms.groupby("recipe_label", sort=False):
        plan = g[g["variant"].astype(str).str.startswith(PLAN_VARIANT)]
        uniform = g[~g["variant"].astype(str).str.startswith(PLAN_VARIANT)]
        if not len(plan):
            continue
        said = [f"{label} with the plan: {_verdict(plan.iloc[0])}"]
        said += [f"uniform {label}: {_verdict(u)}" for _, u in uniform.iterrows()]
        out.append("; ".join(said))
    return out


def _verdict(row: pd.Series) -> str:
    gap = row.get("gap_rel")
    shown = f" (gap {100 * gap:+.2f}% of the BF16 loss)" if isinstance(gap, float) and gap == gap else ""
    return f"{row.get('verdict_text') or row.get('verdict')}{shown}"


def plan_modules(runs) -> pd.DataFrame:
    """The modules of the runs under a precision plan (`stability=plan`): one column per distinct plan
    (its file), one row per block module, the recipe each ran (run.json quantized_modules)."""
    cols: dict[str, dict] = {}
    for r in runs.objects:
        if not str(r.variant).startswith(PLAN_VARIANT):
            continue
        plan_file = ((r.config or {}).get("stability") or {}).get("plan_file") or r.name
        modules = r.provenance.get("quantized_modules") or {}
        cols.setdefault(str(plan_file), {k: v for k, v in modules.items() if k.startswith("blocks.")})
    return pd.DataFrame(cols).rename_axis("module").reset_index() if cols else pd.DataFrame()


RANKING_COLUMNS = [K.TELEMETRY_LAYER, SCORE, GEMM_SQNR, OPERAND_SQNR, FLUSH, "worst_gemm", "worst_operand",
                   "underflow"]  # fmt: skip
"""The ranking table's columns in the report (all of them are in precision_ranking.csv)."""
RANKING_ROWS = 20
"""Modules shown per candidate in the report, worst first."""
RANKING_NOTE = (
    "score_db: the worst of the GEMM outputs' SQNR, the operands' SQNR and -10 log10(flushed fraction), "
    "dB, mean over telemetry steps and runs (analysis/precision_ranking.py); lowest first."
)
SECTION_TITLES = {
    "verdicts": "Precision plan against the uniform recipe (plan_check)",
    "plans": "The precision plans' modules (stability=plan)",
    "ranking": "Which modules each candidate format hurts (counterfactual telemetry)",
}
"""The report's headings of the three parts (report.md and report.html alike)."""


def report_parts(runs) -> tuple[list[str], pd.DataFrame, list[tuple[str, pd.DataFrame]]]:
    """What the report shows of precision plans, for report.md and report.html alike: plan_check's
    verdicts, the plans' module table (plan_modules), and per candidate its worst RANKING_ROWS modules
    (RANKING_COLUMNS, cells formatted); each empty where the runs have none."""
    from analysis.frames import compare

    scores = module_scores(counterfactual_frame(runs))
    ranking = [
        (str(cand), g.head(RANKING_ROWS)[RANKING_COLUMNS].apply(lambda col: col.map(_cell)))
        for cand, g in scores.groupby(K.TELEMETRY_CANDIDATE, sort=False)
    ]
    return plan_verdicts(compare(runs)), plan_modules(runs), ranking


def report_section(runs) -> str:
    """Markdown: plan_check's verdicts, the plans' module tables, and the module ranking of the runs'
    counterfactual rows (worst 20 per candidate); empty where there is none of them."""
    verdicts, plans, ranking = report_parts(runs)
    lines = ["", f"## {SECTION_TITLES['verdicts']}", ""] if verdicts else []
    lines += [f"- {v}" for v in verdicts]
    if len(plans):
        lines += [
            "",
            f"## {SECTION_TITLES['plans']}",
            "",
            _md_row(plans.columns),
            "|" + "---|" * len(plans.columns),
        ]
        lines += [_md_row(row) for row in plans.itertuples(index=False)]
    if not ranking:
        return "\n".join(lines)
    lines += ["", f"## {SECTION_TITLES['ranking']}", "", RANKING_NOTE, ""]
    for cand, table in ranking:
        lines += [f"### {cand}", "", _md_row(table.columns), "|" + "---|" * len(table.columns)]
        lines += [_md_row(row) for row in table.itertuples(index=False)]
        lines.append("")
    return "\n".join(lines)


def _md_row(cells) -> str:
    return "| " + " | ".join(str(v) for v in cells) + " |"


def _cell(v) -> str:
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.3g}"
    return "" if v is None else str(v)


def append_to_report(runs, out) -> None:
    """Add the ranking section to OUT/report.md and write OUT/precision_ranking.csv (runs with
    counterfactual rows only)."""
    from pathlib import Path

    section = report_section(runs)
    scores = module_scores(counterfactual_frame(runs))
    if len(scores):
        scores.to_csv(Path(out) / "precision_ranking.csv", index=False)
    if section:
        with open(Path(out) / "report.md", "a", encoding="utf-8") as f:
            f.write(section + "\n")
