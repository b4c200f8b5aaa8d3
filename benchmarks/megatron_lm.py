"""Hold lowp's Megatron export against Megatron-LM itself.

    python -m benchmarks.megatron_lm check --megatron DIR --out OUT [--python PY] [--limit N]
        [--schedules-only]
    python -m benchmarks.megatron_lm pretrain --megatron DIR --out OUT [--recipes bf16,tensorwise]
        [--iters 20] [--timeout 240] [--over OVERRIDE ...] [--lowp-over OVERRIDE ...]

`check` exports every case of the preset x recipe x knob sweep (harness.validation.reference_sweep,
the MoE model presets x recipe x MoE knob included), accepted by lowp or not, and feeds each distinct
flag list to Megatron-LM's own `parse_args` + `validate_args`, then builds its TransformerConfig,
OptimizerConfig and DDP config from the parsed args and, where Transformer Engine is importable,
Megatron's TE recipe object. It writes
OUT/check.json: per case lowp's verdict and Megatron's (the stage that refused and its message),
and the two kinds of disagreement: lowp accepts what Megatron refuses (a lowp bug), lowp refuses
what Megatron accepts (lowp stricter: its message says what Megatron would do). Megatron runs in
a child process of `--python` (default: this interpreter) with DIR on its path; it needs torch,
numpy, packaging and triton (no GPU), and Python >= 3.12 for Megatron-LM d98e8a6 (`typing.override`).
Without a GPU or TE the child answers Megatron's compute-capability and TE-version queries as the
exported command's Hopper and TE 2.20.2 would, and builds the TransformerConfig without the fused
RoPE kernel TE provides (both are in check.json); what needs TE itself stays unchecked.

`check` also exports the precision schedules (`SCHEDULES`: the conf/schedule presets and two
hand-written ones, a delayed -> delayed change of amax algorithm and delayed -> delayed -> tensorwise, on the
`SCHEDULE_MODELS`) one command per phase (harness.interop.megatron_schedule: `--save`/`--load`,
`--exit-interval`, `--ckpt-drop-redundant-extra-state`) and feeds each phase's argv through the same
checks; check.json's `schedules` holds each phase's verdict. `--schedules-only` checks those alone
(a minute on two cores). The check exits 1 when Megatron refuses a command lowp exports.

`pretrain` prints `python -m harness.megatron experiment=EXPERIMENT recipe=R steps=ITERS --format
sh` for each recipe (EXPERIMENT: h200_1b unless `--experiment`; `--over` adds overrides to both sides,
`--lowp-over` to lowp's run only), runs that command as printed
(MEGATRON_LM=DIR, one GPU), then lowp's own
`harness.train` at the same config, and writes OUT/pretrain.json with Megatron's step times (its
"elapsed time per iteration" log, first interval left out as warm-up) beside lowp's
(summary.json's median steady-state step).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# check: lowp's decisions against Megatron-LM's own argument checks


def lowp_cases(limit: int | None = None) -> list[dict]:
    """Every sweep case: its label, lowp's verdict (None = accepted, else the message), its argv."""
    from harness.interop.megatron import megatron_args, provider_fields
    from harness.validation.reference_sweep import cases, verdict

    out = []
    for label, cfg in cases():
        refused = verdict(cfg)
        argv, fields = megatron_args(cfg)[0], provider_fields(cfg)
        out.append({"case": label, "lowp_refuses": refused, "argv": argv, "fields": fields})
        if limit and len(out) >= limit:
            break
    return out


SCHEDULE_MODELS = ("gpt_125m", "gpt_1b", "qwen3_moe_tiny")
"""A dense RoPE model, the 1.4B anchor shape (learned positions) and an MoE preset."""
SCHEDULES = {
    "nvfp4 -> bf16": ["recipe=nvfp4", "schedule=bf16_last10pct"],
    "mxfp8 -> bf16": ["recipe=mxfp8", "schedule=bf16_last10pct"],
    "tensorwise -> high-precision backward": ["recipe=tensorwise", "schedule=hp_backward_last10pct"],
    "blockwise -> high-precision backward": ["recipe=blockwise", "schedule=hp_backward_last10pct"],
    "nvfp4 -> BF16 forward, MXFP8 backward": ["recipe=nvfp4", "schedule=hp_forward_last10pct"],
    "delayed -> delayed (most_recent)": [
        "recipe=delayed",
        "schedule.phases=[{at_fraction: 0.5, fields: {fp8_amax_compute_algo: most_recent}}]",
    ],
    "delayed -> delayed -> tensorwise": [
        "recipe=delayed",
        "schedule.phases=[{at_fraction: 0.3, fields: {fp8_amax_compute_algo: most_recent}}, "
        "{at_fraction: 0.6, recipe: tensorwise}]",
    ],
}
"""Schedules whose per-phase commands the check feeds to Megatron-LM (overrides of each)."""
SCHEDULE_STEPS = 1000
CHECKPOINTS = "/tmp/lowp-schedule-checkpoints"
"""The phases' --save/--load directory in the checked argv (parse_args and validate_args read no file)."""


