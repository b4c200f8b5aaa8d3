"""`python -m analysis.report DIR... [--out OUT]`: comparison.csv, runs.csv, report.md, report.html.

The report is built once as a list of blocks (heading, paragraph, list, table, figure) and rendered
twice: Markdown next to the PNG/SVG files, and one self-contained HTML file with the PNGs embedded.
"""

from __future__ import annotations

import argparse
import base64
import csv
import datetime as dt
import html
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis import keys as K
from analysis.compare import (
    COLUMNS,
    EARLY_FRAC,
    GRID_POINTS,
    PUBLIC_ANCHORS,
    SMOOTH_FRAC,
    Comparison,
    compare,
)
from analysis.load import Run, RunWarning, load_runs

# --- formatting -----------------------------------------------------------------------------------


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt_ratio(v: Any, note: str = "") -> str:
    return f"{v:.2f}x" if _num(v) else (note or "—")


def fmt_pct(v: Any) -> str:
    return f"{100 * v:+.2f}%" if _num(v) else "—"


def fmt_loss(v: Any) -> str:
    return f"{v:.4f}" if _num(v) else "—"


def fmt_tokens(v: Any) -> str:
    if not _num(v):
        return "—"
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.0f}"


DISPLAY = (
    ("recipe", "recipe"),
    ("variant", "variant"),
    ("backend", "backend"),
    ("seeds", "seeds"),
    ("status", "status"),
    ("final loss", "final"),
    ("gap", "gap"),
    ("BF16 band", "band"),
    ("public anchor", "anchor"),
    ("tokens to BF16 loss", "to_target"),
    ("token eff.", "token_eff"),
    ("throughput", "throughput"),
    ("memory", "memory"),
    ("speedup @ equal loss", "speedup"),
)


def display_row(row: dict[str, Any]) -> dict[str, str]:
    """The human-readable cells of one comparison row (see `DISPLAY`)."""
    note = row.get("speed_note") or ""
    metric = "eval" if row.get("gap_metric") == K.LOSS_EVAL else "train"
    final = row.get("final_eval_loss") if metric == "eval" else row.get("final_train_loss")
    if row.get("role") == "baseline":
        gap = "baseline"
    elif row.get("gap_rel") is None:
        gap = "—" if str(row.get("baseline", "")).startswith("bf16") else "no baseline"
    else:
        abs_gap = row.get("eval_gap_abs") if metric == "eval" else row.get("train_gap_abs")
        gap = f"{fmt_pct(row['gap_rel'])} ({abs_gap:+.4f}, {row.get('pairing')})"
    band = row.get("leaves_band") or "—"
    if row.get("curve_frac_outside_band") is not None and row.get("role") != "baseline":
        band += f"; curve {100 * row['curve_frac_outside_band']:.0f}% outside"
    anchor = "—"
    if row.get("public_anchor"):
        anchor = {True: "within", False: "exceeds", None: "—"}[row.get("within_anchor")]
        anchor += f" ({row['public_anchor'].split(':')[0]})"
    to_target = "—"
    if row.get("reached_target"):
        reached, total = row["reached_target"].split("/")
        if reached == total:
            to_target = f"{fmt_tokens(row.get('tokens_to_target'))} ({total}/{total} seeds)"
        else:
            to_target = (
                f"not reached (0/{total} seeds)" if reached == "0" else f"reached by {reached}/{total} seeds"
            )
        if _num(row.get("wall_to_target_s")):
            to_target += f", {row['wall_to_target_s']:.1f} s"
    status = row.get("status") or ""
    if row.get("divergence"):
        status += f" [{row['divergence']}]"
    return {
        "recipe": str(row.get("recipe")),
        "variant": str(row.get("variant")),
        "backend": str(row.get("backend")),
        "seeds": str(row.get("seeds")),
        "status": status,
        "final": f"{fmt_loss(final)} ({metric})" if _num(final) else "—",
        "gap": gap,
        "band": band,
        "anchor": anchor,
        "to_target": to_target,
        "token_eff": fmt_ratio(row.get("token_efficiency")),
        "throughput": fmt_ratio(row.get("throughput_ratio"), note),
        "memory": fmt_ratio(row.get("memory_ratio"), note),
        "speedup": fmt_ratio(row.get("speedup_equal_quality"), note),
    }


