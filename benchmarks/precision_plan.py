"""A precision plan for a model, made and run on lowp's TE backend beside the uniform recipe.

    python -m benchmarks plan_8bslice --out $OUT                 # the 8B slice on the H200

Three phases, each written to the result file as it ends (a timeout keeps what was done):
1. `telemetry`: a short run of the uniform recipe with counterfactual candidates
   (`options.candidates`) on every step, on TE: its numerics.jsonl is the plan's only input;
2. `plan`: `python -m harness.plan` on it (`options.goal`, `k` or `sqnr_floor_db`, `candidate`):
   the plan file, Megatron's `--te-precision-config-file` and the module assignments;
3. `uniform` and `plan` runs (`runs:` of the spec; the plan arm gets `stability=plan
   stability.plan_file=...`): step time, tokens/s and peak memory from each summary, and whether the
   plan run's modules (run.json quantized_modules) are the assignments its Megatron file names.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks import specs


@dataclass(frozen=True)
class Options:
    candidates: tuple[str, ...] = field(
        default=("tensorwise", "blockwise"), metadata={"help": "counterfactuals"}
    )
    telemetry_steps: int = field(
        default=2, metadata={"help": "steps of the telemetry run (all telemetry steps)"}
    )
    goal: str = field(default="max-bf16-modules", metadata={"help": "harness.plan --goal"})
    k: int = field(default=4, metadata={"help": "max-bf16-modules: modules kept in BF16"})
    sqnr_floor_db: float = field(default=10.0, metadata={"help": "max-lowp-flops: the floor"})
    candidate: str = field(default="tensorwise", metadata={"help": "max-bf16-modules: the uniform candidate"})


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    """The telemetry run and the uniform arm (the plan arm is the uniform arm plus its plan file,
    known only after phase 2, so it is validated then)."""
    cands = ",".join(opts.candidates)
    tele = [*spec.overrides, f"steps={opts.telemetry_steps}", "telemetry_interval=1",
            f"telemetry.candidates=[{cands}]", "bench_warmup_steps=0"]  # fmt: skip
    return {
        "telemetry": [*tele, *spec.runs.get("uniform", [])],
        "uniform": [*spec.overrides, *spec.runs["uniform"]],
    }


def _train(overrides: list[str], run_dir: Path) -> dict:
    import json

    from harness.train import run

    t0 = time.perf_counter()
    summary = run(specs.load_config(overrides), run_dir)
    resolved = json.loads((run_dir / "run.json").read_text())
    return {
        "status": summary.status, "step_time_ms": summary.step_time_ms, "tokens_per_s": summary.tokens_per_s,
        "peak_mem_gib": summary.peak_mem_gib, "wall_s": time.perf_counter() - t0,
        "quantized_modules": resolved.get("provenance", {}).get("quantized_modules"),
    }  # fmt: skip


def _megatron_assignments(path: Path) -> dict[str, str]:
    """Megatron file -> {lowp module: config key}, read back through the matchers' patterns."""
    from harness.interop.megatron_precision import megatron_path

    doc = yaml.safe_load(path.read_text())
    by_path = {m["pattern"].lstrip("*"): m["config"] for m in doc["matchers"].values()}
    names = [f"blocks.{i}.{k}" for i in range(512) for k in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    return {n: by_path[megatron_path(n)] for n in names if megatron_path(n) in by_path}


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    from harness.plan import main as plan_main

    work = Path(work)
    result: dict = {"_meta": specs.meta(spec, opts)}
    arms = plan(spec, opts)
    try:
        result["telemetry"] = _train(arms["telemetry"], work / "telemetry")
        specs.write_json(out, result)
        plan_file = work / "plan.yaml"
        args = [str(work / "telemetry"), "--goal", opts.goal, "--out", str(plan_file)]
        args += ["--k", str(opts.k), "--candidate", opts.candidate] if opts.goal == "max-bf16-modules" else [
            "--sqnr-floor-db", str(opts.sqnr_floor_db)]  # fmt: skip
        assert plan_main(args) == 0, "harness.plan refused the telemetry run"
        made = yaml.safe_load(plan_file.read_text())
        mfile = plan_file.with_suffix(".megatron.yaml")
        result["plan"] = {
            "modules": made["modules"], "ranking": made["ranking"][:12],
            "megatron_file": mfile.read_text() if mfile.exists() else None,
        }  # fmt: skip
        specs.write_json(out, result)
        result["uniform"] = _train(arms["uniform"], work / "uniform")
        specs.write_json(out, result)
        plan_arm = [*arms["uniform"], "stability=plan", f"stability.plan_file={plan_file}"]
        result["plan_run"] = r = _train(plan_arm, work / "plan")
        blocks = {k: v for k, v in (r["quantized_modules"] or {}).items() if k.startswith("blocks.")}
        result["plan_run"]["runs_megatron_assignments"] = (
            _megatron_assignments(mfile) == blocks if mfile.exists() else None
        )
        if result["uniform"]["step_time_ms"] and r["step_time_ms"]:
            result["plan_vs_uniform_step_time"] = r["step_time_ms"] / result["uniform"]["step_time_ms"]
    except Exception as e:  # noqa: BLE001 - what was measured is kept; the failure is recorded
        result["error"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    specs.write_json(out, result)
    print({k: v for k, v in result.items() if k in ("plan_vs_uniform_step_time", "error")}, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
