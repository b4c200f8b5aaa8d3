"""Figures of a comparison (matplotlib, object API: no pyplot state, any backend).

Each function takes a compared `Group` and returns a `Figure`, or None when the group has nothing to
draw (the report then says in one line what is absent and why: `absent_reason`). Losses are in nats.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

from analysis import keys as K
from analysis.pairing import EARLY_FRAC, PUBLIC_ANCHORS, Arm, Group, eval_at
from analysis.schedule_marks import mark_switches
from analysis.telemetry import group_cells

_COLORS = {
    "bf16": "#222222", "delayed": "#1f77b4", "tensorwise": "#2ca02c", "blockwise": "#17becf",
    "mxfp8": "#9467bd", "nvfp4": "#d62728", "int4_qat": "#ff7f0e", "custom": "#8c564b",
}  # fmt: skip
_EXTRA = ["#e377c2", "#7f7f7f", "#bcbd22", "#1f77b4", "#ff7f0e", "#2ca02c", "#8c564b"]


def arm_colors(group: Group) -> dict[int, str]:
    """A colour per arm: the recipe's, and distinct ones for further variants of the same recipe."""
    out, used = {}, set()
    extra = iter(_EXTRA * 3)
    for a in group.arms:
        c = _COLORS.get(str(a.recipe))
        if c is None or c in used:
            c = next(c for c in extra if c not in used)
        used.add(c)
        out[id(a)] = c
    return out


def _style(arm: Arm) -> str:
    return "-" if arm.backend == K.NATIVE_BACKEND else "--"


def _floor(group: Group) -> float | None:
    floors = [r.loss_floor for r in group.runs if r.loss_floor is not None]
    return float(np.mean(floors)) if floors else None


def _seed_stack(arm: Arm, grid: np.ndarray, which: str) -> np.ndarray | None:
    if which == "train":
        rows = [x.curve.at(grid) for x in arm.results if x.curve is not None]
    else:
        rows = [eval_at(x.run, grid) for x in arm.results]
        rows = [r for r in rows if r is not None]
    return np.array(rows) if rows else None


def loss_curves(group: Group) -> Figure | None:
    """Train (smoothed) and eval loss vs tokens: BF16 seed band and mean, every arm's seed mean, floor."""
    base = group.baseline
    if base is None:
        return None
    colors = arm_colors(group)
    panels = [("train", base.grid, "train loss, trailing mean (nats)")]
    if base.eval_grid is not None and len(base.eval_grid) > 1:
        panels.append(("eval", base.eval_grid, "eval loss (nats)"))
    fig = Figure(figsize=(6.5 * len(panels), 4.4), layout="constrained")
    floor = _floor(group)
    for i, (which, grid, ylabel) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        bstack = base.stack if which == "train" else base.eval_stack
        with np.errstate(invalid="ignore"):
            mean = np.nanmean(bstack, 0)
        ax.fill_between(grid, np.nanmin(bstack, 0), np.nanmax(bstack, 0), color="0.55", alpha=0.35,
                        label=f"BF16 seeds min-max (n={len(base.runs)})")  # fmt: skip
        ax.plot(grid, mean, "-", color="black", lw=2.2, label="BF16 seed mean")
        for arm in group.arms:
            if arm.role == "baseline":
                continue
            st = _seed_stack(arm, grid, which)
            if st is not None:
                with np.errstate(invalid="ignore"):
                    m = np.nanmean(st, 0)
                ax.plot(grid, m, _style(arm), color=colors[id(arm)], lw=1.4,
                        label=f"{arm.name} mean of {len(st)}")  # fmt: skip
        # train: past the early transient; eval has a few points, all of them on the axis
        late = grid >= grid[0] + EARLY_FRAC * (grid[-1] - grid[0]) if which == "train" else grid == grid
        ys = np.concatenate([ln.get_ydata()[late] for ln in ax.lines] or [np.zeros(0)])
        ax.set_title(f"{which} loss vs tokens" + loss_axis(ax, ys, floor), fontsize=10)
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    mark_switches(fig.axes, group, colors)  # precision schedules: where each arm switches recipes
    fig.suptitle(f"{group.key}", fontsize=8)
    return fig


