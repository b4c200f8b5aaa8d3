"""Data-parallel scaling on one host: each run on 1 GPU, then under torchrun on 2 (or more) GPUs.

    python -m benchmarks.multigpu --spec multigpu [--worlds 1,2] [--timeout-s 240]

Per run and world size: step time, tokens/s of the job and per GPU, peak memory (the fullest
rank), the run's status; then the scaling efficiency (tokens/s per GPU at N over tokens/s at 1).
Weak scaling by default: the per-GPU batch stays the spec's, so the global batch grows with N.
Each run has its own wall-clock limit and is written to the result file as soon as it ends, so a
failing or hanging run costs only itself. World sizes above the visible GPU count are recorded as
skipped (a 1-GPU machine gives the 1-GPU baseline only).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import specs

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Options:
    worlds: tuple[int, ...] = field(default=(1, 2), metadata={"help": "world sizes, comma-separated"})
    weak_scaling: bool = field(default=True, metadata={"help": "global batch x N (per-GPU batch fixed)"})
    timeout_s: int = field(default=240, metadata={"help": "wall-clock limit of one run"})


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    return spec.run_overrides()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _one(overrides: list[str], world: int, run_dir: Path, timeout_s: int) -> dict:
    if world == 1:
        launcher = [sys.executable, "-m", "harness.train"]
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(world),
            "--master_port",
            str(_free_port()),
            "-m",
            "harness.train",
        ]
    cmd = [*launcher, *overrides, "logger=none", f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"")
        code, tail = "timeout", (out.decode(errors="replace") if isinstance(out, bytes) else out)[-1500:]
    row: dict = {"world": world, "exit_code": code, "wall_s": round(time.perf_counter() - t0, 1)}
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {**row, "status": "no summary", "log_tail": tail}
    row.update(
        status=s.get("status"),
        error=s.get("error"),
        failed_rank=s.get("failed_rank"),
        step_time_ms=s.get("step_time_ms"),
        tokens_per_s=s.get("tokens_per_s"),
        tokens_per_s_per_gpu=s.get("tokens_per_s_per_gpu") or s.get("tokens_per_s"),
        peak_mem_gib=s.get("peak_mem_gib"),
        final_train_loss=s.get("final_train_loss"),
        memory=s.get("memory"),
    )
    if s.get("status") != "completed":
        row["log_tail"] = tail
    return row


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    gpus = _gpus()
    result = {"_meta": specs.meta(spec, opts), "gpus_visible": gpus, "runs": {}}
    for label, overrides in plan(spec, opts).items():
        cfg = specs.load_config(overrides)
        entry: dict = {"overrides": overrides, "worlds": {}}
        result["runs"][label] = entry
        for world in opts.worlds:
            if world > max(gpus, 1) or (world > 1 and gpus < world):
                entry["worlds"][str(world)] = {
                    "world": world,
                    "status": "skipped",
                    "why": f"{gpus} GPU(s) visible",
                }
                continue
            extra = []
            if opts.weak_scaling and world > 1:
                extra = [f"global_batch_size={cfg.global_batch_size * world}"]
            print(f"[multigpu] {label} on {world} GPU(s)", flush=True)
            entry["worlds"][str(world)] = _one(
                [*overrides, *extra], world, work / f"{label}_w{world}", opts.timeout_s
            )
            specs.write_json(out, result)  # after every run: a later failure loses nothing
        base = entry["worlds"].get("1", {}).get("tokens_per_s_per_gpu")
        for w, row in entry["worlds"].items():
            per = row.get("tokens_per_s_per_gpu")
            if base and per and w != "1":
                row["scaling_efficiency"] = per / base
        specs.write_json(out, result)
    _fp8_param_effect(result)
    specs.write_json(out, result)
    return result


def _fp8_param_effect(result: dict) -> None:
    """Runs that differ only in optimizer.fp8_param (labels `<x>` and `<x>_fp8param`): the FP8 param
    all-gather's effect on step time and peak memory at each world size."""
    runs, effect = result["runs"], {}
    for label, entry in runs.items():
        base = runs.get(label.removesuffix("_fp8param")) if label.endswith("_fp8param") else None
        if base is None:
            continue
        for w, row in entry["worlds"].items():
            ref = base["worlds"].get(w, {})
            if row.get("step_time_ms") and ref.get("step_time_ms"):
                effect[f"{label}_w{w}"] = {
                    "step_time_ratio": row["step_time_ms"] / ref["step_time_ms"],
                    "peak_mem_gib_delta": (row.get("peak_mem_gib") or 0) - (ref.get("peak_mem_gib") or 0),
                }
    result["fp8_param_effect"] = effect


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
