"""Figures of a comparison (matplotlib, object API: no pyplot state, any backend).

Each function takes a compared `Group` (or a run) and returns a `Figure`; `save` writes it as PNG and
SVG; `group_figures` lists every figure of a group with a caption saying how it was made.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from analysis import keys as K
from analysis.compare import EARLY_FRAC, PUBLIC_ANCHORS, Arm, Group, band_edges
from analysis.run import Run
from analysis.telemetry import load_numerics, numerics_matrix

_COLORS = {
    "bf16": "#222222", "delayed": "#1f77b4", "tensorwise": "#2ca02c", "blockwise": "#17becf",
    "mxfp8": "#9467bd", "nvfp4": "#d62728", "int4_qat": "#ff7f0e", "custom": "#8c564b",
}  # fmt: skip
_EXTRA = ["#e377c2", "#7f7f7f", "#bcbd22", "#aec7e8", "#ffbb78", "#98df8a"]


def color(arm: Arm) -> str:
    c = _COLORS.get(str(arm.recipe))
    if c is None:
        c = _EXTRA[hash(str(arm.recipe)) % len(_EXTRA)]
    return c


def _style(arm: Arm) -> str:
    return "-" if arm.backend == K.NATIVE_BACKEND else "--"


def _label(arm: Arm) -> str:
    seeds = ",".join(str(r.seed) for r in arm.runs)
    return f"{arm.recipe} [{arm.variant}] {arm.backend} s{seeds}"


def _note(fig: Figure, text: str) -> Figure:
    """A figure that says why there is nothing to plot (an axes, so notebooks render it too)."""
    ax = fig.axes[0] if fig.axes else fig.add_subplot()
    ax.clear()
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=10, transform=ax.transAxes)
    return fig


def _arm_mean(arm: Arm, attr: str) -> np.ndarray | None:
    """Seed mean of a per-run grid curve (`gap_curve`, or the smoothed loss when attr='loss')."""
    curves = []
    for res in arm.results:
        if attr == "loss":
            g = res.gap_vs_mean
            curves.append(None if g is None else g)
        else:
            curves.append(getattr(res, attr))
    curves = [c for c in curves if c is not None]
    if not curves:
        return None
    with np.errstate(invalid="ignore"):
        stack = np.array(curves)
        n = np.isfinite(stack).sum(0)
        return np.where(n > 0, np.nansum(stack, 0) / np.maximum(n, 1), np.nan)


def loss_vs_tokens(group: Group) -> Figure:
    """Smoothed train loss of every arm (seed mean) over the BF16 band (min/max and mean +- 2 sigma)."""
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(f"Train loss (smoothed) vs tokens\n{group.key}", fontsize=9)
    ax.set_xlabel("tokens")
    ax.set_ylabel("train loss (trailing mean)")
    base = group.baseline
    if base is None:
        ax.set_title(f"Train loss vs tokens: NO BF16 BASELINE\n{group.key}", fontsize=9)
        for arm in group.arms:
            for r in arm.runs:
                loss = r.train.get(K.LOSS_TRAIN)
                if loss is not None:
                    ax.plot(r.train[K.TOKENS], loss, _style(arm), color=color(arm), lw=1, label=r.name)
        if ax.lines:
            ax.legend(fontsize=7)
        return fig
    band, x = base.band, base.grid
    ax.fill_between(x, band["min"], band["max"], color="0.6", alpha=0.35, label="BF16 seeds min-max")
    if np.isfinite(band["std"]).any():
        for sign in (-2, 2):
            ax.plot(x, band["mean"] + sign * band["std"], ":", color="0.3", lw=0.8)
        ax.plot([], [], ":", color="0.3", label="BF16 mean ± 2σ")
    for arm in group.arms:
        g = _arm_mean(arm, "loss")
        if g is not None:
            ax.plot(x, band["mean"] + g, _style(arm), color=color(arm), lw=1.3, label=_label(arm))
    late = x >= x[0] + EARLY_FRAC * (x[-1] - x[0])
    ys = [ln.get_ydata()[late] for ln in ax.lines if len(ln.get_ydata()) == len(x)]
    ys = np.concatenate(ys) if ys else np.array([])
    if np.isfinite(ys).any():
        lo, hi = np.nanmin(ys), np.nanmax(ys)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    ax.legend(fontsize=7)
    return fig


def loss_gap(group: Group) -> Figure:
    """Relative train-loss gap to BF16 (paired by seed where possible) with the BF16 band and anchors."""
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(f"Loss gap vs BF16 (relative, smoothed train loss)\n{group.key}", fontsize=9)
    base = group.baseline
    if base is None:
        return _note(fig, f"No BF16 baseline in this group:\n{group.key}\nno gap is computed.")
    band, x = base.band, base.grid
    lo, hi = band_edges(band)
    ax.fill_between(x, 100 * lo / band["mean"], 100 * hi / band["mean"], color="0.6", alpha=0.35,
                    label="BF16 band (wider of min-max, ± 2σ)")  # fmt: skip
    ax.axhline(0, color="0.2", lw=0.8)
    for arm in group.arms:
        if arm.role == "baseline":
            continue
        g = _arm_mean(arm, "gap_curve")
        if g is not None:
            ax.plot(x, 100 * g / band["mean"], _style(arm), color=color(arm), lw=1.3, label=_label(arm))
    _anchor_lines(ax, {str(a.recipe) for a in group.arms}, horizontal=True)
    ax.set_xlabel("tokens")
    ax.set_ylabel("gap to BF16 (% of BF16 loss)")
    ax.legend(fontsize=7)
    return fig


def _anchor_lines(ax, recipes: set[str], horizontal: bool) -> None:
    for recipe, (value, text) in PUBLIC_ANCHORS.items():
        if recipe in recipes:
            line = ax.axhline if horizontal else ax.axvline
            line(100 * value, color=_COLORS.get(recipe, "0.4"), ls="-.", lw=0.9, label=f"public: {text}")


def speed_memory(group: Group) -> Figure:
    """Throughput and peak-memory ratios to native BF16 of the native arms of the group."""
    fig = Figure(figsize=(8, 3.8), layout="constrained")
    native = [a for a in group.arms if a.row.get("throughput_ratio") is not None]
    emulated = sorted({str(a.recipe) for a in group.arms if a.backend != K.NATIVE_BACKEND})
    if not native:
        why = {a.row.get("speed_note") for a in group.arms} - {None, ""}
        return _note(fig, f"Speed and memory: {'; '.join(sorted(why)) or 'n/a'}\n{group.key}\n"
                     "Emulated runs never contribute speed or memory.")  # fmt: skip
    fig.suptitle(f"Native (te) vs native BF16 on {group.key.hardware}\n{group.key}", fontsize=9)
    labels = [f"{a.recipe}\n{a.variant}" for a in native]
    for i, (col, title) in enumerate(
        (("throughput_ratio", "throughput / BF16"), ("memory_ratio", "peak memory / BF16"))
    ):
        ax = fig.add_subplot(1, 2, i + 1)
        vals = [a.row.get(col) or np.nan for a in native]
        ax.bar(range(len(native)), vals, color=[color(a) for a in native])
        ax.axhline(1.0, color="0.2", lw=0.8)
        ax.set_xticks(range(len(native)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        for j, v in enumerate(vals):
            if np.isfinite(v):
                ax.text(j, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=7)
    if emulated:
        fig.text(0.01, 0.01, "not shown (emulated, numerics only): " + ", ".join(emulated), fontsize=7)
    return fig


def pareto(group: Group) -> Figure:
    """Throughput ratio against relative final loss gap for native arms; the frontier joined."""
    fig = Figure(figsize=(6.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(f"Speed vs loss gap (native only)\n{group.key}", fontsize=9)
    pts = [(100 * a.row["gap_rel"], a.row["throughput_ratio"], a) for a in group.arms
           if a.row.get("gap_rel") is not None and a.row.get("throughput_ratio") is not None]  # fmt: skip
    if not pts:
        return _note(fig, f"No native run with both a loss gap and a BF16-relative speed:\n{group.key}")
    for x, y, a in pts:
        ax.scatter([x], [y], color=color(a), s=40, zorder=3)
        ax.annotate(
            f"{a.recipe} [{a.variant}]", (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points"
        )
    front = sorted((p for p in pts if not any(q[0] <= p[0] and q[1] >= p[1] and q != p for q in pts)),
                   key=lambda p: p[0])  # fmt: skip
    ax.plot(
        [p[0] for p in front], [p[1] for p in front], "-", color="0.5", lw=0.8, zorder=2, label="frontier"
    )
    _anchor_lines(ax, {str(p[2].recipe) for p in pts}, horizontal=False)
    ax.axvline(0, color="0.2", lw=0.8)
    ax.axhline(1, color="0.2", lw=0.8)
    ax.set_xlabel(f"final loss gap to BF16 (%, {pts[0][2].row['gap_metric']})")
    ax.set_ylabel("throughput / BF16")
    ax.legend(fontsize=7)
    return fig


def numerics_heatmap(run: Run) -> Figure | None:
    """Layer x tensor mean underflow and saturation over the run's telemetry; None without telemetry."""
    rows = load_numerics(run)
    if not rows:
        return None
    fig = Figure(figsize=(8, 1.5 + 0.3 * len({r["layer"] for r in rows})), layout="constrained")
    fig.suptitle(f"{run.label}, seed {run.seed}: mean over telemetry steps\n{run.name}", fontsize=9)
    for i, stat in enumerate(("underflow", "saturation")):
        layers, tensors, m = numerics_matrix(rows, stat)
        ax = fig.add_subplot(1, 2, i + 1)
        im = ax.imshow(100 * m, aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(tensors)), tensors, fontsize=7)
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        ax.set_title(f"{stat} (% of elements)", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
        if m.size <= 120:
            for (y, x), v in np.ndenumerate(100 * m):
                if np.isfinite(v):
                    ax.text(x, y, f"{v:.2g}", ha="center", va="center", fontsize=6, color="w")
    return fig


def group_figures(group: Group) -> list[tuple[str, Figure, str]]:
    """(name, figure, caption) for every figure of a group."""
    how = f"{len(group.runs)} runs; {group.key}"
    out = [
        ("loss", loss_vs_tokens(group), f"Smoothed train loss (seed mean) over the BF16 seed band. {how}"),
        ("gap", loss_gap(group), f"Relative train-loss gap to BF16, paired by seed where seeds match. {how}"),
        (
            "speed_memory",
            speed_memory(group),
            f"Native runs only, vs native BF16 on the same hardware. {how}",
        ),
        ("pareto", pareto(group), f"Throughput ratio vs final loss gap, native runs only. {how}"),
    ]
    for arm in group.arms:
        if arm.recipe == K.BASELINE_RECIPE:
            continue
        for run in arm.runs:
            fig = numerics_heatmap(run)
            if fig is not None:
                name = f"numerics_{arm.recipe}_{arm.variant}_{arm.backend}_s{run.seed}"
                out.append(
                    (name, fig, f"Underflow/saturation per layer and tensor, {run.name} (first seed).")
                )
                break
    return out


def save(fig: Figure, out_dir: str | Path, stem: str) -> list[Path]:
    """Write `stem.png` and `stem.svg`; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
    fig.savefig(paths[0], dpi=110)
    fig.savefig(paths[1])
    return paths
