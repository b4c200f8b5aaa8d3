"""TE vs the emulator from the same weights: step-0 operands bit for bit, gradients, loss curves
against the spread of BF16 seeds (gpt_small, markov data, hardware=auto; needs a GPU with TE).

    python -m benchmarks.fidelity.te_vs_emulated --spec te_vs_emulated [--parts grads,curves] [override ...]

The emulated GPT's weights, rounded to bf16 (so both backends hold them exactly), are copied into the
TE model (harness/backends/te_weights.py). Parts, each guarded so one failure does not stop the others,
the result file rewritten after each:
- mapping: BF16 logits of both models on one batch, with a scrambled-QKV control (operands.py);
- operands: block 0's QKV GEMM operands, TE's training forward vs TE's and lowp's quantizers vs
  lowp's own model (operands.py);
- grads: step-0 gradients, emulated vs TE vs TE BF16 (grads.py);
- curves: TE BF16 seeds 0..N-1; per recipe, emulated and TE from the same weights and batches; per
  logged step |emulated - te| against |seed0 - seed1| and the mean |seed_i - seed_j|
  (analysis/fidelity.py); without BF16 seeds, the pair's own signed gaps;
- sensitivity: TE against itself with 0.1% of the weights one bf16 ulp off, judged by the same band.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from analysis.fidelity import criterion, criterion_free
from benchmarks import specs
from benchmarks.fidelity.common import BASE, Setup, curve, emulated_start, free_memory, guard
from benchmarks.fidelity.grads import compare_grads, sensitivity
from benchmarks.fidelity.operands import check_mapping, compare_operands
from benchmarks.fidelity.quantizers import cast_saturation

PARTS = ("mapping", "operands", "grads", "curves", "sensitivity")
KEYS = ("train", "eval")


@dataclass(frozen=True)
class Options:
    steps: int = field(default=300, metadata={"help": "training steps of every curve"})
    recipes: tuple[str, ...] = field(default=("tensorwise", "delayed", "blockwise"), metadata={"help": "FP8"})
    parts: tuple[str, ...] = field(
        default=("mapping", "operands", "curves"), metadata={"help": f"of {PARTS}"}
    )
    bf16_seeds: int = field(default=4, metadata={"help": "TE BF16 seeds for the band (>= 2; 0: none)"})
    pair_seeds: tuple[str, ...] = field(default=(), metadata={"help": "seeds of the pairs' weights and data"})
    bf16_pair: bool = field(default=True, metadata={"help": "the emulated-vs-TE BF16 control pair"})


def pairs(opts: Options) -> list[str]:
    return (["bf16"] if opts.bf16_pair else []) + list(opts.recipes)  # bf16: the backends' own gap


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    bad = sorted(set(opts.parts) - set(PARTS))
    if bad:
        raise specs.SpecError(f"spec {spec.name}: unknown part(s) {bad}; choose from {PARTS}")
    base = [*BASE, *spec.overrides]
    out = {f"bf16_te_s{s}": [*base, "recipe=bf16", "backend=te", f"seed={s}"] for s in range(opts.bf16_seeds)}
    for seed in [f"seed={int(s)}" for s in opts.pair_seeds] or [None]:
        for r, b in ((r, b) for r in pairs(opts) for b in ("emulated", "te")):
            label, seeded = (f"{r}_{b}_{seed}", [seed]) if seed else (f"{r}_{b}", [])
            out[label] = [*base, f"recipe={r}", f"backend={b}", *seeded]
    return out


class Recorder:
    """The result dict, rewritten to `path` after every part with the part's wall time."""

    def __init__(self, path: Path, res: dict) -> None:
        self.path, self.res = path, res

    def part(self, key: str, fn, *a) -> dict:
        t0 = time.perf_counter()
        self.res[key] = guard(fn, *a)
        free_memory()
        self.res["seconds"][key] = round(time.perf_counter() - t0, 1)
        specs.write_json(self.path, self.res)
        print(f"[{key}] {self.res['seconds'][key]} s", flush=True)
        return self.res[key]


def judge(a: dict, b: dict, seeds: list[dict]) -> dict:
    """The BF16-band criterion with >= 2 seeds, else the pair's own signed gaps."""
    if "error" in a or "error" in b:
        raise ValueError("a curve of this pair failed; see its entry")
    if len(seeds) >= 2:
        return {k: criterion(a, b, seeds, k) for k in KEYS}
    return {k: criterion_free(a, b, k) for k in KEYS}


