"""Throughput of recipes through the harness itself, beside a bare loop and the anchor script, in one process.

    python -m benchmarks.throughput --spec anchor_1b [--anchor .gpu/anchor_gpt.py]
    python -m benchmarks.throughput experiment=h200_1b --recipes bf16,tensorwise [--no-bare]

For each run it measures (1) the harness (`harness.train.run`, median of steady-state steps), (2) a
bare loop of the harness's own train step in the same process (same model, optimizer, batch; no
metrics, no logging) -> the harness's overhead, and optionally (3) the anchor script's row for the
same shape (read from the run's conf/model preset) and recipe, so that GPUs of one model that differ
by a few percent are compared in one machine state. The runs are the spec's `runs` (label ->
overrides), else one per recipe of --recipes. Prints a table; the result JSON is rewritten after every
run, so a timeout keeps what was measured.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import specs


@dataclass(frozen=True)
class Options:
    recipes: tuple[str, ...] = field(
        default=("bf16", "delayed", "tensorwise", "blockwise"), metadata={"help": "one run each (no runs)"}
    )
    anchor: str = field(default="", metadata={"help": "path of anchor_gpt.py to run beside the harness"})
    anchor_first: bool = field(default=False, metadata={"help": "the anchor row before the harness row"})
    bare: bool = field(default=True, metadata={"help": "also time the bare loop (the harness's overhead)"})
    profile: bool = field(default=False, metadata={"help": "torch.profiler kernel table per run"})


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    if spec.runs:
        return spec.run_overrides()
    return {r: [*spec.overrides, f"recipe={r}"] for r in opts.recipes}


def _trainer(cfg, prefix: str):
    from harness.train import Trainer

    return Trainer(cfg, Path(tempfile.mkdtemp(prefix=prefix)))


def bare_loop(cfg, steps: int = 10, warm: int = 4) -> float:
    """Median ms of the harness's own train step timed by bare CUDA events: no metrics processor, no
    logging, no checks -> the harness's overhead."""
    trainer = _trainer(cfg, "lowp-bare-")
    times = []
    for step in range(warm + steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        trainer.train_step(step)
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times[warm:])


