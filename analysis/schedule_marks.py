"""Where a precision schedule switches recipes, drawn on a figure's loss curves (docs/schedules.md).

A scheduled run's run.json holds `provenance.schedule`: each phase's first step and recipe label. Each
arm whose runs switch gets a dotted vertical line in its colour at the token count of every switch
after the first phase, labelled with the recipe it switches to.
"""

from __future__ import annotations

from analysis.pairing import Group


def switches(run) -> list[tuple[float, str]]:
    """(tokens, recipe label) of each switch of a run (none for a run without a schedule)."""
    phases = run.provenance.get("schedule") or []
    per_step = run.provenance.get("tokens_per_step")
    if not per_step:
        return []
    return [(p["start_step"] * per_step, p["recipe_label"]) for p in phases[1:]]


def mark_switches(axes, group: Group, colors: dict[int, str]) -> None:
    """A dotted line per arm and switch on each of `axes`; `colors`: plots.arm_colors(group)."""
    for arm in group.arms:
        marks = sorted({s for x in arm.results for s in switches(x.run)})
        for i, ax in enumerate(axes):
            for tokens, label in marks:
                ax.axvline(tokens, color=colors[id(arm)], ls=":", lw=1.0,
                           label=f"{arm.name}: {label} from here" if i == 0 else None)  # fmt: skip
            if marks and i == 0:
                ax.legend(fontsize=7)