def run_curves(setup: Setup, opts: Options, rec: Recorder) -> list[dict]:
    """TE BF16 seeds, then per recipe (and pair seed) the emulated/TE pair from the same weights."""
    for seed in range(opts.bf16_seeds):
        rec.part(
            f"curves/bf16_te_s{seed}", curve, setup, ["recipe=bf16", "backend=te", f"seed={seed}"], opts.steps
        )
    seeds = [rec.res[f"curves/bf16_te_s{i}"] for i in range(opts.bf16_seeds)]
    for ps in [int(s) for s in opts.pair_seeds] or [None]:
        seeded = () if ps is None else (f"seed={ps}",)
        for r in pairs(opts):
            key = r if ps is None else f"{r}_seed{ps}"

            def pair(r=r, seeded=seeded) -> dict:  # the same weights and, from one seed, the same batches
                sd = emulated_start(setup, r, extra=seeded)[1]
                ov = lambda b: [f"recipe={r}", f"backend={b}", *seeded]  # noqa: E731
                return {b: guard(curve, setup, ov(b), opts.steps, sd) for b in ("emulated", "te")}

            pr = rec.part(f"curves/{key}", pair)
            if "error" not in pr:
                rec.part(f"criterion/{key}", judge, pr["emulated"], pr["te"], seeds)
    return seeds


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    plan(spec, opts)  # the parts' names
    setup = Setup(overrides=(*BASE, *spec.overrides), run_dir=work / "runs")
    res: dict = {
        "_meta": specs.meta(spec, opts),
        "steps": opts.steps,
        "recipes": list(opts.recipes),
        "seconds": {},
    }
    rec = Recorder(out, res)
    te_version = lambda: __import__("transformer_engine").__version__  # noqa: E731
    env = {"gpu": torch.cuda.get_device_name, "te": te_version, "fp8_cast_saturates": cast_saturation}
    rec.part("env", lambda: {k: guard(f) for k, f in env.items()})
    if "mapping" in opts.parts:
        rec.part("mapping", check_mapping, setup)
    for r in opts.recipes if "operands" in opts.parts else ():
        rec.part(f"operands/{r}", compare_operands, setup, r)
    for r in pairs(opts) if "grads" in opts.parts else ():
        rec.part(f"grads/{r}", compare_grads, setup, r)
    seeds = run_curves(setup, opts, rec) if "curves" in opts.parts else []
    for r in pairs(opts) if "sensitivity" in opts.parts else ():  # after the curves: the same BF16 band
        sv = rec.part(f"sensitivity/{r}", sensitivity, setup, r, opts.steps)
        if "error" not in sv:
            rec.part(f"criterion/{r}_te_vs_te_bumped", judge, sv["te"], sv["te_bumped"], seeds)
    guard(print_summary, res, list(opts.recipes))
    print(f"written: {out}")
    return res


def _grads_line(key: str, g: dict) -> str:
    if "error" in g:
        return f"{key}: {g['error']}"
    loss = "/".join(f"{g['loss'][k]:.5f}" for k in ("emulated", "te", "te_bf16"))
    worst = "".join(
        f"\n    {w[0]:<58} rel(emu,te)={w[1]:.3g} rel(te,bf16)={w[2]:.3g} rel(emu,bf16)={w[3]:.3g}"
        for w in g["worst"][:4]
    )
    return (
        f"{key:<18} loss emu/te/bf16 {loss}  median rel(emu,te)={g['median_rel_emu_te']:.3g}  "
        f"rel(te,bf16)={g['median_rel_te_bf16']:.3g}  rel(emu,bf16)={g['median_rel_emu_bf16']:.3g}  "
        f"|emu|/|te|={g['median_norm_ratio_emu_te']:.4f}  params rel(emu,te)>rel(te,bf16)/2: "
        f"{g['params_with_rel_emu_te_over_half_rel_te_bf16']}/{g['params']}{worst}"
    )


def _criterion_line(r: str, k: str, x: dict) -> str:
    if "holds" not in x:
        gap, sign = f"{x['max_pair_diff']:.4g}", f"{x['mean_signed']:+.4g}"
        return f"criterion {r:<16} {k:<5} max|emu-te|={gap}  mean(emu-te)={sign}"
    return (
        f"criterion {r:<16} {k:<5} holds={x['holds']}  max|emu-te|={x['max_pair_diff']:.4g}  "
        f"min|s0-s1|={x['min_seed_diff']:.4g}  violating steps={x['violating_steps']}  "
        f"vs mean of {x['bf16_seeds']} seeds' pairs: holds={x['holds_vs_mean_pairwise']} "
        f"violating={x['violating_steps_vs_mean_pairwise']}"
    )


def print_summary(res: dict, recipes: list[str]) -> None:
    """The figures of every part that ran, one line each (the JSON holds the rows behind them)."""
    print("\n==== te_vs_emulated summary ====")
    for key, v in res.get("mapping", {}).items():
        print(f"mapping {key:<24} {json.dumps(v)}")
    for r in (r for r in recipes if f"operands/{r}" in res):
        o = res[f"operands/{r}"]
        rows = [("", "ERROR", o["error"])] if "error" in o else [("", "ln", o.get("ln"))]
        rows += [(role, k, v) for role in ("input", "weight") for k, v in o.get(role, {}).items()]
        for role, k, v in rows:
            print(f"operands {r:<10} {role:<6} {k:<48} {json.dumps(v)}")
    for key in (k for k in res if k.startswith("grads/")):
        print(_grads_line(key, res[key]))
    for key in (k for k in res if k.startswith("sensitivity/")):
        v, keep = res[key], ("max_abs_diff", "median_rel_grad_bumped_vs_te")
        print(f"{key:<24} {json.dumps({k: v[k] for k in keep} if 'error' not in v else v['error'])}")
    for key in (k for k in res if k.startswith("criterion/")):
        c, r = res[key], key.split("/", 1)[1]
        lines = (
            [f"criterion {r}: {c['error']}"] if "error" in c else [_criterion_line(r, k, c[k]) for k in KEYS]
        )
        print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