def terminal_row(row: dict[str, Any]) -> dict[str, str]:
    """Shorter cells for the terminal; the report and comparison.csv have everything."""
    d = display_row(row)
    recipe = d["recipe"] + ("" if row.get("variant") == K.DEFAULT_VARIANT else f" [{d['variant']}]")
    gap = d["gap"]
    if row.get("gap_rel") is not None and row.get("role") != "baseline":
        gap = fmt_pct(row["gap_rel"]) + (" paired" if row.get("pairing") == "paired by seed" else " vs mean")
    band = row.get("leaves_band") or "—"
    if row.get("curve_frac_outside_band") is not None and row.get("role") != "baseline":
        band += f" ({100 * row['curve_frac_outside_band']:.0f}%)"
    emulated = row.get("speed_note") == "n/a (emulated)"
    speed = {k: ("n/a" if emulated else d[k]) for k in ("throughput", "memory", "speedup")}
    if emulated:
        speed["throughput"] = "n/a (emulated)"
    return {**d, **speed, "recipe": recipe, "gap": gap, "band": band}


TERMINAL = (
    ("recipe", "recipe"),
    ("backend", "backend"),
    ("seeds", "seeds"),
    ("status", "status"),
    ("final loss", "final"),
    ("gap vs BF16", "gap"),
    ("BF16 band (curve % out)", "band"),
    ("tokens to BF16 loss", "to_target"),
    ("token eff.", "token_eff"),
    ("throughput", "throughput"),
    ("memory", "memory"),
    ("speedup @ equal loss", "speedup"),
)


