"""Does a recipe's loss stay inside the BF16 seed band? Judged on packed curves (benchmarks.curves'
result files, analysis.collect's), several files at once.

    python -m analysis.seed_band RESULT.json [RESULT.json ...] [--key eval] [--out OUT.json]

Every completed run of BF16 at its preset is a seed of the band (one per seed: a seed found in two
files keeps the first file's run, so list the file of the band's own call first). The other runs are
grouped by recipe label (the family and the recipe fields that differ from its preset, e.g.
`tensorwise + fast accumulation`; a name from before the families, such as `tensorwise_fastacc`, is
read as its family and label), and each run is judged against the BF16 run of its own seed (same init
and data order), with analysis.fidelity.criterion: at every logged step, |run - bf16 of its seed|
against the mean |seed_i - seed_j| over all pairs of BF16 seeds. A recipe holds where every one of its
seeds holds; the verdict is on `--key` (eval: the held-out loss at every eval point), the other
curve's violations are reported beside it. Runs without a BF16 run of their seed are listed, not judged.

Pairing by seed assumes a seed's runs differ only by their recipe. Where a run is not deterministic run
to run (on CUDA, kernels that add with atomics, e.g. TE's fused attention backward by default;
benchmarks.rerun_check tells), BF16 itself leaves its seed's trajectory. `--rerun FILE` is the control:
the BF16 runs of another call of the same spec (same seeds and steps) are judged like a recipe, as `bf16
rerun`. Where the rerun fails, the criterion flags run-to-run nondeterminism on these runs, and a
recipe's violations do not separate it from BF16; the table then says so, and gives each arm's mean
|gap| per eval beside the rerun's. Verdicts stay as the criterion gives them.

`--criterion mean` judges the seed-averaged curve instead: at every eval, the mean over a recipe's seeds
of (run - BF16 of its seed) must be at most the band, one-sided (a recipe may not be worse on average by
more than two BF16 seeds differ; lower is not a loss of quality). It is for runs whose trajectories any
perturbation scatters: on the MoE slices a change of BF16's summation order alone (lowp's grouped
kernels, the same rounding points as TE's) leaves each seed's trajectory by about the band, on
deterministic runs (backend.deterministic=true) whose BF16 rerun is equal to the bit, so the per-run
criterion flags every perturbation there (benchmarks/RESULTS.md, "Loss checks of MoE runs"). Averaging
over seeds keeps a penalty that every seed pays and shrinks the scatter by the square root of the seeds.
Both verdicts are printed; `--criterion` says which is `holds`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from analysis import keys as K
from analysis.fidelity import criterion, criterion_free
from analysis.run import recipe_identity

KEYS = ("eval", "train")
RERUN = "bf16 rerun"
CRITERIA = ("paired", "mean")


def load_runs(paths: list[Path]) -> list[dict]:
    """The completed runs of the files, in order: {label, file, recipe (the arm), seed, eval, train}."""
    runs = []
    for path in paths:
        for label, r in json.loads(Path(path).read_text()).get("runs", {}).items():
            s = r.get("summary") or {}
            if s.get("status") != "completed":
                continue
            arm = _arm(label, s)
            runs.append({"label": label, "file": Path(path).name, "recipe": arm, "seed": s["seed"]})
            runs[-1].update({k: r[k] for k in KEYS})
    return runs


def rerun_runs(paths: list[Path]) -> list[dict]:
    """The completed BF16 runs of `paths` as the `bf16 rerun` arm (the control for nondeterminism)."""
    runs = [r for r in load_runs(paths) if r["recipe"] == K.BASELINE_RECIPE]
    if not runs:
        raise ValueError(f"seed_band: --rerun {', '.join(map(str, paths))} holds no completed BF16 run")
    return [{**r, "recipe": RERUN} for r in runs]


def _arm(label: str, summary: dict) -> str:
    """The arm a run belongs to: its recipe label, then its presets where they are not the plain ones.

    A run written before recipe labels has only its name to tell a field override apart: where the
    run's label (without the seed suffix) goes on past its recipe's name, the rest names the override,
    e.g. `tensorwise_fp8headbwd_fastacc_e4m3grad_s0` is `tensorwise + FP8 LM head backward + fast
    accumulation + e4m3grad`, an arm of its own.
    """
    recipe, written = summary["recipe"], summary.get("recipe_label")
    _, arm = recipe_identity(recipe, written)
    stem = re.sub(r"_s\d+$", "", label)
    if not written and stem.startswith(f"{recipe}_"):
        arm = f"{arm} + {stem[len(recipe) + 1 :]}"
    variant = summary.get("variant")
    return f"{arm} [{variant}]" if variant and variant != K.DEFAULT_VARIANT else arm


def judge(runs: list[dict], key: str = "eval", by: str = "paired") -> dict:
    """The band (BF16 seeds) and each other recipe's verdicts, `holds` by criterion `by` (paired: every
    run against its seed's; mean: the seed-averaged gap, one-sided); see the module docstring."""
    if by not in CRITERIA:
        raise ValueError(f"seed_band: criterion {by!r}; use one of {', '.join(CRITERIA)}")
    band: dict[int, dict] = {}
    for r in runs:
        if r["recipe"] == K.BASELINE_RECIPE:
            band.setdefault(r["seed"], r)
    if len(band) < 2:
        raise ValueError(
            f"seed_band: {len(band)} BF16 seed(s) among the runs; the band needs at least 2: add a file "
            "with BF16 runs of at least two seeds"
        )
    seeds = [band[s] for s in sorted(band)]
    for r in runs:
        for k in KEYS:
            if [p[0] for p in r[k]] != [p[0] for p in seeds[0][k]]:
                raise ValueError(
                    f"seed_band: run {r['label']} ({r['file']}) logs {k} at other steps than BF16 seed "
                    f"{seeds[0]['seed']}: compare runs of the same steps, eval_interval and log_interval"
                )
    recipes: dict[str, dict] = {}
    for r in runs:
        if r["recipe"] == K.BASELINE_RECIPE:
            continue
        entry = recipes.setdefault(r["recipe"], {"runs": [], "unpaired": []})
        if r["seed"] not in band:
            entry["unpaired"].append(r["label"])
            continue
        bf16 = band[r["seed"]]
        c = {k: criterion(r, bf16, seeds, k) for k in KEYS}
        entry["runs"].append(
            {
                "label": r["label"],
                "file": r["file"],
                "seed": r["seed"],
                "final": {k: r[k][-1][1] for k in KEYS if r[k]},
                "signed": {k: criterion_free(r, bf16, k)["rows"] for k in KEYS},
                "violations": {k: c[k]["violating_steps_vs_mean_pairwise"] for k in KEYS},
            }
        )
    rows = criterion(seeds[0], seeds[1], seeds, key)["rows"]  # its last column is the seeds' own
    band_at = {step: gap for step, _, _, gap in rows}
    for entry in recipes.values():
        entry["runs"].sort(key=lambda x: x["seed"])
        entry["holds_paired"] = bool(entry["runs"]) and not any(x["violations"][key] for x in entry["runs"])
        signed = [x["signed"][key] for x in entry["runs"]]
        entry["mean_abs_gap"] = _mean_over_seeds(signed, abs)
        entry["mean_gap"] = _mean_over_seeds(signed, float)
        entry["mean_violations"] = [step for step, gap in entry["mean_gap"] if not gap <= band_at[step]]
        entry["holds_mean"] = bool(entry["runs"]) and not entry["mean_violations"]
        entry["holds"] = entry[f"holds_{by}"]
    return {
        "key": key,
        "criterion": by,
        "bf16_seeds": sorted(band),
        "band_files": sorted({b["file"] for b in seeds}),
        "mean_pairwise_gap": [[step, gap] for step, _, _, gap in rows],
        "recipes": recipes,
    }


