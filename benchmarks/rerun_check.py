"""Is a run reproducible run to run? The same `python -m harness.train` command twice, each step's train
loss and gradient norm compared exactly, and the first step where they part.

    python -m benchmarks.rerun_check --out DIR [--steps 30] [--deterministic-env] -- OVERRIDE...

A loss check pairs each run with the BF16 run of its seed (analysis.seed_band), which assumes a seed's
run is the same every time. On CUDA, kernels that add with atomics break that: TE's runs of the MoE
slices on an H200 give the same first loss and part by step 25 (benchmarks/RESULTS.md, "Loss check of
the Mixtral-like slice's fastest FP8 step"). Run this before trusting a paired verdict on a new setup.

`--deterministic-env` runs both with the environment Megatron-LM's `--deterministic-mode` sets
(megatron/training/determinism.py): NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (TE's
deterministic attention backward) and CUBLAS_WORKSPACE_CONFIG=:4096:8; a value already in the
environment is kept. It does not turn on `torch.use_deterministic_algorithms`; the run's own
`backend.deterministic=true` (an override here) does both, for the run, as Megatron's mode does.

Writes DIR/rerun_check.json: the command, the environment it added, both runs' per-step values, the
number of leading identical steps and the first difference; exit 1 where a run fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from analysis.reader import parse_jsonl
from benchmarks import specs
from harness.backends.determinism import ENV as DETERMINISTIC_ENV

KEYS = ("loss/train", "optim/grad_norm")
OWNED = ("steps", "log_interval", "hydra.run.dir")  # set here: one value each for both runs


def compare(a: list[dict], b: list[dict]) -> dict:
    """Leading steps where every KEYS value is equal to the bit, and the first that is not (or where one
    run has a step the other lacks)."""
    rows_a, rows_b = (_by_step(rows) for rows in (a, b))
    same = 0
    for step in sorted(set(rows_a) | set(rows_b)):
        ra, rb = rows_a.get(step), rows_b.get(step)
        if ra is None or rb is None:
            return {"identical_steps": same, "first_difference": {"step": step, "key": "missing in one run"}}
        for key in KEYS:
            if ra.get(key) != rb.get(key):
                first = {"step": step, "key": key, "a": ra.get(key), "b": rb.get(key)}
                if isinstance(first["a"], float) and isinstance(first["b"], float):
                    first["abs_diff"] = abs(first["a"] - first["b"])
                return {"identical_steps": same, "first_difference": first}
        same += 1
    return {"identical_steps": same, "first_difference": None}


def _by_step(rows: list[dict]) -> dict[int, dict]:
    """metrics.jsonl rows merged per step (a step may log in several rows), for steps with a KEYS value."""
    out: dict[int, dict] = {}
    for r in rows:
        if "step" in r:
            out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if v is not None})
    return {s: r for s, r in out.items() if any(k in r for k in KEYS)}


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return parse_jsonl(path, []) if path.exists() else []


def _versions() -> dict:
    from harness.lifecycle.artifacts import git_state

    out = {"python": sys.version.split()[0], **git_state()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - lowp needs torch; recorded rather than assumed
        out["torch"] = None
    try:
        import transformer_engine

        out["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        out["transformer_engine"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rerun_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--deterministic-env", action="store_true", help="Megatron-LM's determinism environment")
    p.add_argument("overrides", nargs="*", help="the run's overrides (after --)")
    a = p.parse_args(argv)
    owned = [o for o in a.overrides if o.split("=", 1)[0].lstrip("+") in OWNED]
    if owned:
        print(f"error: {owned[0]}: rerun_check sets {', '.join(OWNED)} itself; use --steps", file=sys.stderr)
        return 2
    if a.steps < 1:
        print(f"error: --steps {a.steps}: give at least 1 step", file=sys.stderr)
        return 2
    added = {k: v for k, v in DETERMINISTIC_ENV.items() if k not in os.environ} if a.deterministic_env else {}
    env = {**os.environ, **added}
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "overrides": a.overrides,
        "steps": a.steps,
        "deterministic_env": a.deterministic_env,
        "env_added": added,
        "env_kept": {k: os.environ[k] for k in DETERMINISTIC_ENV if k in os.environ},
        **_versions(),
        "runs": {},
    }
    path, rows = a.out / "rerun_check.json", {}
    for tag in ("a", "b"):
        run_dir = a.out / f"run_{tag}"
        cmd = [sys.executable, "-m", "harness.train", *a.overrides, f"steps={a.steps}", "log_interval=1"]
        cmd.append(f"hydra.run.dir={run_dir}")
        print(f"[rerun_check] run {tag}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        rows[tag] = _rows(run_dir)
        result["runs"][tag] = {
            "rc": proc.returncode,
            "wall_s": round(time.perf_counter() - t0, 1),
            "values": [[step, *(r.get(k) for k in KEYS)] for step, r in sorted(_by_step(rows[tag]).items())],
        }
        if proc.returncode:
            result["runs"][tag]["stderr_tail"] = proc.stderr[-1500:]
            specs.write_json(path, result)
            print(f"error: run {tag} exited {proc.returncode}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
            return 1
    result |= compare(rows["a"], rows["b"])
    specs.write_json(path, result)
    first = result["first_difference"]
    if first is None:
        print(f"[rerun_check] identical: {result['identical_steps']} of {a.steps} steps equal to the bit")
    else:
        vals = f": {first.get('a')} against {first.get('b')}" if "a" in first else ""
        print(
            f"[rerun_check] NOT reproducible: identical for {result['identical_steps']} steps, first "
            f"difference at step {first['step']} ({first['key']}{vals})"
        )
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
