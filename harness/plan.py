"""`python -m harness.plan RUN_DIR... --goal GOAL`: a precision plan from counterfactual telemetry.

    python -m harness.plan runs/ --goal max-lowp-flops --sqnr-floor-db 12 --out plan.yaml
    python -m harness.plan runs/ --goal max-bf16-modules --k 2 [--candidate nvfp4] [--ablation SWEEP_DIR]

Reads the runs (analysis.load) and their counterfactual rows (`telemetry.candidates`), ranks every
block linear by how much each candidate hurts it (analysis.precision_ranking: score_db, the worst of
its GEMM outputs' SQNR, its operands' SQNR and its flushed fraction, in dB), and assigns each
module a recipe under the goal:

- `max-lowp-flops --sqnr-floor-db X`: each module takes the fastest candidate (FP4 before FP8, then
  the order listed) whose score is at least X dB, else BF16;
- `max-bf16-modules --k K`: one candidate everywhere but the K modules it hurts most, which stay BF16;
  with `--ablation DIR` (a `plan_ablation` sweep), the module groups whose move to BF16 saved the
  most loss come first, then the telemetry ranking.

Writes the plan (goal, inputs, the ranking it used and one override per module) to `--out`, which
`stability=plan stability.plan_file=PATH` loads; Megatron-LM's `--te-precision-config-file` beside it
(`<out>.megatron.yaml`, harness.interop.megatron_precision) where Megatron can express every module's
recipe, else one line saying which module it cannot; and prints the TE CustomRecipe line
(harness.interop.te_plan). Exit 2 with one `error:` line for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import yaml

from harness import recipes
from harness.config.errors import ConfigError
from harness.config.schema import RecipeConfig
from harness.model.plan import PLAN_FORMAT
from harness.numerics import counterfactual

GOALS = ("max-lowp-flops", "max-bf16-modules")
_SPEED = {"fp4": 0, "fp8": 1, "bf16": 2}  # peak dtype -> order of preference (fastest first)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.plan", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "runs", nargs="+", help="run directories or sweep directories with telemetry.candidates rows"
    )
    p.add_argument("--goal", required=True, choices=GOALS)
    p.add_argument("--sqnr-floor-db", type=float, help="max-lowp-flops: the lowest score a module may take")
    p.add_argument("--k", type=int, help="max-bf16-modules: how many modules stay BF16")
    p.add_argument("--candidate", help="max-bf16-modules: the candidate's label (default: the only one)")
    p.add_argument("--ablation", help="max-bf16-modules: a plan_ablation sweep directory")
    p.add_argument("--out", default="plan.yaml", help="the plan file (default plan.yaml)")
    return p.parse_args(argv)


def candidate_recipes(runs) -> dict[str, RecipeConfig]:
    """label -> recipe of every candidate the runs' configs list (run.json config.telemetry)."""
    out: dict[str, RecipeConfig] = {}
    for r in runs.objects:
        entries = ((r.config or {}).get("telemetry") or {}).get("candidates") or []
        out.update({c.label: c.recipe for c in counterfactual.parse(entries)})
    return out


def assign(goal: str, scores, cands: dict[str, RecipeConfig], args, gains=None) -> dict[str, str | None]:
    """module -> candidate label (None: BF16) under `goal`, in the model's order (`scores`: analysis
    module_scores with an `order` column, the modules' forward order)."""
    modules = list(dict.fromkeys(scores.sort_values("order", kind="stable")["layer"]))
    score = {(r.layer, r.candidate): r.score_db for r in scores.itertuples(index=False)}
    if goal == "max-lowp-flops":
        order = sorted(cands, key=lambda c: _SPEED[recipes.get(cands[c].name).peak_dtype])
        order = [c for c in order if recipes.get(cands[c].name).quantizes_gemms]  # FLOPs at low precision
        pick = lambda m: next((c for c in order if score.get((m, c), -1e9) >= args.sqnr_floor_db), None)  # noqa: E731
        return {m: pick(m) for m in modules}
    cand = args.candidate or next(iter(cands))
    ranked = sorted(modules, key=lambda m: score.get((m, cand), 1e9))
    if gains is not None and len(gains):
        import fnmatch

        first = [m for g in gains.itertuples() if g.gain > 0 for m in ranked
                 if any(fnmatch.fnmatchcase(m, p) for p in g.patterns)]  # fmt: skip
        ranked = list(dict.fromkeys([*first, *ranked]))
    bf16 = set(ranked[: args.k])
    return {m: (None if m in bf16 else cand) for m in modules}