def schedule_cases() -> list[dict]:
    """Every model x schedule: lowp's verdict and, where lowp exports it, each phase's argv."""
    from harness.interop.megatron import nvte_env, provider_fields
    from harness.interop.megatron_schedule import phase_configs, schedule_args
    from harness.validation import ConfigError, load

    out = []
    for model in SCHEDULE_MODELS:
        for name, overrides in SCHEDULES.items():
            case = {"case": f"model={model} {name}"}
            case["overrides"] = [f"model={model}", f"steps={SCHEDULE_STEPS}", *overrides]
            try:
                cfg = load(case["overrides"], for_export=True)
                phases = [
                    {
                        "recipe": phase.recipe.name,
                        "env": nvte_env(phase),
                        "argv": argv,
                        "fields": provider_fields(phase),
                    }  # fmt: skip
                    for (argv, _), phase in zip(
                        schedule_args(cfg, CHECKPOINTS), phase_configs(cfg), strict=True
                    )
                ]
            except ConfigError as exc:
                out.append({**case, "lowp_refuses": str(exc), "phases": []})
                continue
            out.append({**case, "lowp_refuses": None, "phases": phases})
    return out


def schedule_summary(cases: list[dict]) -> dict:
    """Counts over the schedules' phase commands, and every phase Megatron refused."""
    phases = [(c["case"], i, p) for c in cases for i, p in enumerate(c["phases"])]
    return {
        "schedules": len(cases),
        "lowp_refuses": [{"case": c["case"], "lowp": c["lowp_refuses"]} for c in cases if c["lowp_refuses"]],
        "phase_commands": len(phases),
        "megatron_accepts": sum(p["megatron"]["ok"] is True for _, _, p in phases),
        "unchecked_without_te": sum(p["megatron"]["ok"] is None for _, _, p in phases),
        "megatron_refuses": [
            {"case": case, "phase": i, **p["megatron"]}
            for case, i, p in phases
            if p["megatron"]["ok"] is False
        ],
    }


def _megatron_verdict(argv: list[str], fields: dict) -> dict:
    """Megatron's verdict on one flag list, plus the TransformerConfig fields that have no flag
    (set on the parsed args, as a model provider would); runs in the child."""
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

    stage = "parse_args"
    sys.argv = ["pretrain_gpt.py", *argv]
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            args = parse_args()
            stage = "validate_args"
            validate_args(args)
            stage = "TransformerConfig"
            for name, value in fields.items():
                setattr(args, name, value)
            skipped = _without_te_kernels(args)
            config = core_transformer_config_from_args(args)
            stage = "OptimizerConfig"
            get_megatron_optimizer_config(args)
            stage = "DistributedDataParallelConfig"
            get_megatron_ddp_config(args)
            stage = "TE recipe"
            te_recipe = _te_recipe(config)
        return {"ok": True, "te_recipe": te_recipe, **skipped}
    except SystemExit as exc:  # argparse: unknown flag or bad value
        return {"ok": False, "stage": stage, "error": f"exit {exc.code}: {sink.getvalue()[-400:].strip()}"}
    except BaseException as exc:  # noqa: BLE001 - Megatron refuses with asserts, ValueError, TypeError...
        error = f"{type(exc).__name__}: {exc}"[:600]
        # without TE (a CPU check) Megatron refuses whatever needs it (FP4, the precision-aware
        # optimizer's FusedAdam): those cases are not checked there
        unchecked = not _has_te() and ("TransformerEngine" in error or "Transformer Engine" in error)
        return {"ok": None if unchecked else False, "stage": stage, "error": error}


def _without_te_kernels(args) -> dict:
    """Without TE (a CPU check), turn off the fused RoPE that Megatron's TransformerConfig refuses
    to build without TE's kernel (transformer_config.py:2498-2520, on by default): its MoE and
    recipe rules come after it. Returns what was turned off, for the verdict."""
    if _has_te() or not args.apply_rope_fusion or args.position_embedding_type != "rope":
        return {}
    args.apply_rope_fusion = False
    return {"cpu_without": ["apply_rope_fusion"]}


