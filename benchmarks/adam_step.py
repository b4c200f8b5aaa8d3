"""Benchmark: the optimizer step of Megatron's default setup on TE, TE's kernel against lowp's one pass.

    python -m benchmarks.adam_step [--out DIR] [--experiment h200_mixtral_8x7b_slice] [--steps 6]
    python -m benchmarks.adam_step --probe [--out DIR]

The parameters of an experiment's model as lowp's TE backend builds it (bf16), fp32 main grads,
TE FusedAdam with fp32 masters kept as int16 remainders and fp32 moments (optimizer=adamw_fp32),
gradient clipping at 1.0. Each side runs `--steps` steps from the same parameters and grads, as
the trainer runs them (harness.optim.clip_grad, then the step):

- `te`: TE's FusedAdam; clip_grad multiplies every main grad by the coefficient first;
- `one_pass`: harness.optim's FusedAdamOnePass; the coefficient goes to the step.

It records each side's median ms for the clip (norm + scaling) and for the step, the memory moved
per second (grad, parameter, remainder and both moments read, all but the grad written), and
whether the two sides' parameters and remainders end with the same bits (compared on the host).
Writes `adam_step.json` under `--out`. Needs CUDA and Transformer Engine.

`--probe` measures which arithmetic TE's kernel runs instead: 4.2M elements at gradient magnitudes 3 to
1e-21, 3 steps (the second clipped) of TE's FusedAdam and of the one-pass kernel with each variant of
`adam_kernel.arithmetic()` (division, square root, flushing denormals or not), from the same parameters;
it writes `adam_arithmetic.json` with the elements whose bits differ per state tensor and variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

BYTES_PER_PARAM = 4 + 2 * (2 + 2 + 4 + 4)  # grad read; parameter, remainder, both moments read and written


def preset_shapes(experiment: str) -> list[tuple[int, ...]]:
    """Every parameter's shape in the experiment's TE model, as lowp's TE backend builds it."""
    from harness.backends import build_backend
    from harness.training.trainer import backend_spec
    from harness.validation import load

    model = build_backend(
        backend_spec(load([f"experiment={experiment}"])), torch.device("cuda")
    ).build_model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    del model
    torch.cuda.empty_cache()
    return shapes


def run_side(kind: str, shapes, steps: int, seed: int = 0) -> dict:
    from transformer_engine.pytorch.optimizers import FusedAdam

    from harness.optim import fused_adam_one_pass
    from harness.optim.main_grads import MainGrads
    from harness.optim.optimizer import Optimizer, clip_grad

    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [
        torch.nn.Parameter((torch.randn(s, device="cuda", generator=gen) * 0.02).bfloat16()) for s in shapes
    ]
    cls = FusedAdam if kind == "te" else fused_adam_one_pass()
    decay = [p for p in params if p.dim() >= 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in params if p.dim() < 2]}]
    inner = cls(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, adam_w_mode=True,
                master_weights=True, master_weight_dtype=torch.float32, use_decoupled_grad=True,
                store_param_remainders=True)  # fmt: skip
    opt = Optimizer(inner, params, MainGrads(params))
    clip_ms, step_ms = [], []
    for step in range(steps):
        g = torch.Generator(device="cuda").manual_seed(1000 + step)
        for p in params:
            p.main_grad.normal_(generator=g)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        clip_grad(opt, 1.0)
        ev[1].record()
        opt.step()
        ev[2].record()
        torch.cuda.synchronize()
        clip_ms.append(ev[0].elapsed_time(ev[1]))
        step_ms.append(ev[1].elapsed_time(ev[2]))
    kernel = inner.kernel() if hasattr(inner, "kernel") else "TE FusedAdam"
    bits = [(p.data.view(torch.int16).cpu(), inner.state[p]["master_param"].cpu()) for p in params]
    del opt, inner, params
    torch.cuda.empty_cache()
    timed = slice(1, None)  # the first step initializes the states
    return {
        "kernel": kernel,
        "clip_ms": statistics.median(clip_ms[timed]),
        "step_ms": statistics.median(step_ms[timed]),
        "step_ms_all": step_ms,
        "clip_ms_all": clip_ms,
        "_bits": bits,
    }