def _check(args, cands: dict) -> None:
    if not cands:
        raise ConfigError("runs: none has counterfactual rows; train with telemetry_interval>0 "
                          "telemetry.candidates=[...] first")  # fmt: skip
    if args.goal == "max-lowp-flops" and args.sqnr_floor_db is None:
        raise ConfigError(
            "--goal max-lowp-flops needs --sqnr-floor-db X (the lowest score_db a module may take)"
        )
    if args.goal == "max-bf16-modules":
        if args.k is None or args.k < 0:
            raise ConfigError("--goal max-bf16-modules needs --k K >= 0 (how many modules stay BF16)")
        if args.candidate is None and len(cands) > 1:
            raise ConfigError(f"--goal max-bf16-modules: the runs have {len(cands)} candidates; name one "
                              f"with --candidate ({', '.join(cands)})")  # fmt: skip
        if args.candidate is not None and args.candidate not in cands:
            raise ConfigError(
                f"--candidate {args.candidate}: not among the runs' candidates ({', '.join(cands)})"
            )


def _fields(r: RecipeConfig) -> dict:
    preset = recipes.default_fields(r.name)
    return {
        f.name: getattr(r, f.name)
        for f in dataclasses.fields(r)
        if getattr(r, f.name) != getattr(preset, f.name)
    }


def build(args) -> tuple[dict, dict[str, RecipeConfig | None]]:
    """(the plan file's contents, module -> recipe) for the parsed command line."""
    import analysis
    from analysis.precision_ranking import ablation_gains, counterfactual_frame, module_scores

    runs = analysis.load(args.runs)
    cands = candidate_recipes(runs)
    _check(args, cands)
    cf = counterfactual_frame(runs)
    order = {m: i for i, m in enumerate(dict.fromkeys(cf["layer"]))}  # forward order of the model
    scores = module_scores(cf)
    scores["order"] = scores["layer"].map(order)
    gains = ablation_gains(analysis.load([args.ablation])) if args.ablation else None
    chosen = assign(args.goal, scores, cands, args, gains)
    modules = {m: (cands[c] if c is not None else None) for m, c in chosen.items()}
    used = [c for c in chosen.values() if c is not None]
    uniform = max(set(used), key=used.count) if used else None
    plan = {
        "format": PLAN_FORMAT,
        "goal": args.goal,
        "inputs": {
            "runs": [str(Path(p).resolve()) for p in args.runs],
            "sqnr_floor_db": args.sqnr_floor_db, "k": args.k, "candidate": args.candidate,
            "ablation": str(Path(args.ablation).resolve()) if args.ablation else None,
            "candidates": sorted(cands), "telemetry_steps": int(cf["step"].nunique()),
            "models": sorted({str(((r.config or {}).get("model") or {}).get("name")) for r in runs.objects}),
        },
        "recipe": None if uniform is None else {"name": cands[uniform].name, **_fields(cands[uniform])},
        "modules": {m: (c or recipes.BASELINE) for m, c in chosen.items()},
        "overrides": [
            {"pattern": m, "recipe": r.name if r is not None else recipes.BASELINE,
             **({"fields": f} if r is not None and (f := _fields(r)) else {})}
            for m, r in modules.items()
        ],
        "ranking": [
            {k: (float(v) if isinstance(v, float) else v) for k, v in row.items() if k != "order"}
            for row in scores.to_dict("records")
            if args.goal == "max-lowp-flops" or row["candidate"] == (args.candidate or next(iter(cands)))
        ],
    }  # fmt: skip
    if gains is not None:
        plan["ablation"] = gains.to_dict("records")
    return plan, modules


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        plan, modules = build(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.write_text(yaml.safe_dump(plan, sort_keys=False, width=110))
    counts = {r: list(plan["modules"].values()).count(r) for r in dict.fromkeys(plan["modules"].values())}
    print(f"plan: {out} ({args.goal}; " + ", ".join(f"{n} {r}" for r, n in counts.items()) + ")")
    from harness.interop.megatron_precision import NotExpressible, precision_config

    mfile = out.with_suffix(".megatron.yaml")
    try:
        text = yaml.safe_dump(precision_config(modules), sort_keys=False)
        mfile.write_text(f"# {args.goal} plan {out.name} for Megatron-LM --te-precision-config-file\n{text}")
        print(f"megatron: {mfile} (--te-precision-config-file {mfile})")
    except NotExpressible as e:
        mfile.unlink(missing_ok=True)
        print(f"megatron: not written: {e}")
    print(f"run it:   python -m harness.train stability=plan stability.plan_file={out}"
          + (f" recipe={plan['recipe']['name']}" if plan["recipe"] else ""))  # fmt: skip
    print(f"TE:       CustomRecipe(qfactory=harness.interop.te_plan.plan_qfactory('{out}'))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
