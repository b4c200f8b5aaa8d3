"""Benchmark: load a synthetic sweep of many long runs into DataFrames, compare it, print the timings.

    python -m benchmarks.analysis_load [--runs 200] [--steps 10000] [--dir DIR] [--workers N] [--json OUT]

Writes `--runs` run directories (Hydra multirun layout, the artifact contract of architecture.md) with
`--steps` logged training rows each, plus eval rows every 100 steps and a numerics.jsonl (read only
when `Runs.numerics` is asked for), into a temporary directory (or `--dir`), then times
`analysis.load` (run directories -> `runs`/`curves` DataFrames) and `analysis.compare` (groups,
pairing, seed intervals -> the comparison DataFrame) separately. The target: well under 30 s for
200 x 10,000 on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import analysis

RECIPES = (("bf16", "te", 100.0), ("tensorwise", "te", 80.0), ("blockwise", "te", 87.0),
           ("mxfp8", "emulated", 300.0), ("nvfp4", "emulated", 400.0))  # fmt: skip


def write_synthetic_run(d: Path, recipe: str, backend: str, seed: int, steps: int, step_ms: float) -> None:
    d.mkdir(parents=True)
    gbs, seq = 64, 1024
    config = {
        "recipe": {"name": recipe}, "stability": {"name": "none"}, "optimizer": {"name": "adamw_fp32"},
        "hardware": {"name": "h200"}, "model": {"name": "gpt_125m", "seq_length": seq},
        "data": {"name": "markov"}, "backend": {"name": backend}, "seed": seed, "steps": steps,
        "global_batch_size": gbs, "micro_batch_size": 8, "log_interval": 1, "eval_interval": 100,
    }  # fmt: skip
    prov = {"backend": backend, "hardware": "h200", "seed": seed}
    (d / "run.json").write_text(json.dumps({"config": config, "provenance": prov, "wandb": None}))
    rng = np.random.default_rng(seed)
    step = np.arange(1, steps + 1)
    offset = {"bf16": 0.0, "tensorwise": 0.003, "blockwise": 0.002, "mxfp8": 0.004, "nvfp4": 0.03}[recipe]
    loss = 2.5 + 4.0 * (1 + step / 100) ** -0.6 + offset + rng.normal(0, 0.02, steps)
    tps = gbs * seq / (step_ms / 1000)
    with open(d / "metrics.jsonl", "w") as f:
        for s, v in zip(step.tolist(), loss.tolist(), strict=True):
            f.write(
                f'{{"step": {s}, "tokens": {s * gbs * seq}, "loss/train": {v}, "optim/lr": 0.0003, '
                f'"optim/grad_norm": 1.0, "time/step_ms": {step_ms}, "throughput/tokens_per_s": {tps}, '
                f'"throughput/tflops": 400.0, "throughput/mfu": 0.4, "memory/peak_allocated_gib": 40.0}}\n'
            )
            if s % 100 == 0:
                f.write(f'{{"step": {s}, "tokens": {s * gbs * seq}, "loss/eval": {v + 0.05}}}\n')
    with open(d / "numerics.jsonl", "w") as f:
        for s in range(0, steps, 1000):
            f.write(
                json.dumps({"step": s, "layer": "blocks.0.mlp.fc1", "tensor": "input", "underflow": 0.0})
                + "\n"
            )
    summary = {
        "status": "completed", "recipe": recipe, "variant": "none+adamw_fp32", "backend": backend,
        "hardware": "h200", "model": "gpt_125m", "data": "markov", "seed": seed, "steps": steps,
        "tokens": steps * gbs * seq, "final_train_loss": float(loss[-1]),
        "final_eval_loss": float(loss[-1]) + 0.05, "tokens_per_s": tps, "step_time_ms": step_ms,
        "peak_mem_gib": 40.0, "wall_time_s": steps * step_ms / 1000,
    }  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))


def write_sweep(root: Path, runs: int, steps: int) -> Path:
    sweep = root / "bench_sweep"
    (sweep).mkdir(parents=True, exist_ok=True)
    (sweep / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    for i in range(runs):
        recipe, backend, ms = RECIPES[i % len(RECIPES)]
        write_synthetic_run(
            sweep / f"{i}_{recipe}_s{i // len(RECIPES)}", recipe, backend, i // len(RECIPES), steps, ms
        )
    return sweep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.analysis_load", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--dir", help="write the sweep here and keep it (default: a temporary directory)")
    p.add_argument("--workers", type=int, default=None, help="loader processes (default: all cores)")
    p.add_argument("--json", help="also write the timings to this JSON file")
    args = p.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="lowp_bench_"))
    try:
        t0 = time.perf_counter()
        sweep = write_sweep(root, args.runs, args.steps)
        t1 = time.perf_counter()
        runs = analysis.load(sweep, workers=args.workers)
        t2 = time.perf_counter()
        table = analysis.compare(runs)
        t3 = time.perf_counter()
        size = sum(f.stat().st_size for f in sweep.rglob("metrics.jsonl")) / 2**20
        print(f"sweep: {args.runs} runs x {args.steps} logged steps ({size:.0f} MiB metrics.jsonl), "
              f"written in {t1 - t0:.1f} s")  # fmt: skip
        print(f"cores: {os.cpu_count()}, loader workers: {args.workers or os.cpu_count()}")
        print(f"load: {t2 - t1:.2f} s   compare: {t3 - t2:.2f} s   total: {t3 - t1:.2f} s (target < 30 s)")
        print(
            f"runs: {len(runs.runs)} rows, curves: {len(runs.curves):,} rows, comparison: {len(table)} arms"
        )
        if args.json:
            Path(args.json).write_text(json.dumps({
                "runs": args.runs, "steps": args.steps, "cores": os.cpu_count(), "workers": args.workers,
                "metrics_mib": size, "load_s": t2 - t1, "compare_s": t3 - t2, "total_s": t3 - t1,
                "curve_rows": len(runs.curves), "arms": len(table), "loadavg": os.getloadavg()[0],
            }, indent=1))  # fmt: skip
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