def probe() -> dict:
    """Per variant of the kernel's PTX arithmetic, how many elements end with other bits than TE's."""
    import itertools

    from transformer_engine.pytorch.optimizers import FusedAdam

    from harness.optim import adam_kernel, fused_adam_one_pass

    torch.manual_seed(0)
    n = 1 << 22
    mags = torch.tensor([1.0, 1e-2, 1e-4, 1e-8, 1e-21, 3.0], device="cuda")
    idx = torch.randint(0, len(mags), (n,), device="cuda")
    init = (torch.randn(n, device="cuda") * 0.02).bfloat16()
    grads = [torch.randn(n, device="cuda") * mags[idx] for _ in range(3)]
    coefs = [None, 0.37, None]
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    kw |= dict(master_weights=True, master_weight_dtype=torch.float32, use_decoupled_grad=True)
    kw |= dict(store_param_remainders=True)

    def train(cls, hand_over: bool, asm: str | None = None) -> list[torch.Tensor]:
        p = torch.nn.Parameter(init.clone())
        opt = cls([p], **kw)
        if asm is not None:
            opt.asm = asm
        for g, c in zip(grads, coefs):
            p.decoupled_grad = g.clone()
            if c is not None:
                scale = torch.tensor(c, device="cuda")
                if hand_over:
                    opt.grad_scale = scale
                else:
                    torch._foreach_mul_([p.decoupled_grad], scale)
            opt.step()
        st = opt.state[p]
        m, v = st["exp_avg"].view(torch.int32), st["exp_avg_sq"].view(torch.int32)
        return [p.data.view(torch.int16), st["master_param"], m, v]

    def key(div: str, sqrt: str, ftz: bool) -> str:
        return f"div={div},sqrt={sqrt},ftz={ftz}"

    ref = train(FusedAdam, False)
    names = ["param", "remainder", "exp_avg", "exp_avg_sq"]
    variants = {}
    for div, sqrt, ftz in itertools.product(["approx", "full", "rn"], ["approx", "rn"], [True, False]):
        got = train(fused_adam_one_pass(), True, adam_kernel.arithmetic(div=div, sqrt=sqrt, ftz=ftz))
        differ = {name: int((a != b).sum()) for name, a, b in zip(names, ref, got)}
        variants[key(div, sqrt, ftz)] = differ
        print(f"[adam_step] {key(div, sqrt, ftz)}: {differ}", flush=True)
    return {
        "elements": n,
        "variants": variants,
        "te_arithmetic": key(**adam_kernel.TE_ARITHMETIC),
        "exact": [k for k, v in variants.items() if not any(v.values())],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.adam_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--experiment", default="h200_mixtral_8x7b_slice", help="a conf/experiment preset")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--probe", action="store_true", help="which PTX arithmetic gives TE's bits (see above)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("adam_step: needs a CUDA GPU (TE FusedAdam runs there only); run it on one", file=sys.stderr)
        return 2
    import transformer_engine

    env = {"torch": torch.__version__, "te": transformer_engine.__version__}
    env["gpu"] = torch.cuda.get_device_name()
    if args.probe:
        result = {**probe(), **env}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "adam_arithmetic.json").write_text(json.dumps(result, indent=1))
        print("[adam_step] TE's bits:", result["exact"], "; the kernel runs", result["te_arithmetic"])
        return 0 if result["te_arithmetic"] in result["exact"] else 1
    shapes = preset_shapes(args.experiment)
    n = sum(torch.Size(s).numel() for s in shapes)
    result = {
        "experiment": args.experiment,
        "parameters": n,
        "tensors": len(shapes),
        **env,
        "bytes_per_parameter": BYTES_PER_PARAM,
    }
    sides = {}
    for kind in ("te", "one_pass"):
        print(f"[adam_step] {kind}: {n / 1e9:.2f}B parameters in {len(shapes)} tensors", flush=True)
        sides[kind] = run_side(kind, shapes, args.steps)
    a, b = sides["te"].pop("_bits"), sides["one_pass"].pop("_bits")
    result["bits_differ"] = {
        "params": sum(int((x[0] != y[0]).sum()) for x, y in zip(a, b)),
        "remainders": sum(int((x[1] != y[1]).sum()) for x, y in zip(a, b)),
    }
    for side in sides.values():
        side["step_tb_per_s"] = n * BYTES_PER_PARAM / (side["step_ms"] / 1e3) / 1e12
    result["sides"] = sides
    te, one = sides["te"], sides["one_pass"]
    result["speedup_step"] = te["step_ms"] / one["step_ms"]
    result["speedup_clip_and_step"] = (te["clip_ms"] + te["step_ms"]) / (one["clip_ms"] + one["step_ms"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adam_step.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "sides"}, indent=1))
    for kind, side in sides.items():
        ms = f"clip {side['clip_ms']:7.2f} ms  step {side['step_ms']:7.2f} ms"
        print(f"{kind:9s} {side['kernel']:30s} {ms}  {side['step_tb_per_s']:.2f} TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
