"""The MoE slices trained on one GPU: each (slice, recipe) as `python -m harness.train
experiment=h200_<slice> ...`, one process after another, and what each run's summary.json says
(status, final loss, throughput, memory) in one JSON file, rewritten after every run.

    python -m benchmarks.moe_slices --out DIR [--slices qwen3_30b_a3b_slice,mixtral_8x7b_slice]
        [--recipes bf16,delayed,tensorwise,blockwise] [--backend te] [--steps 50] [--warmup 5]
        [--over backend.moe_experts=grouped --tag grouped]

Throughput is the runs' timed steps (after `bench_warmup_steps`); the memory peak is the device
allocator's maximum (summary.json `memory`). Needs a GPU that holds the slices (experiment=h200_*).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

KEEP = ("status", "steps", "final_train_loss", "tokens_per_s", "step_time_ms", "mfu_bf16_peak", "error")
MEMORY = ("params_gib", "grads_gib", "optimizer_states_gib", "static_total_gib", "peak_measured_gib")


def one(slice_: str, recipe: str, backend: str, steps: int, warmup: int, run_dir: Path, over=()) -> dict:
    cmd = [sys.executable, "-m", "harness.train", f"experiment=h200_{slice_}", f"backend={backend}"]
    cmd += [f"recipe={recipe}", f"steps={steps}", f"bench_warmup_steps={warmup}", "log_interval=10", *over]
    cmd += [f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = {"command": " ".join(cmd[1:]), "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        out |= {k: s.get(k) for k in KEEP}
        out["memory"] = {k: (s.get("memory") or {}).get(k) for k in MEMORY}
    if proc.returncode:
        out["stderr_tail"] = proc.stderr[-1500:]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_slices", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--slices", default="qwen3_30b_a3b_slice,mixtral_8x7b_slice")
    p.add_argument("--recipes", default="bf16,delayed,tensorwise,blockwise")
    p.add_argument("--backend", default="te")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--over", nargs="*", default=[], help="more overrides of every run")
    p.add_argument("--tag", default="", help="appended to the result file's name and each run's key")
    a = p.parse_args(argv)
    import torch

    meta = {"what": f"harness.train experiment=h200_<slice> backend={a.backend} steps={a.steps} "
            f"bench_warmup_steps={a.warmup}", "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__}  # fmt: skip
    try:
        import transformer_engine

        meta["te"] = transformer_engine.__version__
    except ImportError:
        meta["te"] = None
    a.out.mkdir(parents=True, exist_ok=True)
    meta["over"] = a.over
    tag = f"_{a.tag}" if a.tag else ""
    path, results = a.out / f"moe_slices_{a.backend}{tag}.json", {"_meta": meta}
    for slice_ in a.slices.split(","):
        for recipe in a.recipes.split(","):
            key = f"{slice_}-{recipe}{tag}"
            print(f"[moe_slices] {key} ...", flush=True)
            results[key] = one(slice_, recipe, a.backend, a.steps, a.warmup, a.out / "runs" / key, a.over)
            path.write_text(json.dumps(results, indent=1))
            r = results[key]
            peak = (r.get("memory") or {}).get("peak_measured_gib")
            print(
                f"[moe_slices] {key}: rc {r['rc']} {r.get('status')} loss {r.get('final_train_loss')} "
                f"tok/s {r.get('tokens_per_s')} peak {peak} GiB wall {r['wall_s']} s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