def loss_axis(ax, ys: np.ndarray, floor: float | None) -> str:
    """Set the y-axis to span the curves past the early transient; draw the loss floor when it falls
    inside, else return the words that state it (a floor far below would squash the curves)."""
    ys = ys[np.isfinite(ys)]
    if not len(ys):
        return ""
    lo, hi = ys.min(), ys.max()
    pad = 0.06 * (hi - lo + 1e-9)
    ax.set_ylim(lo - pad, hi + pad)
    if floor is None:
        return ""
    if lo - pad <= floor:
        ax.axhline(floor, color="#555", ls=":", lw=1.2, label=f"loss floor {floor:.3f} nats (data entropy)")
        return ""
    below = lo - floor
    return f"\nloss floor {floor:.3f} nats (data entropy), {below:.2f} below the lowest curve: off this axis"


def _has_data(band: dict[str, np.ndarray] | None) -> bool:
    return band is not None and bool(np.isfinite(band["mean"]).any())


def gap_axis(ax, arms: list[Arm], which: str) -> list[str]:
    """Scale the gap axis to the arms' bands past the early transient (and 0); draw a public anchor
    only where it falls on that scale, labelled with the scale it was measured at; return a line for
    each anchor left off."""
    vals = []
    for arm in arms:
        b = getattr(arm, f"{which}_band")
        if _has_data(b):
            t = b["tokens"]
            late = t >= t[0] + EARLY_FRAC * (t[-1] - t[0])
            vals += [100 * b[k][late] for k in ("mean", "lo", "hi")]
    v = np.concatenate(vals + [np.zeros(1)])
    v = v[np.isfinite(v)]
    lo, hi = v.min(), v.max()
    pad = 0.08 * (hi - lo + 1e-9)
    lo, hi = lo - pad, hi + pad
    ax.set_ylim(lo, hi)
    off = []
    for recipe, (value, text) in PUBLIC_ANCHORS.items():
        if not any(a.recipe == recipe for a in arms):
            continue
        if lo <= 100 * value <= hi:
            color = _COLORS.get(recipe, "0.4")
            ax.axhline(100 * value, color=color, ls="-.", lw=0.9, label=f"public: {text}")
        else:
            off.append(f"public: {text} ({100 * value:+.2f}%) is off this scale")
    return off


def gap_curves(group: Group) -> Figure | None:
    """Relative gap to BF16 along tokens, per arm, with its 95% seed interval as a band."""
    arms = [a for a in group.arms if a.role != "baseline" and (a.train_band or a.eval_band)]
    if group.baseline is None or not arms:
        return None
    colors = arm_colors(group)
    panels = [w for w in ("train", "eval") if any(_has_data(getattr(a, f"{w}_band")) for a in arms)]
    if not panels:
        return None
    fig = Figure(figsize=(6.5 * len(panels), 4.4), layout="constrained")
    for i, which in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.axhline(0, color="black", lw=1)
        for arm in arms:
            b = getattr(arm, f"{which}_band")
            if not _has_data(b):
                continue
            c = colors[id(arm)]
            ax.plot(b["tokens"], 100 * b["mean"], _style(arm), color=c, lw=1.4, label=arm.name)
            ax.fill_between(b["tokens"], 100 * b["lo"], 100 * b["hi"], color=c, alpha=0.18, lw=0)
        off = gap_axis(ax, arms, which)
        ax.set_xlabel("tokens")
        ax.set_ylabel("gap to BF16 (% of BF16 loss), band = 95% CI")
        ax.set_title("\n".join([f"{which} loss gap vs tokens", *off]), fontsize=8 if off else 10)
        ax.legend(fontsize=7)
    fig.suptitle(f"{group.key}", fontsize=8)
    return fig


