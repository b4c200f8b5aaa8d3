"""Fixture run directories for the analysis tests, written exactly to architecture.md's contract.

`write_run` writes one run directory (run.json, metrics.jsonl, numerics.jsonl, summary.json) from a
closed-form loss curve, so tests can predict numbers. `SWEEP_SOURCES` maps a name to a function
`make(root: Path) -> Path` returning a sweep directory with (at least) two BF16 seeds and two
low-precision recipes; every test that takes the `sweep_dir` fixture runs once per source, and once
per source in SLOW_SOURCES only in the slow lane (`harness`: the sweep made by the harness's CLI).

The fast lane starts no process: a test here that is not marked `slow` fails if it (or a fixture it
sets up) starts one, Python or not (`_no_processes`).
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing.util
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

LAYERS = ("blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.1.attn.qkv", "blocks.1.mlp.fc1")


def loss_curve(step: np.ndarray, steps: int, *, seed: int, offset: float, noise: float) -> np.ndarray:
    """A power-law training curve with seed-dependent noise shared by every recipe of that seed."""
    base = 2.0 + 3.5 * (1.0 + step / 20.0) ** -0.7
    rng = np.random.default_rng(1000 + seed)
    per_step = rng.normal(0.0, noise, steps + 1)  # same draws at the same step, whatever the cadence
    return base + offset * np.minimum(1.0, step / (0.3 * steps)) + 0.004 * (seed - 0.5) + per_step[step]


def write_run(
    root: Path,
    name: str,
    *,
    recipe: str = "bf16",
    recipe_label: str | Literal[False] | None = None,
    recipe_fields: dict[str, Any] | None = None,
    seed: int = 0,
    backend: str = "emulated",
    hardware: str = "cpu",
    stability: str = "none",
    optimizer: str = "adamw_fp32",
    model: str = "gpt_tiny",
    data: str = "markov",
    steps: int = 200,
    log_interval: int = 10,
    eval_interval: int = 50,
    global_batch_size: int = 8,
    seq_length: int = 64,
    offset: float = 0.0,
    noise: float = 0.01,
    loss_fn: Callable[[np.ndarray], np.ndarray] | None = None,
    step_ms: float = 100.0,
    peak_mem_gib: float = 1.0,
    status: str = "completed",
    diverged_step: int | None = None,
    summary: bool = True,
    telemetry: bool = True,
    corrupt: bool = False,
    wandb_run_id: str | None = None,
) -> Path:
    """One run directory. `loss_fn(step) -> loss` replaces the default curve; `diverged_step` makes
    the loss NaN from that step on and stops logging there. summary.recipe_label is `recipe_label`,
    else `recipe` (a run at its family's preset); `recipe_label=False` leaves it out, as a run written
    before labels. `recipe_fields` go into the config's recipe section beside its name."""
    d = root / name
    d.mkdir(parents=True)
    tokens_per_step = global_batch_size * seq_length
    last = diverged_step if diverged_step is not None else steps
    step = np.arange(log_interval, last + 1, log_interval)
    if diverged_step is not None and (not len(step) or step[-1] != diverged_step):
        step = np.append(step, diverged_step)
    loss = loss_fn(step) if loss_fn else loss_curve(step, steps, seed=seed, offset=offset, noise=noise)
    if diverged_step is not None:
        loss[-1] = math.nan
    tps = tokens_per_step / (step_ms / 1000.0)
    config = {
        "recipe": {
            "name": recipe,
            "fp8": None if recipe in ("bf16", "nvfp4") else "e4m3",
            **(recipe_fields or {}),
        },
        "stability": {"name": stability, "fp8_margin": 0},
        "optimizer": {"name": optimizer, "lr": 3e-4},
        "hardware": {"name": hardware, "peak_tflops": {"bf16": 989 if hardware != "cpu" else None}},
        "model": {"name": model, "num_layers": 2, "hidden_size": 64, "seq_length": seq_length},
        "data": {"name": data, "alpha": 0.05},
        "backend": {"name": backend},
        "logger": {"name": "none"},
        "seed": seed,
        "steps": steps,
        "micro_batch_size": global_batch_size,
        "global_batch_size": global_batch_size,
        "eval_interval": eval_interval,
        "eval_tokens": 4096,
        "log_interval": log_interval,
        "telemetry_interval": 50 if telemetry else 0,
    }
    provenance = {
        "git_sha": "0" * 40, "git_dirty": False, "python": "3.11.7", "torch": "2.13.0", "te": None,
        "cuda": None, "gpu_name": None, "gpu_capability": None, "nvte_env": {}, "recipe_repr": recipe,
        "backend": backend, "hardware": hardware, "seed": seed, "data_fingerprint": "f" * 16,
        "hostname": "fixture", "started_at": "2026-01-01T00:00:00Z",
    }  # fmt: skip
    wandb = None
    if wandb_run_id:
        wandb = {
            "run_id": wandb_run_id,
            "project": "lowp",
            "group": "fixture",
            "mode": "offline",
            "dir": None,
        }
    (d / "run.json").write_text(json.dumps({"config": config, "provenance": provenance, "wandb": wandb}))
    lines = []
    for s, v in zip(step.tolist(), loss.tolist(), strict=True):
        row = {
            "step": s, "tokens": s * tokens_per_step, "loss/train": None if math.isnan(v) else v,
            "optim/lr": 3e-4, "optim/grad_norm": 1.0, "time/step_ms": step_ms,
            "throughput/tokens_per_s": tps, "throughput/tflops": None, "throughput/mfu": None,
            "memory/peak_allocated_gib": peak_mem_gib,
        }  # fmt: skip
        lines.append(json.dumps(row))
        if s % eval_interval == 0 and not math.isnan(v):
            lines.append(json.dumps({"step": s, "tokens": s * tokens_per_step, "loss/eval": v + 0.05}))
    if corrupt:
        lines.insert(len(lines) // 2, '{"step": 55, "tokens": 35')  # a torn write in the middle
        lines.append("not json at all")
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if telemetry and recipe != "bf16":
        with open(d / "numerics.jsonl", "w") as f:
            for s in range(50, last + 1, 50):
                for i, layer in enumerate(LAYERS):
                    for j, tensor in enumerate(("input", "weight", "grad")):
                        under = (
                            0.001 * (i + 1) * (3 if tensor == "grad" else 1) * (5 if recipe == "nvfp4" else 1)
                        )
                        f.write(json.dumps({
                            "step": s, "layer": layer, "tensor": tensor, "amax": 1.0 + j, "scale": 448.0,
                            "underflow": under, "saturation": 0.0001 * j, "sqnr_db": 30.0 - i,
                        }) + "\n")  # fmt: skip
    if summary:
        evals = [
            v + 0.05 for s, v in zip(step, loss, strict=True) if s % eval_interval == 0 and np.isfinite(v)
        ]
        finite = loss[np.isfinite(loss)]
        summ: dict[str, Any] = {
            "status": status, "recipe": recipe, "variant": f"{stability}+{optimizer}", "backend": backend,
            "hardware": hardware, "model": model, "data": data, "seed": seed, "steps": steps,
            "tokens": int(last * tokens_per_step),
            "final_train_loss": float(finite[-1]) if status == "completed" else None,
            "final_eval_loss": float(evals[-1]) if evals and status == "completed" else None,
            "loss_floor": 1.9, "tokens_per_s": tps, "step_time_ms": step_ms,
            "mfu_bf16_peak": None if hardware == "cpu" else 0.4, "mfu_recipe_peak": None,
            "peak_mem_gib": peak_mem_gib, "memory": {"params": 0.1}, "wall_time_s": last * step_ms / 1000,
            "diverged_step": diverged_step, "divergence_cause": "loss is nan" if diverged_step else None,
            "error": None,
        }  # fmt: skip
        if recipe_label is not False:
            summ["recipe_label"] = recipe_label or recipe
        (d / "summary.json").write_text(json.dumps(summ))
    return d


def make_synthetic_sweep(root: Path) -> Path:
    """Hydra multirun layout: CPU group (all emulated: bf16, tensorwise, nvfp4) and an H200 group
    (native bf16 and tensorwise, emulated mxfp8), two seeds each."""
    sweep = root / "synthetic_sweep"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    n = 0
    for recipe, offset in (("bf16", 0.0), ("tensorwise", 0.004), ("nvfp4", 0.05)):
        for seed in (0, 1):
            write_run(sweep, f"{n}_{recipe}_s{seed}", recipe=recipe, seed=seed, offset=offset)
            n += 1
    for recipe, backend, offset, ms, mem in (
        ("bf16", "te", 0.0, 100.0, 10.0),
        ("tensorwise", "te", 0.004, 75.0, 9.0),
        ("mxfp8", "emulated", 0.006, 400.0, 12.0),
    ):
        for seed in (0, 1):
            write_run(sweep, f"{n}_{recipe}_s{seed}", recipe=recipe, seed=seed, offset=offset,
                      backend=backend, hardware="h200", step_ms=ms, peak_mem_gib=mem)  # fmt: skip
            n += 1
    return sweep


def make_harness_sweep(root: Path) -> Path:
    """A tiny real sweep made by the harness's own CLI (Hydra multirun layout): BF16, emulated
    tensorwise and NVFP4 on gpt_tiny, two seeds each, with numerics telemetry."""
    import sys

    sweep = root / "harness_sweep"
    args = [
        sys.executable,
        "-m",
        "harness.train",
        "-m",
        "model=gpt_tiny",
        "backend=emulated",
        "hardware=cpu",
        "steps=12",
        "log_interval=2",
        "eval_interval=4",
        "eval_tokens=2048",
        "telemetry_interval=4",
        "micro_batch_size=4",
        "global_batch_size=4",
        "data.num_tokens=200000",
        "logger=none",
        "recipe=bf16,tensorwise,nvfp4",
        "seed=0,1",
        f"hydra.sweep.dir={sweep}",
    ]
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        args,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return sweep


SWEEP_SOURCES: dict[str, Callable[[Path], Path]] = {
    "synthetic": make_synthetic_sweep,
    "harness": make_harness_sweep,
}
SLOW_SOURCES = {"harness"}
"""Sources that start processes (the CLI, a multirun): their tests belong to the slow lane."""


@pytest.fixture(
    scope="session",
    params=[
        pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SOURCES else s for s in sorted(SWEEP_SOURCES)
    ],
)
def sweep_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep directory per source in SWEEP_SOURCES (two BF16 seeds and two or more recipes)."""
    return SWEEP_SOURCES[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture
def run_writer() -> Callable[..., Path]:
    """`write_run(root, name, **kw)`, for tests that build their own edge cases."""
    return write_run


@pytest.fixture(autouse=True)
def _no_wandb_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Analysis never talks to a W&B server; tests that make offline runs must not either."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


INCIDENTAL = {"fc-list", "uname", "ldconfig", "gcc", "cc", "objdump", "ld"}
"""System tools that libraries run once on first use, not what a test launches: matplotlib's font
cache (fc-list), platform (uname), ctypes.util.find_library (ldconfig, gcc, cc, objdump, ld)."""


@contextlib.contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    """Fail a test of the fast lane that starts a process: a subprocess (the CLI, a kernel, a
    service), a fork, or a multiprocessing pool. A `slow` test may."""
    if item.get_closest_marker("slow"):
        yield
        return

    def refuse(what: str) -> Callable[..., Any]:
        def start(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(
                f"{item.nodeid} starts a process ({what}) in the fast lane: mark it slow, or write its "
                "data in-process (tests/analysis/conftest.py)"
            )

        return start

    real_child = subprocess.Popen._execute_child

    def execute_child(self: subprocess.Popen, args: Any, executable: Any, *rest: Any) -> Any:
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if os.path.basename(os.fsdecode(executable or argv[0])) in INCIDENTAL:
            return real_child(self, args, executable, *rest)
        return refuse(f"subprocess {argv[:3]}")()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", execute_child)
        mp.setattr(os, "fork", refuse("os.fork"))
        mp.setattr(os, "system", refuse("os.system"))
        for name in ("posix_spawn", "posix_spawnp"):
            mp.setattr(os, name, refuse(f"os.{name}"), raising=False)
        mp.setattr(multiprocessing.util, "spawnv_passfds", refuse("a multiprocessing spawn"))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    with _no_processes(item):
        return (yield)
