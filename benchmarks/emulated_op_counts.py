"""Operator counts of one emulated train step on a CPU: what a GPU would launch, and its host syncs.

    python -m benchmarks.emulated_op_counts [--out DIR] [--recipes bf16,tensorwise,...]

gpt_tiny, one warm-up step, then torch.profiler over one step. Per recipe and path:
`aten_ops` (every aten:: call, nested ones included), `copies` (aten::copy_: the casts and
round-trips), `host_syncs` (aten::_local_scalar_dense: bool()/item() of a tensor, on CUDA a sync
that drains the launch queue) and `compiled_regions` (calls into torch.compile'd code, a few
kernels each). Paths: `reference` (the CPU default), `fast` (EmulatedBackend.fast_paths forced on:
fused casts and compiled LayerNorm through inductor's C++ backend, GEMMs on the GEMM operands),
`fast_cuda_amax` (also the sync-free amax CUDA takes, forced on the CPU tensors). A count of aten
calls is a proxy for CUDA launches: a compiled region is a handful of kernels, not one.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

RECIPES = ("bf16", "tensorwise", "blockwise", "mxfp8", "nvfp4")
PATHS = ("reference", "fast", "fast_cuda_amax")


def _step_counts(recipe: str) -> dict:
    from benchmarks.specs import load_config
    from harness.train import Trainer

    cfg = load_config(
        ["model=gpt_tiny", "backend=emulated", f"recipe={recipe}", "logger=none", "data=synthetic"]
    )
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="lowp-opcount-")))
    trainer.train_step(0)  # compiles, fills caches
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train_step(1)
    names = collections.Counter(e.name for e in prof.events())
    return {
        "aten_ops": sum(n for k, n in names.items() if k.startswith("aten::")),
        "copies": names.get("aten::copy_", 0),
        "host_syncs": names.get("aten::_local_scalar_dense", 0),
        "compiled_regions": sum(n for k, n in names.items() if "Compiled" in k or "compiled" in k),
    }


def measure(recipe: str, path: str) -> dict:
    from harness.backends.emulated import EmulatedBackend
    from harness.numerics import scaling

    prev_fast, prev_amax = EmulatedBackend.fast_paths, scaling.amax
    try:
        EmulatedBackend.fast_paths = None if path == "reference" else True
        if path == "fast_cuda_amax":
            scaling.amax = _cuda_amax(prev_amax)
            _rebind(scaling.amax)
        return _step_counts(recipe)
    finally:
        EmulatedBackend.fast_paths = prev_fast
        scaling.amax = prev_amax
        _rebind(prev_amax)


def _cuda_amax(reference):
    from harness.numerics import scaling
    from harness.numerics.formats import ABS_BITS

    def amax(x, dim=None):
        if x.dtype in ABS_BITS:
            return scaling.amax_nosync(x, dim), True
        return reference(x, dim)

    return amax


def _rebind(fn) -> None:
    """The quantizer modules imported `amax` by name: point them at `fn`."""
    import importlib

    for mod in ("blockwise", "mxfp8", "nvfp4", "quantizers", "tensorwise", "int4"):
        m = importlib.import_module(f"harness.numerics.{mod}")
        if hasattr(m, "amax"):
            m.amax = fn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.emulated_op_counts", description=__doc__)
    p.add_argument("--out", default="", help="folder for emulated_op_counts_cpu.json (default: print only)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "runs": {}}
    for recipe in [r for r in args.recipes.split(",") if r]:
        for path in PATHS:
            t0 = time.perf_counter()
            try:
                row = measure(recipe, path)
            except Exception as e:  # noqa: BLE001 - one failing recipe must not lose the others
                row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            row["seconds"] = round(time.perf_counter() - t0, 1)
            result["runs"][f"{recipe}/{path}"] = row
            print(f"{recipe:>10} {path:>15} {row}", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "emulated_op_counts_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