def text_table(rows: list[dict[str, Any]], columns: tuple = TERMINAL) -> str:
    """A fixed-width table of the terminal cells of `rows`."""
    cells = [[h for h, _ in columns]] + [[terminal_row(r)[k] for _, k in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(comparison: Comparison, file: Any = None) -> None:
    """Every group's table, headed by the group key and its baseline."""
    file = file or sys.stdout
    for g in comparison.groups:
        base = (
            f"BF16 [{g.baseline.variant}] seeds {','.join(map(str, g.baseline.seeds))}"
            if g.baseline
            else "NONE"
        )
        print(f"\n== {g.key}  (baseline: {base})", file=file)
        print(text_table([a.row for a in g.arms]), file=file)


# --- report blocks --------------------------------------------------------------------------------


@dataclass
class Block:
    kind: str
    """h1, h2, h3, p, ul, table or img."""
    content: Any


def _method_items(smooth_frac: float) -> list[str]:
    anchors = "; ".join(text for _, text in PUBLIC_ANCHORS.values())
    return [
        "Groups: runs are grouped by (hardware, model, data, token budget); nothing is compared across "
        "groups. Token budget = summary.tokens of a completed run, else steps x global_batch_size x "
        "seq_length from its resolved config (so diverged runs stay in their group).",
        "Baseline: the completed BF16 runs of the group with stability/optimizer presets "
        f"{K.DEFAULT_VARIANT} (else the most common BF16 variant). A run whose seed matches a BF16 seed "
        "is paired with it; otherwise it is compared with the mean over BF16 seeds.",
        f"Smoothing: train loss is a trailing mean over the logged points of the last {100 * smooth_frac:g}% "
        "of the token budget, the same window for every run of a group. 'Final train loss' is the last "
        "smoothed value; final eval loss is summary.final_eval_loss (else the last `loss/eval` row).",
        "Gap: run minus reference, absolute and relative to the reference. The headline gap uses eval "
        "loss when every run involved has one, else smoothed train loss (column gap_metric).",
        f"Curves are interpolated linearly onto a {GRID_POINTS}-point token grid spanning the BF16 runs, so "
        "different logging cadences compare. BF16 band = the wider of seed min-max and mean ± 2σ "
        f"(sample std); 'curve % outside' counts grid points after the first {100 * EARLY_FRAC:g}% "
        "of tokens.",
        "Tokens to BF16 loss: first crossing of the reference's final smoothed train loss by the run's "
        "smoothed curve; not reached when the run ends worse. Wall time = sum of logged step times "
        "(time/step_ms x steps since the previous row; evals and start-up excluded).",
        "Equal quality: both sides measured at the worse of the two final losses. Token efficiency = BF16 "
        "tokens / run tokens to that loss (any backend); speedup at equal loss = BF16 wall time / run "
        "wall time to that loss (native only).",
        "Speed and memory: summary.tokens_per_s (median of steady-state steps) and summary.peak_mem_gib of "
        "native (te) runs divided by the mean of native BF16 runs on the same hardware. Emulated runs "
        "contribute numerics only: their speed cells read 'n/a (emulated)'.",
        f"Public reference lines (anchors.md), measured at far larger scale: {anchors}.",
    ]


def headline(row: dict[str, Any]) -> str:
    """One sentence per arm: what it costs in loss and what it buys in speed and memory."""
    who = f"{row['recipe']} [{row['variant']}] ({row['backend']}, seeds {row['seeds']})"
    if not str(row.get("baseline", "")).startswith("bf16"):
        return f"{who}: no BF16 baseline in its group, not compared."
    parts = []
    if row.get("gap_rel") is not None:
        metric = "eval" if row.get("gap_metric") == K.LOSS_EVAL else "smoothed train"
        lb = row.get("leaves_band")
        band = (
            f"{lb} the BF16 seed band" if lb in ("above", "below", "inside") else f"BF16 band {lb or 'n/a'}"
        )
        parts.append(f"{fmt_pct(row['gap_rel'])} final {metric} loss ({band})")
    else:
        parts.append("no final loss gap (no completed run)")
    if row.get("divergence"):
        parts.append(row["divergence"])
    if row.get("throughput_ratio") is not None:
        parts.append(
            f"{fmt_ratio(row['throughput_ratio'])} throughput, {fmt_ratio(row.get('memory_ratio'))} memory"
        )
        parts.append(f"{fmt_ratio(row.get('speedup_equal_quality'))} at equal loss")
    else:
        parts.append(f"speed {row.get('speed_note') or 'n/a'}")
    return f"{who}: " + "; ".join(parts) + "."


def build_blocks(
    comparison: Comparison, figures: dict[str, list[tuple[str, Path, str]]], inputs: list[str]
) -> list[Block]:
    runs = comparison.runs
    n_inc = sum(r.status == K.INCOMPLETE for r in runs)
    blocks = [
        Block("h1", "lowp: low-precision recipes against BF16"),
        Block(
            "p",
            f"{len(runs)} runs ({n_inc} incomplete) in {len(comparison.groups)} group(s), read from "
            f"{', '.join(inputs)} on {dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}.",
        ),
        Block("h2", "At a glance"),
        Block(
            "ul",
            [
                f"{g.key.hardware}/{g.key.model}: {headline(a.row)}"
                for g in comparison.groups
                for a in g.arms
                if a.role != "baseline"
            ]
            or ["no low-precision runs"],
        ),  # fmt: skip
        Block("h2", "How every number was obtained"),
        Block("ul", _method_items(comparison.smooth_frac)),
        Block("h2", "Warnings"),
        Block("ul", _warning_items(comparison) or ["none"]),
    ]
    for g in comparison.groups:
        blocks.append(Block("h2", f"Group: {g.key}"))
        if g.baseline:
            b = g.baseline
            desc = ", ".join(f"{r.name} (seed {r.seed}, {r.backend}, {r.steps} steps)" for r in b.runs)
            blocks.append(Block("p", f"Baseline: BF16 [{b.variant}]: {desc}."))
        else:
            text = "Baseline: MISSING. No completed BF16 run in this group; its runs are listed without gaps"
            blocks.append(Block("p", text + " and are not compared with any other group."))
        header = [h for h, _ in DISPLAY] + ["obtained"]
        body = [[display_row(a.row)[k] for _, k in DISPLAY] + [a.row["obtained"]] for a in g.arms]
        blocks.append(Block("table", (header, body)))
        for _name, path, caption in figures.get(g.key.slug, []):
            blocks.append(Block("img", (path, caption)))
    blocks.append(Block("h2", "Runs"))
    blocks.append(Block("table", _runs_table(runs)))
    return blocks


def _warning_items(comparison: Comparison) -> list[str]:
    items = [f"run {r.name}: {msg}" for r in comparison.runs for msg in r.issues]
    return items + comparison.notes


RUN_COLUMNS = (
    "name", "recipe", "variant", "backend", "hardware", "model", "data", "seed", "status", "steps",
    "token_budget", "final_train_loss", "final_eval_loss", "tokens_per_s", "peak_mem_gib", "wall_time_s",
    "diverged_step", "divergence_cause", "source", "path",
)  # fmt: skip


def run_record(r: Run) -> dict[str, Any]:
    """One row of runs.csv."""
    s = r.summary or {}
    return {
        "name": r.name, "recipe": r.recipe, "variant": r.variant, "backend": r.backend,
        "hardware": r.hardware, "model": r.model, "data": r.data, "seed": r.seed, "status": r.status,
        "steps": r.steps, "token_budget": r.token_budget, "final_train_loss": s.get("final_train_loss"),
        "final_eval_loss": r.final_eval_loss, "tokens_per_s": r.tokens_per_s, "peak_mem_gib": r.peak_mem_gib,
        "wall_time_s": s.get("wall_time_s"), "diverged_step": s.get("diverged_step"),
        "divergence_cause": s.get("divergence_cause"), "source": r.source, "path": str(r.path),
    }  # fmt: skip


def _runs_table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    cols = ("name", "recipe", "variant", "backend", "hardware", "seed", "status", "steps", "token_budget",
            "final_train_loss", "final_eval_loss", "tokens_per_s", "peak_mem_gib")  # fmt: skip
    body = []
    for r in runs:
        rec = run_record(r)
        body.append([fmt_loss(rec[c]) if c.startswith("final") else _cell(rec[c]) for c in cols])
    return list(cols), body


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# --- renderers ------------------------------------------------------------------------------------


def _md_cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[Block], base: Path) -> str:
    out = []
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            out.append("#" * int(b.kind[1]) + " " + b.content)
        elif b.kind == "p":
            out.append(b.content)
        elif b.kind == "ul":
            out.append("\n".join(f"- {item}" for item in b.content))
        elif b.kind == "table":
            header, body = b.content
            lines = ["| " + " | ".join(map(_md_cell, header)) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in body]
            out.append("\n".join(lines))
        elif b.kind == "img":
            path, caption = b.content
            rel = path.relative_to(base).as_posix()
            out.append(f"![{caption}]({rel})\n\n*{caption}* ([SVG]({rel[:-4]}.svg))")
    return "\n\n".join(out) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%}figure{margin:1.5em 0}