def pareto(group: Group) -> Figure | None:
    """Native arms: throughput and memory vs BF16 against the loss gap [CI]; the Pareto front joined."""
    rows = [(a, a.row) for a in group.arms if a.row.get("throughput_ratio") is not None
            and (a.row.get("gap_rel") is not None or a.role == "baseline")]  # fmt: skip
    if not [a for a, _ in rows if a.role != "baseline"]:
        return None
    colors = arm_colors(group)
    fig = Figure(figsize=(12, 4.4), layout="constrained")
    for i, (col, title, better) in enumerate(
        (("throughput_ratio", "throughput / BF16 (higher is better)", "max"),
         ("memory_ratio", "peak memory / BF16 (lower is better)", "min"))
    ):  # fmt: skip
        ax = fig.add_subplot(1, 2, i + 1)
        pts = []
        for a, r in rows:
            y = r.get(col)
            if y is None:
                continue
            x = 0.0 if a.role == "baseline" else 100 * r["gap_rel"]
            pts.append((x, y, a))
            xerr = None
            if r.get("gap_rel_lo") is not None:
                xerr = [[x - 100 * r["gap_rel_lo"]], [100 * r["gap_rel_hi"] - x]]
            yerr = None
            if col == "throughput_ratio" and r.get("throughput_ratio_lo") is not None:
                yerr = [[y - r["throughput_ratio_lo"]], [r["throughput_ratio_hi"] - y]]
            ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", color=colors[id(a)], capsize=3, zorder=3)
            ax.annotate(a.name, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
        sign = 1 if better == "max" else -1
        front = sorted((p for p in pts if not any(q is not p and q[0] <= p[0] and sign * q[1] >= sign * p[1]
                                                  and (q[0], q[1]) != (p[0], p[1]) for q in pts)),
                       key=lambda p: p[0])  # fmt: skip
        ax.plot([p[0] for p in front], [p[1] for p in front], "-", color="0.4", lw=1, label="Pareto front")
        ax.axvline(0, color="0.2", lw=0.8)
        ax.axhline(1, color="0.2", lw=0.8)
        ax.set_xlabel(f"final loss gap to BF16 (%, {rows[-1][1].get('gap_metric')}), bars = 95% CI")
        ax.set_ylabel(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"native (te) runs vs native BF16, {group.key}", fontsize=8)
    return fig


def absent_reason(group: Group, name: str) -> str:
    """One line saying why figure `name` is absent for `group`."""
    if group.baseline is None:
        return "no completed BF16 run in this group, so no band and no gap"
    if name == "pareto":
        notes = sorted({a.row.get("speed_note") for a in group.arms if a.row.get("speed_note")})
        return (
            "no native (te) low-precision run with a native BF16 baseline in this group "
            f"({'; '.join(notes) or 'no speed recorded'}); emulated speed is not the recipe's speed"
        )
    if name == "gap":
        return "no low-precision run in this group"
    if name == "telemetry":
        return "no run of this group recorded telemetry (telemetry_interval=0, or only BF16 runs)"
    return "nothing to draw"


# --- telemetry --------------------------------------------------------------------------------------


TELEMETRY_PANELS = (
    ("underflow", "underflow (% of elements flushed to 0)"),
    ("saturation", "saturation (% of elements at the format's largest code)"),
    ("sqnr_db", "SQNR (dB)"),
)


def telemetry_heatmaps(cells: pd.DataFrame, title: str) -> Figure | None:
    """Layer x (arm, tensor) heatmaps of mean underflow, saturation and SQNR, each stat on ONE colour
    scale across all arms (log scale for the percentages), so a 10% flush and a 0.01% one look apart."""
    if cells is None or not len(cells):
        return None
    cols = list(dict.fromkeys(zip(cells["arm"], cells["tensor"], strict=True)))
    layers = list(dict.fromkeys(cells["layer"]))
    panels = [(stat, label) for stat, label in TELEMETRY_PANELS if _finite_any(cells, stat)]
    if not panels:
        return None
    width = min(26, max(9.0, 3 + 0.6 * len(cols)))
    fig = Figure(figsize=(width, 1.2 + (2.4 + 0.66 * len(layers)) * len(panels)), layout="constrained")
    fig.suptitle(textwrap.fill(title, int(width * 14)), fontsize=9)
    for i, (stat, label) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        m = cells.pivot_table(index="layer", columns=["arm", "tensor"], values=stat, aggfunc="mean")
        m = m.reindex(index=layers, columns=pd.MultiIndex.from_tuples(cols))
        v = m.to_numpy(dtype=float) * (100 if stat != "sqnr_db" else 1)
        im, label = _heatmap(ax, v, stat, label)
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        ax.set_xticks(range(len(cols)), [t for _, t in cols], fontsize=6)
        lines = 1
        for arm in dict.fromkeys(a for a, _ in cols):
            idx = [j for j, (a, _) in enumerate(cols) if a == arm]
            ax.axvline(idx[-1] + 0.5, color="white", lw=2)
            # an arm's name wrapped to the width of its columns, so neighbours do not overlap
            text = textwrap.fill(arm, max(14, int(width * 12 * len(idx) / len(cols))))
            lines = max(lines, text.count("\n") + 1)
            ax.text(np.mean(idx), -0.7, text, ha="center", va="bottom", fontsize=6)
        ax.set_title(label + ", one scale for all recipes", fontsize=8, pad=8 + 8 * lines)
        fig.colorbar(im, ax=ax, shrink=0.9)
    return fig


def _finite_any(cells: pd.DataFrame, stat: str) -> bool:
    return stat in cells and bool(np.isfinite(pd.to_numeric(cells[stat], errors="coerce")).any())


ZERO_COLOR = "#9ecae1"
"""Cells whose statistic is exactly 0 (no element flushed or saturated), apart from the log scale."""


def _heatmap(ax, v: np.ndarray, stat: str, label: str):
    """imshow of one statistic; percentages on a log scale with exact zeros in their own colour."""
    finite = v[np.isfinite(v)]
    if stat == "sqnr_db":
        norm = Normalize(*(np.nanmin(finite), np.nanmax(finite)) if len(finite) else (0, 1))
        return ax.imshow(v, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest"), label
    pos = finite[finite > 0]
    lo = max(pos.min(), 1e-4) if len(pos) else 1e-4
    hi = max(finite.max() if len(finite) else 1.0, lo * 10)
    cmap = matplotlib.colormaps["magma"].with_extremes(under=ZERO_COLOR, bad="white")
    v = np.where(v <= 0, lo / 10, np.maximum(v, lo))
    im = ax.imshow(v, aspect="auto", cmap=cmap, norm=LogNorm(lo, hi, clip=False), interpolation="nearest")
    if (finite == 0).any():
        label += "; exact 0 in light blue"
    return im, label


def save(fig: Figure, out_dir: str | Path, stem: str) -> list[Path]:
    """Write `stem.png` and `stem.svg`; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
    fig.savefig(paths[0], dpi=100)
    fig.savefig(paths[1])
    return paths


def group_figures(group: Group, numerics: pd.DataFrame | None = None) -> list[tuple[str, Figure | None, str]]:
    """(name, figure or None, caption) for every figure of a group; None: see `absent_reason`."""
    how = f"{len(group.runs)} runs; {group.key}"
    cells = group_cells(group, numerics) if numerics is not None else None
    return [
        ("pareto", pareto(group),
         f"Native runs: speed and memory vs native BF16 against the final loss gap, 95% CIs. {how}"),
        ("loss", loss_curves(group),
         f"Loss vs tokens: BF16 seed band (grey) and seed mean (black), each recipe's seed mean. {how}"),
        ("gap", gap_curves(group),
         f"Gap to BF16 along tokens with the 95% seed interval (paired by seed where seeds match). {how}"),
        ("telemetry", telemetry_heatmaps(cells, f"telemetry, mean over steps and seeds; {group.key}"),
         f"Quantization telemetry per layer and tensor, one colour scale per statistic. {how}"),
    ]  # fmt: skip