def _mean_over_seeds(signed: list[list], f) -> list[list]:
    """[[step, mean over seeds of f(gap)], ...] of the runs' signed [[step, gap], ...] rows."""
    if not signed:
        return []
    return [[row[0], sum(f(r[i][1]) for r in signed) / len(signed)] for i, row in enumerate(signed[0])]


def table(result: dict) -> str:
    key = result["key"]
    w = max([28, *map(len, result["recipes"])])
    gaps = lambda rows: " ".join(f"{s}:{g:.4f}" for s, g in rows)  # noqa: E731
    lines = [
        f"BF16 seeds {result['bf16_seeds']}; mean pairwise gap ({key}): " + gaps(result["mean_pairwise_gap"]),
        f"{'recipe':{w}s} {'seed':>4s} {'final ' + key:>11s}  {key} - bf16 of its seed"
        f"{'':18s}violations ({key} / other)",
    ]
    other = next(k for k in KEYS if k != key)
    for name, entry in result["recipes"].items():
        for x in entry["runs"]:
            signed = " ".join(f"{d:+.4f}" for _, d in x["signed"][key])
            v = f"{x['violations'][key] or 'none'} / {x['violations'][other] or 'none'}"
            lines.append(f"{name:{w}s} {x['seed']:>4d} {x['final'][key]:11.4f}  {signed}  {v}")
        verdict = lambda ok: "holds" if ok else "FAILS"  # noqa: E731
        extra = f" (not judged, no BF16 run of their seed: {entry['unpaired']})" if entry["unpaired"] else ""
        mean = " ".join(f"{d:+.4f}" for _, d in entry["mean_gap"])
        lines.append(f"{name:{w}s} {'mean':>4s} {'':11s}  {mean}  {entry['mean_violations'] or 'none'}")
        lines.append(
            f"{name:{w}s} {verdict(entry['holds'])} on {key} at {len(entry['runs'])} seed(s) by the "
            f"{result['criterion']} criterion (paired: {verdict(entry['holds_paired'])}, seed-averaged: "
            f"{verdict(entry['holds_mean'])}){extra}"
        )
    rerun = result["recipes"].get(RERUN)
    if rerun and rerun["runs"]:
        lines.append(f"mean |{key} - bf16 of its seed| per eval, each arm:")
        lines += [
            f"  {name:{w}s} {gaps(e['mean_abs_gap'])}" for name, e in result["recipes"].items() if e["runs"]
        ]
        if not rerun["holds_paired"]:
            steps = sorted({s for x in rerun["runs"] for s in x["violations"][key]})
            lines.append(
                f"note: BF16 against its own rerun FAILS at {len(rerun['runs'])} seed(s) (evals {steps}): "
                "these runs are not deterministic run to run, so a recipe's violations do not separate it "
                "from BF16; compare its mean |gap| with the rerun's, or make the runs deterministic"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="curves result files")
    p.add_argument("--key", choices=KEYS, default="eval", help="the curve the verdict is on")
    p.add_argument(
        "--criterion",
        choices=CRITERIA,
        default="paired",
        help="paired: every run within the band of its seed's BF16 run; mean: the seed-averaged gap "
        "at most the band (runs a perturbation scatters: MoE)",
    )
    p.add_argument("--out", type=Path, help="also write the verdicts and per-step differences as JSON")
    p.add_argument(
        "--rerun",
        type=Path,
        nargs="+",
        default=[],
        help="another call's BF16 runs of the same spec: the control",
    )
    args = p.parse_args(argv)
    missing = [str(x) for x in [*args.results, *args.rerun] if not x.is_file()]
    if missing:
        msg = f"error: no such result file: {', '.join(missing)}; pass benchmarks.curves' JSON files"
        print(msg, file=sys.stderr)
        return 2
    try:
        runs = load_runs(args.results) + (rerun_runs(args.rerun) if args.rerun else [])
        result = judge(runs, args.key, args.criterion)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
