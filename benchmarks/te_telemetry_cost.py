"""Benchmark: what numerics telemetry costs on the TE backend, at the 1.4B shape on one GPU.

    python -m benchmarks.te_telemetry_cost [--recipes tensorwise,delayed,blockwise] [--out DIR]
        [--warmup 3] [--steps 6] [--interval 3] [--budget-s 200] [override ...]

Per recipe, one Trainer (`experiment=h200_1b` plus the overrides) times `train_step` three ways, each
step between CUDA syncs: telemetry off (`telemetry_interval=0`), then on (`--interval`), split into
telemetry steps (hooks installed, rows computed and synced) and the steps between them (which must
cost what "off" costs: the hooks exist only inside telemetry steps). Medians go to
`te_telemetry_cost.json` under `--out`, rewritten after every recipe, so a failing or unfinished
recipe (`--budget-s` bounds the whole run) loses only itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.telemetry_timing import telemetry_phases

BASE = ("experiment=h200_1b", "logger=none", "telemetry_interval=0", "steps=1000")


def measure(recipe: str, overrides: list[str], warmup: int, steps: int, interval: int, run_dir: Path) -> dict:
    import torch

    from benchmarks import specs
    from harness.train import Trainer

    cfg = specs.load_config([*BASE, f"recipe={recipe}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    tr = Trainer(cfg, run_dir)
    phases = telemetry_phases(tr, warmup, steps, interval, max(2, steps // 2))  # >= 2 telemetry steps
    off, tele, between = ([ms for _, ms, _ in phases[k]] for k in ("off", "telemetry", "between"))
    med = statistics.median
    res = {
        "recipe": recipe,
        "step_ms_off": med(off),
        "step_ms_telemetry_step": med(tele),
        "step_ms_between_telemetry_steps": med(between),
        "telemetry_step_overhead": med(tele) / med(off) - 1,
        "between_steps_overhead": med(between) / med(off) - 1,
        "rows_per_telemetry_step": phases["rows"],
        "samples": {"off": off, "telemetry": tele, "between": between},
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "backend": tr.backend.name,
    }
    del tr
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.te_telemetry_cost", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--recipes", default="tensorwise,delayed,blockwise")
    p.add_argument("--out", default=None, help="folder for te_telemetry_cost.json (default: a temporary one)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="timed steps with telemetry off")
    p.add_argument("--interval", type=int, default=3, help="telemetry_interval of the 'on' phase")
    p.add_argument("--budget-s", type=float, default=200.0, help="no new recipe starts after this")
    p.add_argument("overrides", nargs="*", help="config overrides after experiment=h200_1b")
    args = p.parse_args(argv)
    if args.interval < 2:
        raise SystemExit("--interval must be >= 2 (steps between telemetry steps are measured too)")
    out = Path(args.out or tempfile.mkdtemp(prefix="lowp_telemetry_"))
    out.mkdir(parents=True, exist_ok=True)
    import torch

    result = {
        "_meta": {
            "overrides": [*BASE, *args.overrides],
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "interval": args.interval,
        },
        "runs": {},
    }
    t0 = time.perf_counter()
    for recipe in [r for r in args.recipes.split(",") if r]:
        if time.perf_counter() - t0 > args.budget_s:
            result["runs"][recipe] = {"skipped": f"--budget-s {args.budget_s} spent"}
        else:
            try:
                r = measure(recipe, args.overrides, args.warmup, args.steps, args.interval, out / recipe)
                result["runs"][recipe] = r
                print(
                    f"{recipe}: off {r['step_ms_off']:.1f} ms, telemetry step "
                    f"{r['step_ms_telemetry_step']:.1f} ms ({r['telemetry_step_overhead']:+.1%}), between "
                    f"{r['step_ms_between_telemetry_steps']:.1f} ms ({r['between_steps_overhead']:+.1%}), "
                    f"{r['rows_per_telemetry_step']} rows",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001 - one recipe's failure must not lose the others
                result["runs"][recipe] = {
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc(),
                }
                print(f"{recipe}: FAILED {type(e).__name__}: {e}", flush=True)
        (out / "te_telemetry_cost.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'te_telemetry_cost.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
