"""What counterfactual telemetry costs: step time with telemetry off, on its telemetry steps and between.

    python -m benchmarks.counterfactual_cost --spec counterfactual_cost_cpu          # gpt_small, CPU
    python -m benchmarks counterfactual_cost_8bslice --out $OUT                       # 8B slice, TE

One Trainer per arm (`runs:` of the spec: the run's own telemetry, and the same with
`telemetry.candidates`) times `train_step` with telemetry off (`telemetry_interval=0`), then with
`--interval`, split into telemetry steps (hooks installed, every block GEMM's operands quantized
under each candidate, rows synced) and the steps between them, which must cost what "off" costs:
the hooks exist only inside telemetry steps. Medians per arm are written after each arm, so a
timeout keeps what was measured.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import specs
from benchmarks.telemetry_timing import telemetry_phases


@dataclass(frozen=True)
class Options:
    warmup: int = field(default=2, metadata={"help": "steps left out"})
    steps: int = field(default=4, metadata={"help": "timed steps with telemetry off"})
    interval: int = field(default=2, metadata={"help": "telemetry_interval of the 'on' phase (>= 2)"})
    telemetry_steps: int = field(default=2, metadata={"help": "telemetry steps timed in the 'on' phase"})
    budget_s: float = field(default=240.0, metadata={"help": "no new arm starts after this"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    return {label: [*spec.overrides, "logger=none", *ov] for label, ov in spec.runs.items()}


def measure(overrides: list[str], opts: Options, run_dir: Path) -> dict:
    from harness.train import Trainer

    cfg = specs.load_config([*overrides, "telemetry_interval=0"])
    run_dir.mkdir(parents=True, exist_ok=True)
    tr = Trainer(cfg, run_dir)
    phases = telemetry_phases(tr, opts.warmup, opts.steps, opts.interval, opts.telemetry_steps)
    off, tele, between = phases["off"], phases["telemetry"], phases["between"]
    med = lambda ts, i=1: statistics.median(t[i] for t in ts)  # noqa: E731
    res = {
        "backend": tr.backend.name,
        "recipe": cfg.recipe.name,
        "candidates": [str(c) for c in cfg.telemetry.candidates],
        "step_ms_off": med(off),
        "step_ms_telemetry_step": med(tele),
        "step_ms_between_telemetry_steps": med(between),
        "telemetry_step_ratio": med(tele) / med(off),
        "between_steps_ratio": med(between) / med(off),
        "cpu_ms_off": med(off, 2),
        "cpu_ms_telemetry_step": med(tele, 2),
        "cpu_ms_between_telemetry_steps": med(between, 2),
        "rows_per_telemetry_step": phases["rows"],
        "samples": {"off": off, "telemetry": tele, "between": between},
    }
    del tr
    gc.collect()
    return res


def _line(label: str, r: dict) -> str:
    return (
        f"{label}: off {r['step_ms_off']:.0f} ms, telemetry step {r['step_ms_telemetry_step']:.0f} ms "
        f"({r['telemetry_step_ratio']:.2f}x), between {r['step_ms_between_telemetry_steps']:.0f} ms "
        f"({r['between_steps_ratio']:.2f}x); CPU ms off / telemetry / between {r['cpu_ms_off']:.0f} / "
        f"{r['cpu_ms_telemetry_step']:.0f} / {r['cpu_ms_between_telemetry_steps']:.0f}; "
        f"{r['rows_per_telemetry_step']} rows"
    )


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    result = {"_meta": {**specs.meta(spec, opts), "threads": torch.get_num_threads()}, "runs": {}}
    t0 = time.perf_counter()
    for label, overrides in plan(spec, opts).items():
        if time.perf_counter() - t0 > opts.budget_s:
            result["runs"][label] = {"skipped": f"budget_s {opts.budget_s} spent"}
        else:
            try:
                r = result["runs"][label] = measure(overrides, opts, Path(work) / label)
                print(_line(label, r), flush=True)
            except Exception as e:  # noqa: BLE001 - one arm's failure must not lose the others
                result["runs"][label] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
                print(f"{label}: FAILED {type(e).__name__}: {e}", flush=True)
        specs.write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