def _has_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _te_recipe(config) -> str | None:
    """Megatron's own TE recipe object for the config (None without TE or without FP8/FP4)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return None
    if config.fp8:
        from megatron.core.fp8_utils import get_fp8_recipe

        return repr(get_fp8_recipe(config))
    if config.fp4:
        from megatron.core.fp4_utils import get_fp4_recipe

        return repr(get_fp4_recipe(config))
    return None


def cpu_answers() -> dict:
    """What a check without GPU and TE answers for them, as the exported command would find them:
    the Hopper compute capability (validate_args asks it for --moe-grouped-gemm, arguments.py:
    1378-1380) and the TE version lowp targets (backend.te_version; TransformerConfig asks it for
    FP8 MoE, transformer_config.py:2627-2639, and validate_args for FP4, arguments.py:1108-1109).
    What needs TE itself (its kernels, FusedAdam, recipe objects) stays unchecked."""
    from harness.config.schema import BackendConfig

    return {"compute_capability": [9, 0], "te_version": BackendConfig().te_version}


def _answer_for_the_gpu(answers: dict) -> None:
    """In the child, without a GPU or TE: Megatron's device and TE-version queries get `answers`."""
    import torch

    if not torch.cuda.is_available():
        capability = tuple(answers["compute_capability"])
        torch.cuda.get_device_capability = lambda device=None: capability
    if not _has_te():
        import megatron.core.utils as mcore_utils
        from packaging.version import Version

        mcore_utils._te_version = Version(answers["te_version"])  # get_te_version's cache


def child_main() -> None:
    """stdin: {"answers": cpu_answers(), "items": [[argv, fields], ...]}; stdout (last line): a JSON
    list of verdicts."""
    job = json.loads(sys.stdin.read())
    _answer_for_the_gpu(job["answers"])
    verdicts = [_megatron_verdict(argv, fields) for argv, fields in job["items"]]
    sys.stdout.write("\n" + json.dumps(verdicts) + "\n")


