"""The report's words: the header's run counts, a group's budget, its decision paragraph, the effect of
a fix measured inside the sweep, and the tables' cleanup (job order, columns that carry nothing).

Kept apart from `analysis.report` (which renders) so each piece is a small function that a test and
another section of the report can call.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import pandas as pd

from analysis import keys as K
from analysis import stats as S
from analysis.pairing import Arm, Group, arm_name
from analysis.run import Run


def fmt_tokens(v: object) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        return "—"
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.0f}"


def row_name(row: pd.Series) -> str:
    """The arm of a comparison row, named as its curves are (`pairing.arm_name`)."""
    return arm_name(row["recipe_label"], row["variant"], row["backend"])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# --- header and budget ------------------------------------------------------------------------------


def status_counts(runs: list[Run]) -> str:
    """'20 runs: 18 completed, 1 incomplete, 1 diverged' (every status named; incomplete = no summary
    or stopped before its last step without a verdict)."""
    counts = Counter(r.status for r in runs)
    order = [K.COMPLETED, K.INCOMPLETE, K.PREEMPTED, K.FAILED, K.DIVERGED]
    names = order + sorted(s for s in counts if s not in order)
    parts = [f"{counts[s]} {s}" for s in names if counts.get(s)]
    return f"{_plural(len(runs), 'run')}: " + ", ".join(parts) if parts else "no runs"


def planned_steps(run: Run) -> int | None:
    """The steps the run was launched with (config), not those it reached."""
    s = run.config.get("steps")
    return int(s) if isinstance(s, int) and not isinstance(s, bool) else run.steps


def _reached(run: Run) -> int | None:
    """The last step the run logged (a stopped run's summary may hold its planned steps)."""
    steps = run.train.get(K.STEP)
    return int(steps[-1]) if steps is not None and len(steps) else run.steps


def budget_text(g: Group) -> str:
    """'cpu / gpt_tiny / markov: 5 seeds x 100 steps, 25.6k tokens per run' — one budget; runs that
    stopped early, or a group whose runs were planned with different step counts (same tokens, other
    batch sizes), are said in words rather than as a list of step counts."""
    seeds = sorted({r.seed for r in g.runs if r.seed is not None})
    planned = Counter(planned_steps(r) for r in g.runs if planned_steps(r))
    if len(planned) == 1:
        steps = f"{_plural(len(seeds), 'seed')} x {next(iter(planned))} steps"
    else:
        each = ", ".join(f"{n} runs of {s} steps" for s, n in sorted(planned.items()))
        steps = f"{_plural(len(seeds), 'seed')} ({each})"
    stopped = [r for r in g.runs if r.status != K.COMPLETED]
    tail = ""
    if stopped:
        tail = " (" + ", ".join(f"{r.name} {r.status} at step {_reached(r)}" for r in stopped) + ")"
    return (f"{g.key.hardware} / {g.key.model} / {g.key.data}: {steps}, "
            f"{fmt_tokens(g.key.tokens)} tokens per run{tail}")  # fmt: skip


# --- the effect of a fix: two arms of one family, paired by seed -------------------------------------


@dataclass(frozen=True)
class Contrast:
    """Arm `to` minus arm `frm` (same family and backend), relative to the BF16 loss."""

    frm: str
    to: str
    interval: S.Interval


def _final(arm: Arm, metric: str) -> dict[int | None, float]:
    vals = {}
    for x in arm.results:
        if x.run.status == K.COMPLETED:
            v = x.final_eval if metric == K.LOSS_EVAL else x.final_train
            if v is not None and math.isfinite(v):
                vals[x.run.seed] = v
    return vals


def contrasts(g: Group) -> list[Contrast]:
    """For every two low-precision arms of the same family and backend: the paired change of the
    headline loss from the worse arm to the better one, as a share of the BF16 loss. This is a fix's
    measured effect (NVFP4's mitigations back on, a block in BF16) when both ran in one sweep."""
    arms = [a for a in g.arms if a.role != "baseline" and a.row.get("gap_rel") is not None]
    out = []
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            if (a.recipe, a.backend) != (b.recipe, b.backend):
                continue
            worse, better = (a, b) if a.row["gap_rel"] >= b.row["gap_rel"] else (b, a)
            metric = worse.row.get("gap_metric")
            metric = K.LOSS_EVAL if metric == K.LOSS_EVAL else K.LOSS_TRAIN
            ref = worse.row.get("bf16_final_eval_loss" if metric == K.LOSS_EVAL else "bf16_final_train_loss")
            iv = S.gap_interval(_final(better, metric), _final(worse, metric))
            if iv is not None and ref:
                out.append(Contrast(worse.name, better.name, iv.scaled(1 / ref)))
    return out


def contrast_text(c: Contrast) -> str:
    iv = c.interval
    ci = S.ci_text(iv)
    resolved = "resolved" if iv.excludes_zero else "interval holds 0: not resolved"
    return f"{c.frm} -> {c.to}: {S.pct(iv.mean)} {ci} of the BF16 loss ({iv.method}; {resolved})"


# --- the decision paragraph ---------------------------------------------------------------------------


def decision(g: Group, df: pd.DataFrame) -> str:
    """The group's answer in one paragraph: the budget and the materiality threshold, the arms that
    separate from BF16 (with their interval and whether the gap is material), those that do not (one
    group, alphabetical, with the gap this design would have detected), diverged arms, and the effect
    of a fix measured in the same sweep."""
    budget = budget_text(g)
    arms = df[df["role"] != "baseline"]
    if df[df["role"] == "baseline"].empty:
        return f"{budget}: no completed BF16 run, so nothing is compared."
    if arms.empty:
        return f"{budget}: no low-precision run."
    thr = f"{100 * S.MATERIAL_REL:g}%"
    parts = [f"At this budget ({budget}; a gap is material at >= {thr} of the BF16 loss)"]
    sep = arms[arms["verdict"].isin(["worse", "better"])]
    if len(sep):
        items = [f"{row_name(r)} is {r['verdict']} than BF16 by {S.pct(abs(r['gap_rel']))[1:]} "
                 f"[{100 * r['gap_rel_lo']:+.2f}, {100 * r['gap_rel_hi']:+.2f}]% "
                 f"({S.materiality_text(r['materiality'])})" for _, r in sep.iterrows()]  # fmt: skip
        parts.append("; ".join(items))
    div = arms[arms["verdict"] == "diverged"]
    if len(div):
        parts.append("; ".join(f"{row_name(r)} {r['verdict_text']}" for _, r in div.iterrows()))
    same = arms[arms["verdict"].isin(S.UNRESOLVED)].sort_values("recipe_label", key=lambda s: s.astype(str))
    if len(same):
        names = sorted(row_name(r) for _, r in same.iterrows())
        mde = same["mde_rel"].dropna()
        span = sorted({f"{100 * v:.2f}%" for v in (mde.min(), mde.max())}) if len(mde) else []
        detect = f"; would detect >= {'-'.join(span)}" if span else ""
        parts.append(f"{', '.join(names)} cannot be told from BF16 (interval holds 0{detect}; listed "
                     "alphabetically, not ranked)")  # fmt: skip
    text = parts[0] + ": " + ". ".join(parts[1:]) + "."
    fixes = contrasts(g)
    if fixes:
        text += " Measured in this sweep, " + "; ".join(contrast_text(c) for c in fixes) + "."
    methods = ", ".join(sorted(set(arms["interval"].dropna())))
    return text + (f" Intervals: {methods}." if methods else "")


# --- tables -------------------------------------------------------------------------------------------


def job_order(df: pd.DataFrame, col: str = "run") -> pd.DataFrame:
    """Rows in the order the sweep launched them: a run directory is named `<job number>_<name>`."""
    num = df[col].astype(str).map(lambda s: int(m.group(1)) if (m := re.match(r"(\d+)_", s)) else math.inf)
    return df.assign(_job=num).sort_values(["_job", col], kind="stable").drop(columns="_job")


def empty_columns(df: pd.DataFrame, cols: list[str], why: dict[str, str]) -> tuple[pd.DataFrame, list[str]]:
    """Drop the columns of `cols` that carry nothing for any row ('—' or 'n/a ...'), and say why in one
    line each (`why[col]`, else 'no value for any run')."""
    reasons: dict[str, list[str]] = {}
    for c in cols:
        if c in df and df[c].map(lambda v: str(v) in ("—", "nan", "None") or str(v).startswith("n/a")).all():
            notes = sorted({str(v)[5:-1] for v in df[c] if str(v).startswith("n/a (")})
            reason = why.get(c) or ("; ".join(notes) if notes else "no value for any run")
            reasons.setdefault(reason, []).append(c)
    drop = [c for cs in reasons.values() for c in cs]
    lines = [f"{', '.join(cs)}: {_REASONS.get(r, r)}" for r, cs in reasons.items()]
    return df.drop(columns=drop), lines


_REASONS = {"emulated": "not given: every arm here is emulated, and emulated speed is not the recipe's speed"}


def telemetry_absent(g: Group, cells: pd.DataFrame) -> list[str]:
    """One line per low-precision arm missing from the telemetry figure, with the reason."""
    shown = set(cells["arm"]) if len(cells) else set()
    out = []
    for a in g.arms:
        if a.role == "baseline" or a.recipe == K.BASELINE_RECIPE or a.name in shown:
            continue
        interval = {r.config.get("telemetry_interval") for r in a.runs}
        if interval <= {0, None}:
            why = "telemetry_interval=0 in its runs"
        else:
            why = ("its runs recorded no quantizer telemetry rows (the recipe's quantizer does not report "
                   "underflow, saturation or SQNR)")  # fmt: skip
        out.append(f"{a.name} is not in the telemetry figure: {why}")
    return out
