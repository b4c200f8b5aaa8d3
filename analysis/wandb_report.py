"""The comparison on W&B, as a dashboard user wants it (the real client; WANDB_MODE decides the mode).

- one `analysis` run in the sweep's group (job_type `analysis`) holding the comparison as a
  `wandb.Table` and the report directory (html, md, csv, plots) as an artifact of type `report`, and
  `verdict/<arm>` keys in its summary;
- every training run that logged to W&B gets `verdict`, `verdict_text`, `gap_rel` [lo, hi] and
  `mde_rel` of its arm in its own summary, by resuming it (`resume="allow"`; offline this writes a
  second offline-run directory with the same id, which `wandb sync` merges into the run).

Offline (the default here) nothing is sent; `wandb sync DIR/wandb/offline-run-*` uploads later.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import pandas as pd

from analysis.frames import Runs, comparison_frame
from analysis.pairing import Comparison, arm_variants

SUMMARY_KEYS = ("verdict", "verdict_text", "gap_metric", "gap_rel", "gap_rel_lo", "gap_rel_hi", "mde_rel",
                "interval", "rank")  # fmt: skip


def _group_and_project(runs: Runs) -> tuple[str | None, str]:
    groups = Counter(r.wandb.get("group") for r in runs.objects if r.wandb and r.wandb.get("group"))
    projects = Counter(r.wandb.get("project") for r in runs.objects if r.wandb and r.wandb.get("project"))
    group = groups.most_common(1)[0][0] if groups else None
    return group, projects.most_common(1)[0][0] if projects else "lowp"


def _clean(v):
    v = v.item() if hasattr(v, "item") else v  # numpy scalars
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def log_to_wandb(runs: Runs, comparison: Comparison, out: str | Path) -> str:
    """Log the analysis run and the per-run verdicts; returns one line saying where they went."""
    import wandb

    out = Path(out)
    mode = os.environ.get("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")  # the report prints its own one-line summary
    group, project = _group_and_project(runs)
    comp = comparison_frame(comparison)
    table_df = comp.astype(object).where(comp.notna(), None)
    plain = lambda v: v if isinstance(v, (int, float, bool)) or v is None else str(v)
    table_df = table_df.apply(lambda col: col.map(plain))
    with wandb.init(project=project, group=group, job_type="analysis", name=f"report:{group or 'runs'}",
                    dir=str(out), mode=mode, config={"inputs": [str(r.path) for r in runs.objects][:1000]},
                    reinit="finish_previous") as run:  # fmt: skip
        run.log({"comparison": wandb.Table(dataframe=table_df)})
        art = wandb.Artifact(f"report-{_slug(group or 'runs')}", type="report",
                             description="lowp report: which recipe? (html, md, csv, plots)")  # fmt: skip
        for f in sorted(out.rglob("*")):
            if f.is_file() and "wandb" not in f.relative_to(out).parts:
                art.add_file(str(f), name=f.relative_to(out).as_posix())
        run.log_artifact(art)
        for _, row in comp.iterrows():
            arm = f"{row['recipe_label']} [{row['variant']}] ({row['backend']})"
            label = f"{arm} {row['hardware']}/{row['model']}"
            run.summary[f"verdict/{label}"] = row["verdict_text"]
        analysis_id = run.id
    n = _verdicts_to_runs(runs, comparison, comp, mode)
    return (f"W&B ({mode}): analysis run {analysis_id} in group {group}: comparison table, report "
            f"artifact; verdict in {n} run summaries")  # fmt: skip


def _verdicts_to_runs(runs: Runs, comparison: Comparison, comp: pd.DataFrame, mode: str) -> int:
    import wandb

    variants = arm_variants(comparison.runs)
    index = {(str(r["hardware"]), str(r["model"]), str(r["data"]), r["tokens"], r["recipe_label"],
              r["variant"], r["backend"]): r for _, r in comp.iterrows()}  # fmt: skip
    n = 0
    for g in comparison.groups:
        for r in g.runs:
            if not r.wandb or not r.wandb.get("run_id"):
                continue
            key = (str(g.key.hardware), str(g.key.model), str(g.key.data), g.key.tokens, r.recipe_label,
                   variants[id(r)], r.backend)  # fmt: skip
            row = index.get(key)
            if row is None:
                continue
            with wandb.init(id=r.wandb["run_id"], resume="allow", project=r.wandb.get("project") or "lowp",
                            group=r.wandb.get("group"), dir=str(_wandb_parent(r)), mode=mode,
                            reinit="finish_previous") as wr:  # fmt: skip
                for k in SUMMARY_KEYS:
                    wr.summary[k] = _clean(row[k])
            n += 1
    return n


def _wandb_parent(r) -> Path:
    """The directory W&B was given for this run: the run dir, or for a bare offline run the folder
    holding its `wandb/` (r.path is `<dir>/wandb/offline-run-*`)."""
    return Path(r.path) if r.source == "run_dir" else Path(r.path).parent.parent


def _slug(s: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in s)
