"""Checkpoint cost: size on disk, write time and resume time for a model shape, as JSON.

    python -m benchmarks.checkpoint_cost                                    # gpt_small on this machine
    python -m benchmarks.checkpoint_cost --name h200_1b experiment=h200_1b  # the 1.4B shape (H200, TE)

Builds the run's Trainer, takes `--steps` optimizer steps (so the optimizer's states exist), then
times `Trainer.checkpoint` (state_dict + DCP write + fsync + manifest + rename), and the resume
path of a second, fresh Trainer: `checkpoint.load_latest` (manifest check, metadata, tensor read)
and `Trainer.load_state_dict`; checks the resumed weights equal the saved ones. Writes
`$OUT/checkpoint_<name>.json` (or --out) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(overrides: list[str], steps: int, workdir: Path, repeats: int) -> dict:
    from harness.lifecycle import checkpoint as ckpt
    from harness.lifecycle.artifacts import Summary
    from harness.train import Trainer
    from harness.validation import load

    cfg = load(["logger=none", "telemetry_interval=0", *overrides])
    run_dir = workdir / "run"
    trainer = Trainer(cfg, run_dir)
    for step in range(steps):
        trainer.train_step(step)
    sync()
    summary = Summary()
    writes = []
    for _ in range(repeats):  # same step each time: the second write replaces the first
        t0 = time.perf_counter()
        trainer.checkpoint(steps - 1, summary)
        writes.append(time.perf_counter() - t0)
    (path,) = ckpt.candidates(run_dir)
    size = sum(f.stat().st_size for f in path.iterdir())
    saved = {k: v.detach().float().cpu() for k, v in trainer.backend.model_state_dict(trainer.model).items()}
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    fresh = Trainer(cfg, run_dir)
    sync()
    t0 = time.perf_counter()
    found = ckpt.load_latest(run_dir)
    t_read = time.perf_counter() - t0
    fresh.load_state_dict(found[2], Summary())
    sync()
    t_resume = time.perf_counter() - t0
    back = fresh.backend.model_state_dict(fresh.model)
    exact = all(torch.equal(saved[k], back[k].detach().float().cpu()) for k in saved)
    return {
        "overrides": overrides,
        "model": cfg.model.name,
        "recipe": cfg.recipe.name,
        "backend": fresh.backend.name,
        "params": fresh.params,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "checkpoint_bytes": size,
        "checkpoint_gib": size / 2**30,
        "files": sorted(f.name for f in path.iterdir()),
        "write_s": writes,
        "write_s_best": min(writes),
        "write_gib_per_s": size / 2**30 / min(writes),
        "read_s": t_read,
        "resume_s": t_resume,
        "resumed_weights_equal": exact,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint_cost", description=__doc__.splitlines()[0]
    )
    ap.add_argument("overrides", nargs="*", default=["model=gpt_small", "backend=emulated"])
    ap.add_argument("--name", default="gpt_small")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/checkpoint_<name>.json)")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="lowp-ckpt-", dir=args.dir))
    try:
        result = bench(args.overrides, args.steps, workdir, args.repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(result, indent=1)
    out = args.out or (
        os.path.join(os.environ["OUT"], f"checkpoint_{args.name}.json") if "OUT" in os.environ else None
    )
    if out:
        Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
