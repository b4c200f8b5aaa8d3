"""The TE path's speed and memory options, before and after, with a per-op breakdown, in one call.

    python -m benchmarks native_options                    # the spec: 8B slice rows, then 1.4B memory
    python -m benchmarks.native_options --spec native_options --budget-s 200

Each run (the spec's `runs`: label -> overrides) builds the harness's own Trainer once and times its
`train_step` (CUDA events, median of the timed steps after the warm-up, peak memory of the timed
steps only), then counts what autograd saves for backward over one more step
(harness.lifecycle.memory.SavedTensors) and, with `profile`, traces `profile_steps` more steps with
torch.profiler and sums the kernels per category (benchmarks.kernel_breakdown: GEMMs FP8/BF16, LM
head, attention, norms, casts, activation, loss, optimizer, SelectBackward, ...). The summary's
memory breakdown (harness.lifecycle.memory.breakdown) explains the peak.

Robust by construction: a run that fails records its error and the next one starts; the JSON is
rewritten after every run; runs that would start after `budget_s` seconds are recorded as skipped,
so a call that must end in a few minutes keeps everything it measured.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import specs
from benchmarks.kernel_breakdown import breakdown as kernel_breakdown


@dataclass(frozen=True)
class Options:
    warmup: int = field(default=4, metadata={"help": "steps before timing (excluded, peak reset after)"})
    timed: int = field(default=8, metadata={"help": "timed steps (median)"})
    profile: bool = field(default=True, metadata={"help": "torch.profiler kernel breakdown per run"})
    profile_steps: int = field(default=2, metadata={"help": "steps under the profiler"})
    skip_profile: tuple[str, ...] = field(
        default=("mem_",), metadata={"help": "label prefixes that skip the profile (memory rows)"}
    )
    budget_s: float = field(default=210.0, metadata={"help": "no run starts after this many seconds"})
    top_kernels: int = field(default=10, metadata={"help": "longest kernels kept per run"})
    top_ops: int = field(default=0, metadata={"help": "CPU ops by self CUDA time kept per run (0: none)"})


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    if not spec.runs:
        raise specs.SpecError(f"spec {spec.name}: native_options needs `runs` (label -> overrides)")
    return spec.run_overrides()


def _trainer(cfg):
    from harness.train import Trainer

    return Trainer(cfg, Path(tempfile.mkdtemp(prefix="lowp-native-")))


def _time_steps(trainer, first: int, count: int) -> list[float]:
    events = []
    for step in range(first, first + count):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        trainer.train_step(step)
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def _saved_bytes(trainer, step: int) -> int:
    from harness.lifecycle.memory import SavedTensors

    counter = SavedTensors(exclude=list(trainer.model.parameters()))
    with counter.counting():
        trainer.train_step(step)
    torch.cuda.synchronize()
    return counter.bytes


def _profile(trainer, first: int, steps: int, out: Path, opts: Options) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(first, first + steps):
            trainer.train_step(step)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out))
    result = kernel_breakdown(json.loads(out.read_text()), steps, opts.top_kernels)
    if opts.top_ops:  # which PyTorch ops the GPU time belongs to (the emulated path is plain PyTorch)
        ops = sorted(prof.key_averages(), key=lambda e: -_self_device_us(e))[: opts.top_ops]
        result["top_ops_ms_per_step"] = {
            e.key[:90]: {"ms": _self_device_us(e) / 1e3 / steps, "calls": e.count / steps} for e in ops
        }
    out.unlink()  # hundreds of MB; the breakdown is what is kept
    return result


def _self_device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def measure(label: str, overrides: list[str], opts: Options, work: Path) -> dict:
    from harness.lifecycle.memory import breakdown

    entry: dict = {"overrides": overrides}
    trainer = None
    try:
        cfg = specs.load_config(overrides)
        trainer = _trainer(cfg)
        entry["speed_options"] = trainer.backend.describe().get("speed_options")
        _time_steps(trainer, 0, opts.warmup)
        torch.cuda.reset_peak_memory_stats()
        times = _time_steps(trainer, opts.warmup, opts.timed)
        peak = torch.cuda.max_memory_allocated()
        step = opts.warmup + opts.timed
        saved = _saved_bytes(trainer, step)
        entry["step_ms"] = statistics.median(times)
        entry["step_ms_all"] = times
        entry["tokens_per_s"] = trainer.tokens_per_step / (entry["step_ms"] / 1e3)
        entry["tflops"] = entry["tokens_per_s"] * trainer.flops_per_token / 1e12
        entry["peak_mem_gib"] = peak / 2**30
        entry["memory"] = breakdown(trainer.model, trainer.optimizer, peak_bytes=peak, saved_bytes=saved)
        if opts.profile and not label.startswith(tuple(opts.skip_profile)):
            entry["breakdown"] = _profile(
                trainer, step + 1, opts.profile_steps, work / f"trace_{label}.json", opts
            )
    except Exception:  # noqa: BLE001 - one failing run must not lose the others
        entry["error"] = traceback.format_exc()[-2000:]
        print(f"[native_options] {label} failed:\n{entry['error']}", file=sys.stderr, flush=True)
    finally:
        del trainer
        gc.collect()  # optimizer hooks hold reference cycles: drop this run's model before the next
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return entry


def ratios(runs: dict) -> dict:
    """step-time ratios the issue asks about: each run against the fastest BF16 run of its shape
    (labels start with the shape: `s8b_`, `b14_`, `mem_`)."""
    ok = {k: r for k, r in runs.items() if r.get("step_ms")}
    out = {}
    for shape in {k.split("_", 1)[0] for k in ok}:
        bf16 = [r["step_ms"] for k, r in ok.items() if k.startswith(f"{shape}_bf16")]
        if not bf16:
            continue
        best = min(bf16)
        for k, r in ok.items():
            if k.startswith(f"{shape}_"):
                out[k] = {"vs_best_bf16": best / r["step_ms"], "best_bf16_ms": best}
    return out


def table(runs: dict) -> str:
    head = ("run", "step ms", "peak GiB", "saved GiB", "GEMM", "LM head", "attn", "optim", "select", "loss")
    rows = [head]
    for label, r in runs.items():
        if not r.get("step_ms"):
            rows.append((label, r.get("skipped") and "skipped" or "error") + ("",) * (len(head) - 2))
            continue
        b = (r.get("breakdown") or {}).get("ms_per_step", {})
        cat = lambda *k, b=b: f"{sum(b.get(x, 0.0) for x in k):.1f}" if b else "-"  # noqa: E731
        mem = r.get("memory") or {}
        rows.append(
            (
                label,
                f"{r['step_ms']:.1f}",
                f"{r.get('peak_mem_gib', float('nan')):.1f}",
                f"{mem.get('saved_for_backward_gib', float('nan')):.1f}",
                cat("gemm_fp8", "gemm_bf16"),
                cat("lm_head"),
                cat("attention"),
                cat("optimizer"),
                cat("qkv_select_backward"),
                cat("loss"),
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"_meta": specs.meta(spec, opts), "runs": {}}
    t0 = time.monotonic()
    for label, overrides in plan(spec, opts).items():
        elapsed = time.monotonic() - t0
        if elapsed > opts.budget_s:
            result["runs"][label] = {"overrides": overrides, "skipped": f"time budget ({elapsed:.0f} s)"}
            continue
        print(f"[native_options] {label} (t={elapsed:.0f} s): {' '.join(overrides)}", flush=True)
        result["runs"][label] = measure(label, overrides, opts, work)
        result["ratios"] = ratios(result["runs"])
        specs.write_json(out, result)
    result["wall_s"] = time.monotonic() - t0
    specs.write_json(out, result)
    print(table(result["runs"]))
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
