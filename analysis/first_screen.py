"""The report's first screen as a PNG, drawn with matplotlib (no browser needed): per group, the title,
the decision paragraph and the ranked verdict table, as `report.html` shows them first.

    python -m analysis.first_screen DIR... --out first_screen.png
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from matplotlib.figure import Figure

from analysis import frames, report

COLUMNS = ["rank", "recipe", "verdict", "gap [95% CI]", "would detect ≥", "seeds × steps"]


def figure(runs: frames.Runs) -> Figure:
    """One panel per group: title, decision paragraph (wrapped), verdict table."""
    comparison = frames.comparison_of(runs)
    comp = frames.comparison_frame(comparison)
    blocks = []
    for g in comparison.groups:
        df = report.group_rows(comp, g)
        table, _ = report.group_table(df)
        text = textwrap.fill(report.group_sentence(g, df), 190)
        blocks.append((f"{g.key.hardware} / {g.key.model} / {g.key.data}", text, table[[c for c in COLUMNS]]))
    height = sum(1.0 + 0.2 * b[1].count("\n") + 0.3 * (len(b[2]) + 1) for b in blocks) + 0.6
    fig = Figure(figsize=(16, height))
    fig.text(0.01, 1 - 0.3 / height, "lowp: which recipe? Low-precision recipes against BF16", fontsize=14,
             weight="bold", va="top")  # fmt: skip
    y = 1 - 0.65 / height
    for title, text, table in blocks:
        fig.text(0.01, y, title, fontsize=11, weight="bold", va="top")
        y -= 0.3 / height
        fig.text(0.01, y, text, fontsize=8.5, va="top", family="sans-serif",
                 bbox={"facecolor": "#f7f7ee", "edgecolor": "#b90", "pad": 4})  # fmt: skip
        y -= (0.35 + 0.2 * text.count("\n")) / height
        rows = 0.3 * (len(table) + 1) / height
        ax = fig.add_axes((0.01, y - rows, 0.98, rows))
        ax.axis("off")
        t = ax.table(cellText=table.astype(str).values, colLabels=list(table.columns), loc="upper left",
                     cellLoc="left")  # fmt: skip
        t.auto_set_font_size(False)
        t.set_fontsize(8)
        t.auto_set_column_width(list(range(len(table.columns))))
        y -= rows + 0.35 / height
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.first_screen", description=__doc__)
    p.add_argument("dirs", nargs="+", metavar="DIR")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    runs = frames.load(args.dirs)
    if not len(runs):
        print(f"error: no runs under {' '.join(args.dirs)}", file=sys.stderr)
        return 1
    figure(runs).savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