def megatron_verdicts(items: list, megatron: Path, python: str, jobs: int) -> list[dict]:
    """Verdicts in `jobs` child processes side by side (each imports Megatron once)."""
    paths = [str(megatron), str(REPO), os.environ.get("PYTHONPATH", "")]  # keep e.g. TE's site dir
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    chunks = [items[i::jobs] for i in range(jobs)]
    procs = [
        subprocess.Popen(
            [python, "-m", "benchmarks.megatron_lm", "_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for _ in chunks
    ]
    jobs_in = [json.dumps({"answers": cpu_answers(), "items": c}) for c in chunks]
    with ThreadPoolExecutor(len(procs)) as pool:  # one communicate() at a time would run them in turn
        outs = list(pool.map(lambda p, job: p.communicate(job), procs, jobs_in))
    results: list[list[dict]] = []
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"Megatron child failed ({p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    verdicts: list[dict] = [{}] * len(items)
    for j, chunk_result in enumerate(results):  # undo the round-robin split
        for k, v in enumerate(chunk_result):
            verdicts[j + k * jobs] = v
    return verdicts


def _counts(cases: list[dict]) -> dict:
    """The verdict counts of a subset of the cases (the MoE presets')."""
    lowp_ok = [c["lowp_refuses"] is None for c in cases]
    mg_ok = [c["megatron"]["ok"] for c in cases]
    return {
        "cases": len(cases),
        "lowp_accepts": sum(lowp_ok),
        "megatron_accepts": sum(m is True for m in mg_ok),
        "unchecked_without_te": sum(m is None for m in mg_ok),
        "lowp_accepts_megatron_refuses": sum(lo and m is False for lo, m in zip(lowp_ok, mg_ok, strict=True)),
        "lowp_stricter": sum(not lo and m is True for lo, m in zip(lowp_ok, mg_ok, strict=True)),
        "both_refuse": sum(not lo and m is False for lo, m in zip(lowp_ok, mg_ok, strict=True)),
    }


def check(args) -> dict:
    t0 = time.time()
    cases = [] if args.schedules_only else lowp_cases(args.limit)
    schedules = schedule_cases()
    phases = [p for c in schedules for p in c["phases"]]
    key = lambda c: json.dumps([c["argv"], c["fields"]])  # noqa: E731
    distinct = sorted({key(c) for c in [*cases, *phases]})
    items = [json.loads(k) for k in distinct]
    verdicts = dict(
        zip(distinct, megatron_verdicts(items, args.megatron, args.python, max(1, args.jobs)), strict=True)
    )
    for p in phases:
        p["megatron"] = verdicts[key(p)]
    report = {"megatron": str(args.megatron), **(sweep_report(cases, verdicts, key) if cases else {})}
    report["schedules"] = schedule_summary(schedules)
    report["answered_without_gpu_or_te"] = cpu_answers()
    report["seconds"] = round(time.time() - t0, 1)
    report["all_schedules"] = schedules
    if cases:
        report["all"] = [{k: c[k] for k in ("case", "lowp_refuses", "megatron")} for c in cases]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check.json").write_text(json.dumps(report, indent=1))
    s = report["schedules"]
    print(
        f"[megatron_lm] schedules: {s['schedules']} ({len(s['lowp_refuses'])} refused by lowp), "
        f"{s['phase_commands']} phase commands: Megatron accepts {s['megatron_accepts']}, refuses "
        f"{len(s['megatron_refuses'])}, unchecked {s['unchecked_without_te']} -> {args.out / 'check.json'}"
    )
    for r in s["megatron_refuses"][:20]:
        print(f"  Megatron refuses phase {r['phase']} of {r['case']}: {r['stage']}: {r['error']}")
    return report


def sweep_report(cases: list[dict], verdicts: dict, key) -> dict:
    """The sweep's counts: lowp's verdicts against Megatron's, and the two kinds of disagreement."""
    accepts_refused, stricter = [], []
    for c in cases:
        v = verdicts[key(c)]
        c["megatron"] = v
        if v["ok"] is None:
            continue
        if c["lowp_refuses"] is None and not v["ok"]:
            accepts_refused.append(c)
        elif c["lowp_refuses"] is not None and v["ok"]:
            stricter.append({"case": c["case"], "lowp": c["lowp_refuses"]})
    report = {
        "cases": len(cases),
        "distinct_flag_lists": len({key(c) for c in cases}),
        "lowp_accepts": sum(c["lowp_refuses"] is None for c in cases),
        "megatron_accepts": sum(c["megatron"]["ok"] is True for c in cases),
        "unchecked_without_te": sum(c["megatron"]["ok"] is None for c in cases),
        "lowp_accepts_megatron_refuses": accepts_refused,
        "lowp_stricter": stricter,
        "both_refuse": sum(c["lowp_refuses"] is not None and c["megatron"]["ok"] is False for c in cases),
        "moe": _counts([c for c in cases if c["case"].startswith("model=")]),
        "fused_rope_off_without_te": sum("cpu_without" in c["megatron"] for c in cases),
    }
    print(
        f"[megatron_lm] {report['cases']} cases ({report['distinct_flag_lists']} flag lists): lowp accepts "
        f"{report['lowp_accepts']}, Megatron accepts {report['megatron_accepts']}; lowp accepts what "
        f"Megatron refuses: {len(accepts_refused)}; lowp stricter: {len(stricter)}; unchecked "
        f"{report['unchecked_without_te']}"
    )
    moe = report["moe"]
    print(
        f"[megatron_lm] of which MoE presets: {moe['cases']} cases, lowp accepts {moe['lowp_accepts']}, "
        f"Megatron accepts {moe['megatron_accepts']}; lowp accepts what Megatron refuses: "
        f"{moe['lowp_accepts_megatron_refuses']}; lowp stricter: {moe['lowp_stricter']}"
    )
    for c in accepts_refused[:20]:
        v = c["megatron"]
        print(f"  lowp accepts, Megatron refuses: {c['case']}: {v['stage']}: {v['error']}")
    return report


# ----------------------------------------------------------------------------------------------
# pretrain: the printed command on the GPU, beside lowp at the same config

_MAX_ALLOCATED = re.compile(r"max allocated: ([0-9.]+)")
LOG_EVERY = 5  # Megatron logs the mean over each interval; the first one is the warm-up
_ITER_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def megatron_step_ms(log: str, warm_iters: int) -> dict:
    """Megatron's per-interval mean iteration times, and their median over the intervals that
    start after `warm_iters` (warm-up and the first iteration's compile/allocation left out)."""
    rows = [(int(i), float(ms)) for i, ms in _ITER_MS.findall(log)]
    steady = [ms for it, ms in rows if it > warm_iters]
    peaks = [float(mb) for mb in _MAX_ALLOCATED.findall(log)]  # report_memory (common_utils.py:323)
    return {
        "intervals": rows,
        "step_ms": statistics.median(steady) if steady else None,
        "peak_gib": max(peaks) / 1024 if peaks else None,
    }


def _run(cmd, out_log: Path, timeout: int, env=None, shell=False) -> tuple[int, str, float]:
    t0 = time.time()
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, shell=shell
        )
        rc, text = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        rc = 124
    out_log.write_text(text[-200_000:])
    return rc, text, round(time.time() - t0, 1)


def pretrain(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    overrides_of = lambda r: [  # noqa: E731
        f"experiment={args.experiment}",
        f"recipe={r}",
        f"steps={args.iters}",
        f"log_interval={LOG_EVERY}",
        f"bench_warmup_steps={LOG_EVERY}",  # lowp's median leaves out the same warm-up as Megatron's
        *args.over,
    ]
    report: dict = {"iters": args.iters, "recipes": {}}
    for recipe in args.recipes.split(","):
        entry: dict = {"overrides": overrides_of(recipe)}
        report["recipes"][recipe] = entry
        export = subprocess.run(
            [sys.executable, "-m", "harness.megatron", *overrides_of(recipe), "--format", "sh"],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        entry["command"] = export.stdout
        if export.returncode != 0:
            entry["error"] = export.stderr.strip()
            continue
        env = {**os.environ, "MEGATRON_LM": str(args.megatron.resolve())}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # torchrun
        env["PYTHONPATH"] = os.pathsep.join([str(args.megatron.resolve()), env.get("PYTHONPATH", "")])
        rc, log, wall = _run(
            ["bash", "-c", export.stdout], args.out / f"megatron_{recipe}.log", args.timeout, env
        )
        entry["megatron"] = {
            "rc": rc,
            "wall_s": wall,
            **megatron_step_ms(log, LOG_EVERY),
            "tail": log[-1500:],
        }
        run_dir = args.out / f"lowp_{recipe}"
        cmd = [sys.executable, "-m", "harness.train", *overrides_of(recipe), *args.lowp_over]
        cmd += [f"hydra.run.dir={run_dir}"]
        rc, log, wall = _run(cmd, args.out / f"lowp_{recipe}.log", args.timeout)
        summary = run_dir / "summary.json"
        s = json.loads(summary.read_text()) if summary.exists() else {}
        entry["lowp"] = {
            "rc": rc,
            "wall_s": wall,
            "overrides": args.lowp_over,
            "step_ms": s.get("step_time_ms"),
            "status": s.get("status"),
            "peak_gib": (s.get("memory") or {}).get("peak_measured_gib"),
        }
        if rc != 0:
            entry["lowp"]["tail"] = log[-1500:]
        (args.out / "pretrain.json").write_text(json.dumps(report, indent=1))
        m, lw = entry["megatron"]["step_ms"], entry["lowp"]["step_ms"]
        print(f"[megatron_lm] {recipe}: Megatron {m} ms/step, lowp {lw} ms/step", flush=True)
    (args.out / "pretrain.json").write_text(json.dumps(report, indent=1))
    return report


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megatron_lm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="lowp's decisions against Megatron-LM's argument checks")
    c.add_argument("--python", default=sys.executable, help="interpreter that imports Megatron-LM")
    c.add_argument("--limit", type=int, default=None, help="only the first N sweep cases")
    c.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="Megatron child processes")
    c.add_argument("--schedules-only", action="store_true", help="only the schedules' phase commands")
    t = sub.add_parser("pretrain", help="run the exported pretrain_gpt.py line beside lowp")
    t.add_argument("--recipes", default="bf16,tensorwise")
    t.add_argument("--iters", type=int, default=20)
    t.add_argument("--timeout", type=int, default=240, help="seconds per run")
    t.add_argument("--experiment", default="h200_1b", help="the experiment preset both run")
    t.add_argument("--over", nargs="*", default=[], help="overrides both take (lowp's run and the export)")
    t.add_argument("--lowp-over", nargs="*", default=[], help="overrides of lowp's run only")
    for q in (c, t):
        q.add_argument("--megatron", type=Path, required=True, help="a Megatron-LM source tree")
        q.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not (args.megatron / "megatron" / "training" / "arguments.py").exists():
        p.error(f"--megatron {args.megatron}: no megatron/training/arguments.py there (a Megatron-LM tree)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        child_main()
        return 0
    args = parse(argv)
    try:
        report = check(args) if args.cmd == "check" else pretrain(args)
    except Exception:  # noqa: BLE001 - say what broke; whatever was written stays
        traceback.print_exc()
        return 1
    if args.cmd == "check":
        refused = report.get("lowp_accepts_megatron_refuses") or report["schedules"]["megatron_refuses"]
        return 1 if refused else 0
    return 0 if all("error" not in e for e in report["recipes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
