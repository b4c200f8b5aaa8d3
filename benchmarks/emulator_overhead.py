"""CPU cost of the emulated recipes: median step time (fwd + bwd + AdamW) against BF16, in one process.

    python -m benchmarks.emulator_overhead --spec emulator_overhead [--steps 8] [--threads 2]

Steps of the recipes are interleaved round-robin, so load from other processes on the machine falls
on every arm alike; warm-up steps are left out and the median is reported, of wall time and of this
process's CPU time (robust to other load). A spec's `targets` (recipe -> the largest ratio to BF16
it may take) mark each row ok or not.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import specs


@dataclass(frozen=True)
class Options:
    model: str = field(default="gpt_small", metadata={"help": "conf/model preset"})
    batch: int = field(default=8, metadata={"help": "micro-batch size"})
    steps: int = field(default=8, metadata={"help": "measured steps per recipe"})
    warmup: int = field(default=2, metadata={"help": "steps per recipe left out"})
    recipes: tuple[str, ...] = field(
        default=("bf16", "tensorwise"), metadata={"help": "BF16 is always first"}
    )
    device: str = field(default="cpu", metadata={"help": "torch device"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    targets: dict = field(
        default_factory=dict, metadata={"help": "recipe -> largest ratio to BF16 (spec only)"}
    )


def recipes(opts: Options) -> list[str]:
    return ["bf16", *(r for r in opts.recipes if r != "bf16")]


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    base = [f"model={opts.model}", "backend=emulated", "logger=none", f"micro_batch_size={opts.batch}"]
    return {r: [*base, f"recipe={r}", *spec.overrides] for r in recipes(opts)}


def make_arm(cfg, device: torch.device):
    """One recipe's step function: a fresh model from seed 0, AdamW, a fixed batch."""
    from harness.backends import build_backend
    from harness.model.loss import loss_fn
    from harness.train import backend_spec

    backend = build_backend(backend_spec(cfg), device)
    torch.manual_seed(0)
    net = backend.build_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    shape = (cfg.micro_batch_size, cfg.model.seq_length + 1)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=torch.Generator().manual_seed(0)).to(
        device
    )

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        with backend.autocast():
            loss = loss_fn(net(tokens[:, :-1]), tokens[:, 1:].contiguous())
        loss.backward()
        opt.step()
        backend.after_optimizer_step(net)
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0

    return step


def measure(arms: dict, steps: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    times = {r: {"wall": [], "cpu": []} for r in arms}
    for i in range(warmup + steps):
        for r, step in arms.items():  # round-robin: outside load falls on every arm alike
            wall, cpu = step()
            if i >= warmup:
                times[r]["wall"].append(wall)
                times[r]["cpu"].append(cpu)
    return times


def rows(times: dict, targets: dict) -> dict[str, dict]:
    base = {k: statistics.median(v) for k, v in times["bf16"].items()}
    out = {}
    for r, t in times.items():
        med = {k: statistics.median(v) for k, v in t.items()}
        ratio = med["wall"] / base["wall"]
        target = targets.get(r)
        out[r] = {
            "wall_s": med["wall"],
            "wall_ratio": ratio,
            "cpu_s": med["cpu"],
            "cpu_ratio": med["cpu"] / base["cpu"],
            "target": target,
            "ok": None if target is None else ratio <= target,
        }
    return out


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    arms = {r: make_arm(specs.load_config(ov), device) for r, ov in plan(spec, opts).items()}
    result = {
        "_meta": {**specs.meta(spec, opts), "threads": torch.get_num_threads()},
        "rows": rows(measure(arms, opts.steps, opts.warmup), dict(opts.targets)),
        "loadavg_1min_after": os.getloadavg()[0],  # other load on the machine skews wall time most
    }
    specs.write_json(out, result)
    print(f"{opts.model}, micro-batch {opts.batch}, {device}, {torch.get_num_threads()} threads: medians")
    print(f"{'recipe':<12}{'wall s/step':>12}{'ratio':>8}{'cpu s/step':>12}{'ratio':>8}{'target':>8}  ok")
    for r, x in result["rows"].items():
        tgt = "" if x["target"] is None else f"{x['target']:.1f}x"
        ok = "" if x["ok"] is None else ("yes" if x["ok"] else "NO")
        wall, cpu = (
            f"{x['wall_s']:>12.3f}{x['wall_ratio']:>7.2f}x",
            f"{x['cpu_s']:>12.3f}{x['cpu_ratio']:>7.2f}x",
        )
        print(f"{r:<12}{wall}{cpu}{tgt:>8}  {ok}")
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
