"""Benchmark recipes through the harness itself, beside a bare loop (and the anchor script) in one process.

    python -m harness.bench experiment=h200_1b [--recipes bf16,delayed,tensorwise,blockwise]
        [--runs "label:override override;label2:..."] [--anchor PATH/anchor_gpt.py] [--out DIR]

For each run it measures (1) the harness (`harness.train.run`, median of steady-state steps),
(2) a bare loop of the same model, optimizer and batch in the same process (no metrics, no logging)
-> the harness's overhead, and optionally (3) `anchor_gpt.py`'s matching row, so that GPUs of the same
model that differ by a few percent are compared in one machine state. Prints a table and writes
OUT/bench.json after every run (a timeout keeps what was measured).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from omegaconf import OmegaConf

ANCHOR_SHAPES = {"gpt_1b": "1b", "gpt_8b_slice": "8bslice"}


def bare_loop(cfg, steps: int = 10, warm: int = 4) -> float:
    """Median ms of the harness's own train step (same model, optimizer, data, clipping, schedule)
    timed by bare CUDA events: no metrics processor, no logging, no checks -> the harness's overhead."""
    from harness.hardware import resolve_hardware
    from harness.train import Trainer

    cfg.hardware = resolve_hardware(cfg.hardware)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="lowp-bare-")))
    times = []
    for step in range(warm + steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        trainer.train_step(step)
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in times[warm:]]
    del trainer
    return statistics.median(ms)


def profile_steps(cfg, out: Path, steps: int = 3, warm: int = 4) -> None:
    """torch.profiler over a few steady-state train steps: the kernel table lands in the file `out`."""
    from torch.profiler import ProfilerActivity, profile

    from harness.hardware import resolve_hardware
    from harness.train import Trainer

    cfg.hardware = resolve_hardware(cfg.hardware)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="lowp-prof-")))
    for step in range(warm):
        trainer.train_step(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(warm, warm + steps):
            trainer.train_step(step)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    out.write_text(f"{steps} steps\n{table}\n")
    del trainer


def anchor_row(anchor, model_name: str, recipe: str, out: Path) -> dict | None:
    shape_key = ANCHOR_SHAPES.get(model_name)
    if anchor is None or shape_key is None or recipe not in ("bf16", "delayed", "tensorwise", "blockwise"):
        return None
    shapes = {"1b": (50304, 2048, 24, 16, 8192, 2048, 8), "8bslice": (50304, 4096, 6, 32, 16384, 4096, 2)}
    tag = f"{shape_key}/te/{recipe}"
    anchor.OUT = str(out)
    anchor.run_model(tag, "te", recipe, shapes[shape_key])
    return anchor.RES.get(tag)


def harness_row(overrides: list[str], out: Path) -> dict:
    from harness.config.store import compose
    from harness.train import run

    cfg = OmegaConf.to_object(compose(overrides))
    s = run(cfg, out)
    return {
        "summary": {k: v for k, v in vars(s).items()},
        "tflops": (s.tokens_per_s or 0)
        * json.loads((out / "run.json").read_text())["provenance"]["flops_per_token"]
        / 1e12,
    }


def cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(label: str, overrides: list[str], args, anchor, results: dict) -> None:
    from harness.config.store import compose

    entry: dict = {"overrides": overrides}
    results[label] = entry
    try:
        cfg = OmegaConf.to_object(compose(overrides))
        if args.anchor_first:
            entry["anchor"] = anchor_row(anchor, cfg.model.name, cfg.recipe.name, args.out)
            cleanup()
        entry.update(harness_row(overrides, args.out / "runs" / label))
        cleanup()
        if args.bare:
            entry["bare_ms"] = bare_loop(OmegaConf.to_object(compose(overrides)))
            cleanup()
        if args.profile:
            profile_steps(OmegaConf.to_object(compose(overrides)), args.out / f"profile_{label}.txt")
            cleanup()
        if not args.anchor_first:
            entry["anchor"] = anchor_row(anchor, cfg.model.name, cfg.recipe.name, args.out)
            cleanup()
    except Exception:  # noqa: BLE001 - one failing run must not lose the others
        entry["error"] = traceback.format_exc()[-1500:]
        print(f"[bench] {label} failed:\n{entry['error']}", file=sys.stderr, flush=True)
        cleanup()
    (args.out / "bench.json").write_text(json.dumps(results, indent=1, default=str))


def table(results: dict) -> str:
    base = next(
        (r for r in results.values() if r.get("summary", {}).get("recipe") == "bf16" and "error" not in r),
        None,
    )
    base_ms = base["summary"]["step_time_ms"] if base else None
    head = (
        "run",
        "step ms",
        "tok/s",
        "TFLOP/s",
        "MFU bf16",
        "MFU recipe",
        "peak GiB",
        "vs BF16",
        "anchor ms",
        "vs anchor",
        "bare ms",
        "overhead",
    )
    rows = [head]
    for label, r in results.items():
        s = r.get("summary")
        if not s or s.get("step_time_ms") is None:
            rows.append((label, "error") + ("",) * (len(head) - 2))
            continue
        ms, a, bare = s["step_time_ms"], (r.get("anchor") or {}).get("step_ms"), r.get("bare_ms")
        f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        rows.append(
            (
                label,
                f(ms, ".1f"),
                f(s["tokens_per_s"], ",.0f"),
                f(r.get("tflops"), ".0f"),
                f(s["mfu_bf16_peak"], ".3f"),
                f(s["mfu_recipe_peak"], ".3f"),
                f(s["peak_mem_gib"], ".1f"),
                f(base_ms / ms if base_ms else None, ".2f") + "x",
                f(a, ".1f"),
                f(a / ms if a else None, ".3f") + "x",
                f(bare, ".1f"),
                f((ms / bare - 1) * 100 if bare else None, "+.1f") + "%",
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)


def parse(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="bf16,delayed,tensorwise,blockwise")
    p.add_argument("--runs", default=None, help="'label:ov ov;label2:ov' (replaces --recipes)")
    p.add_argument("--anchor", default=None, help="path of anchor_gpt.py to run beside the harness")
    p.add_argument("--anchor-first", action="store_true", help="run the anchor row before the harness row")
    p.add_argument("--no-bare", dest="bare", action="store_false")
    p.add_argument("--profile", action="store_true", help="also write OUT/profile_LABEL.txt (torch.profiler)")
    p.add_argument("--out", type=Path, default=None)
    args, overrides = p.parse_known_args(argv)
    args.out = args.out or Path(tempfile.mkdtemp(prefix="lowp-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.runs:
        runs = {}
        for item in args.runs.split(";"):
            label, _, ovs = item.partition(":")
            runs[label.strip()] = overrides + ovs.split()
    else:
        runs = {r: overrides + [f"recipe={r}"] for r in args.recipes.split(",")}
    return args, runs


def main(argv: list[str] | None = None) -> None:
    from harness.config.store import register

    register()
    args, runs = parse(list(sys.argv[1:] if argv is None else argv))
    anchor = None
    if args.anchor:
        spec = importlib.util.spec_from_file_location("anchor_gpt", args.anchor)
        anchor = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(anchor)
    results: dict = {
        "_meta": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    }
    for label, overrides in runs.items():
        print(f"[bench] {label}: {' '.join(overrides)}", flush=True)
        measure(label, overrides, args, anchor, results)
    print(table({k: v for k, v in results.items() if not k.startswith("_")}))
    print(f"[bench] figures in {args.out / 'bench.json'}")


if __name__ == "__main__":
    main()