figcaption{font-size:12px;color:#555}li{margin:.3em 0}"""


def render_html(blocks: list[Block]) -> str:
    """One self-contained page: the PNG figures are embedded as base64 data URIs."""
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>lowp report</title>",
        f"<style>{_CSS}</style>",
    ]
    out.append("</head><body>")
    esc = html.escape
    for b in blocks:
        if b.kind in ("h1", "h2", "h3"):
            out.append(f"<{b.kind}>{esc(b.content)}</{b.kind}>")
        elif b.kind == "p":
            out.append(f"<p>{esc(b.content)}</p>")
        elif b.kind == "ul":
            out.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in b.content) + "</ul>")
        elif b.kind == "table":
            header, body = b.content
            rows = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in body)
            out.append("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + f"</tr>{rows}</table>")
        elif b.kind == "img":
            path, caption = b.content
            data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
            out.append(f"<figure><img alt='{esc(caption)}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{esc(caption)}</figcaption></figure>")  # fmt: skip
    out.append("</body></html>")
    return "\n".join(out)


# --- writing --------------------------------------------------------------------------------------


def write_csv(rows: list[dict[str, Any]], path: str | Path, columns: tuple[str, ...] = COLUMNS) -> Path:
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    return path


def write_figures(comparison: Comparison, out: Path) -> dict[str, list[tuple[str, Path, str]]]:
    from analysis import plots

    figures: dict[str, list[tuple[str, Path, str]]] = {}
    for g in comparison.groups:
        for name, fig, caption in plots.group_figures(g):
            png, _svg = plots.save(fig, out / "plots", f"{g.key.slug}_{name}")
            figures.setdefault(g.key.slug, []).append((name, png, caption))
    return figures


def write_report(comparison: Comparison, out: str | Path, inputs: list[str], *, figures: bool = True) -> Path:
    """Write comparison.csv, runs.csv, report.md, plots/ and report.html under `out`; returns the html."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(comparison.rows, out / "comparison.csv")
    write_csv([run_record(r) for r in comparison.runs], out / "runs.csv", RUN_COLUMNS)
    figs = write_figures(comparison, out) if figures else {}
    blocks = build_blocks(comparison, figs, inputs)
    (out / "report.md").write_text(render_markdown(blocks, out), encoding="utf-8")
    html_path = out / "report.html"
    html_path.write_text(render_html(blocks), encoding="utf-8")
    return html_path


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 1 no runs found, 2 bad arguments)."""
    p = argparse.ArgumentParser(
        prog="python -m analysis.report",
        description="Compare the low-precision runs under DIR... with their BF16 baselines and write "
        "comparison.csv, runs.csv, report.md and a self-contained report.html. Reads run directories "
        "(run.json) and W&B offline runs (wandb/offline-run-*/run-*.wandb) from disk only; it does not "
        "read from a W&B server.",
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
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.dirs[0]) / "report"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RunWarning)
        try:
            runs = load_runs(args.dirs)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if not runs:
        print(
            f"error: no run directories (run.json) or W&B offline runs under {' '.join(args.dirs)}",
            file=sys.stderr,
        )
        return 1
    comparison = compare(runs, smooth_frac=args.smooth_frac)
    html_path = write_report(comparison, out, [str(d) for d in args.dirs], figures=not args.no_plots)
    print_table(comparison)
    for note in comparison.notes:
        print(f"note: {note}")
    print(f"\nreport: {html_path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