def profile_steps(cfg, out: Path, steps: int = 3, warm: int = 4) -> None:
    """torch.profiler over a few steady-state train steps: the kernel table lands in the file `out`."""
    from torch.profiler import ProfilerActivity, profile

    trainer = _trainer(cfg, "lowp-prof-")
    for step in range(warm):
        trainer.train_step(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(warm, warm + steps):
            trainer.train_step(step)
        torch.cuda.synchronize()
    out.write_text(f"{steps} steps\n{prof.key_averages().table(sort_by='cuda_time_total', row_limit=40)}\n")


def anchor_shape(cfg) -> tuple | None:
    """anchor_gpt.py's shape tuple for this run's model, or None where its GPT cannot build it (it has
    LayerNorm, GELU, learned positions and no linear biases)."""
    m = cfg.model
    kind = (m.normalization, m.activation, m.position_embedding, m.add_bias_linear)
    if kind != ("LayerNorm", "gelu", "learned", False):
        return None
    dims = (m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads, m.ffn_hidden_size, m.seq_length)
    return (*dims, cfg.micro_batch_size)


def anchor_row(anchor, cfg, work: Path) -> dict | None:
    shape = anchor_shape(cfg) if anchor is not None else None
    if shape is None:
        return None
    tag = f"{cfg.model.name}/te/{cfg.recipe.name}"
    anchor.OUT = str(work)
    try:
        anchor.run_model(tag, "te", cfg.recipe.name, shape)
    except ValueError as exc:  # the anchor's make_recipe knows no such recipe
        return {"skipped": f"anchor_gpt has no recipe {exc}"}
    return anchor.RES.get(tag)


def harness_row(cfg, run_dir: Path) -> dict:
    from harness.train import run

    s = run(cfg, run_dir)
    flops = json.loads((run_dir / "run.json").read_text())["provenance"]["flops_per_token"]
    return {"summary": dict(vars(s)), "tflops": (s.tokens_per_s or 0) * flops / 1e12}


def cleanup() -> None:
    gc.collect()  # optimizer hooks hold reference cycles: drop the last run's model before the next
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(label: str, overrides: list[str], opts: Options, anchor, work: Path) -> dict:
    entry: dict = {"overrides": overrides}
    try:
        cfg = specs.load_config(overrides)
        if opts.anchor_first:
            entry["anchor"] = anchor_row(anchor, cfg, work)
            cleanup()
        entry.update(harness_row(cfg, work / "runs" / label))
        cleanup()
        if opts.bare:
            entry["bare_ms"] = bare_loop(specs.load_config(overrides))
            cleanup()
        if opts.profile:
            profile_steps(specs.load_config(overrides), work / f"profile_{label}.txt")
            entry["profile"] = str(work / f"profile_{label}.txt")
            cleanup()
        if not opts.anchor_first:
            entry["anchor"] = anchor_row(anchor, cfg, work)
            cleanup()
    except Exception:  # noqa: BLE001 - one failing run must not lose the others
        entry["error"] = traceback.format_exc()[-1500:]
        print(f"[throughput] {label} failed:\n{entry['error']}", file=sys.stderr, flush=True)
        cleanup()
    return entry


def _fmt(v, spec: str) -> str:
    return format(v, spec) if v is not None else "-"


def table(results: dict) -> str:
    """The runs as a text table; ratios against the first BF16 run that measured."""
    ok = {k: r for k, r in results.items() if (r.get("summary") or {}).get("step_time_ms") is not None}
    base = next((r for r in ok.values() if r["summary"]["recipe"] == "bf16"), None)
    base_ms = base["summary"]["step_time_ms"] if base else None
    head = ("run", "step ms", "tok/s", "TFLOP/s", "MFU bf16", "MFU recipe", "peak GiB", "vs BF16")
    head += ("anchor ms", "vs anchor", "bare ms", "overhead")
    rows = [head]
    for label, r in results.items():
        if label not in ok:
            rows.append((label, "error") + ("",) * (len(head) - 2))
            continue
        s = r["summary"]
        ms, a, bare = s["step_time_ms"], (r.get("anchor") or {}).get("step_ms"), r.get("bare_ms")
        speed = (_fmt(ms, ".1f"), _fmt(s["tokens_per_s"], ",.0f"), _fmt(r.get("tflops"), ".0f"))
        mfu = (
            _fmt(s["mfu_bf16_peak"], ".3f"),
            _fmt(s["mfu_recipe_peak"], ".3f"),
            _fmt(s["peak_mem_gib"], ".1f"),
        )
        vs = (_fmt(base_ms / ms if base_ms else None, ".2f") + "x", _fmt(a, ".1f"))
        vs += (_fmt(a / ms if a else None, ".3f") + "x", _fmt(bare, ".1f"))
        vs += (_fmt((ms / bare - 1) * 100 if bare else None, "+.1f") + "%",)
        rows.append((label, *speed, *mfu, *vs))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)


def preflight(spec: specs.Spec, opts: Options) -> None:
    """The anchor script must be there before any run starts (it is not part of the repository)."""
    if opts.anchor and not Path(opts.anchor).is_file():
        fix = "give the path of anchor_gpt.py (DEVELOPERS.md: the GPU node's .gpu/) or --anchor ''"
        raise specs.SpecError(f"spec {spec.name}: option anchor={opts.anchor}: no such file; {fix}")


def load_anchor(path: str):
    """anchor_gpt.py as a module (it is a standalone script, not part of lowp)."""
    mod_spec = importlib.util.spec_from_file_location("anchor_gpt", path)
    anchor = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(anchor)
    return anchor


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    preflight(spec, opts)
    anchor = load_anchor(opts.anchor) if opts.anchor else None
    result: dict = {"_meta": specs.meta(spec, opts), "runs": {}}
    for label, overrides in plan(spec, opts).items():
        print(f"[throughput] {label}: {' '.join(overrides)}", flush=True)
        result["runs"][label] = measure(label, overrides, opts, anchor, work)
        specs.write_json(out, result)
    print(table(result["runs"]))
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
