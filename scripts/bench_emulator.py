"""CPU cost of the emulated recipes: median step time (fwd + bwd + AdamW) against BF16, one process.

    .venv/bin/python scripts/bench_emulator.py [--model gpt_small] [--steps 8] [--recipes ...]

Steps of the recipes are interleaved round-robin, so load from other processes on the machine
falls on every arm alike; warm-up steps are excluded and the median is reported. Targets
(issue 3): <= 2.0x BF16 for the FP8 recipes, <= 3.0x for NVFP4 with RHT and stochastic rounding.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from harness.backends import build_backend
from harness.config.store import compose
from harness.loss import loss_fn
from harness.train import backend_spec

TARGETS = {"delayed": 2.0, "tensorwise": 2.0, "blockwise": 2.0, "mxfp8": 2.0, "nvfp4": 3.0}


def make_arm(recipe: str, model: str, batch: int, seq: int, device: torch.device):
    cfg = OmegaConf.to_object(
        compose(
            [
                f"model={model}",
                f"recipe={recipe}",
                "backend=emulated",
                "logger=none",
                f"micro_batch_size={batch}",
            ]
        )
    )
    backend = build_backend(backend_spec(cfg), device)
    torch.manual_seed(0)
    net = backend.build_model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    tokens = tokens.to(device)

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        with backend.autocast():
            loss = loss_fn(net(tokens[:, :-1]), tokens[:, 1:].contiguous())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt_small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="measured steps per recipe")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--recipes", nargs="*", default=["bf16", *TARGETS])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    recipes = ["bf16"] + [r for r in args.recipes if r != "bf16"]
    arms = {r: make_arm(r, args.model, args.batch, args.seq, device) for r in recipes}
    wall: dict[str, list[float]] = {r: [] for r in recipes}
    cpu: dict[str, list[float]] = {r: [] for r in recipes}
    for i in range(args.warmup + args.steps):
        for r, step in arms.items():
            dt, ct = step()
            if i >= args.warmup:
                wall[r].append(dt)
                cpu[r].append(ct)
    base, cbase = statistics.median(wall["bf16"]), statistics.median(cpu["bf16"])
    print(
        f"{args.model}, micro-batch {args.batch}, seq {args.seq}, {device}, {torch.get_num_threads()} threads"
    )
    print("median of steady-state steps; cpu = this process's CPU time (robust to other load)")
    print(f"{'recipe':<12}{'wall s/step':>12}{'ratio':>8}{'cpu s/step':>12}{'ratio':>8}{'target':>8}  ok")
    for r in recipes:
        med, cmed = statistics.median(wall[r]), statistics.median(cpu[r])
        target = TARGETS.get(r)
        ok = "" if target is None else ("yes" if med / base <= target else "NO")
        tgt = "" if target is None else f"{target:.1f}x"
        print(f"{r:<12}{med:>12.3f}{med / base:>7.2f}x{cmed:>12.3f}{cmed / cbase:>7.2f}x{tgt:>8}  {ok}")


if __name__ == "__main__":
    main()
