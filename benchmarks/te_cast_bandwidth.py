"""Benchmark: how close TE's current-scaling FP8 casts run to the GPU's memory bandwidth.

    python -m benchmarks.te_cast_bandwidth [--out DIR] [--repeats 20]

For the 8B slice's activation, gradient and weight shapes, one bf16 tensor at a time is cast the
way tensorwise casts every GEMM operand: TE's Float8CurrentScalingQuantizer with rowwise and
columnwise (transposed) copies, in place (`update_quantized`), E4M3 and E5M2. One torch.profiler
pass over `--repeats` calls gives each kernel's time per call. The bandwidth reference is a device
copy of the same tensor (2 B read + 2 B written per element). Bytes per element: amax reads 2;
cast+transpose reads 2 and writes 1 + 1. Writes `te_cast_bandwidth.json` under `--out`. Needs CUDA
and Transformer Engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "tokens x hidden": (8192, 4096),
    "tokens x 3 hidden (QKV)": (8192, 12288),
    "tokens x ffn": (8192, 16384),
    "fc1 weight": (16384, 4096),
    "QKV weight": (12288, 4096),
}
BYTES_PER_ELEMENT = {"copy": 4, "amax": 2, "cast_transpose": 4}
NO_GPU = "te_cast_bandwidth: needs a CUDA GPU (TE's casts run there only); run it on one"
NO_TE = "te_cast_bandwidth: needs Transformer Engine: pip install transformer-engine[pytorch]"


def _kind(kernel: str) -> str | None:
    """Which of the measured passes a kernel is (None: the scale and amax-reset kernels)."""
    if "cast_transpose" in kernel:
        return "cast_transpose"
    if "amax_kernel<" in kernel:
        return "amax"
    if "copy" in kernel.lower() or "memcpy" in kernel.lower():  # copy_ of a contiguous tensor: Memcpy DtoD
        return "copy"
    return None


def _per_call_ms(fn, repeats: int) -> dict[str, float]:
    """GPU ms per call of each kernel `fn` launches (profiled over `repeats` calls, after warm-up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "self_device_time_total", None)  # self_cuda_time_total before torch 2.4
            us = event.self_cuda_time_total if us is None else us
            kernels[event.key] = kernels.get(event.key, 0.0) + us / 1e3 / repeats
    return kernels


def _cases(x, tex, quantizer_class) -> dict:
    """The device copy of `x`, and its in-place current-scaling cast to E4M3 and to E5M2."""
    copy = x.new_empty(x.shape)
    cases = {"copy": lambda: copy.copy_(x)}
    for fmt, dtype in (("e4m3", tex.DType.kFloat8E4M3), ("e5m2", tex.DType.kFloat8E5M2)):
        quantizer = quantizer_class(dtype, "cuda", rowwise=True, columnwise=True)
        fp8 = quantizer(x)  # the FP8 tensor (both copies) the timed calls overwrite
        cases[f"quantize_{fmt}"] = lambda q=quantizer, y=fp8: q.update_quantized(x, y)
    return cases


def measure(repeats: int) -> dict:
    import torch
    import transformer_engine
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    out = {
        "how": __doc__.split("\n\n")[2].replace("\n", " "),
        "torch": torch.__version__,
        "transformer_engine": transformer_engine.__version__,
        "device": torch.cuda.get_device_name(),
        "repeats": repeats,
        "shapes": {},
    }
    for name, shape in SHAPES.items():
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        row = {"elements": x.numel()}
        for case, fn in _cases(x, tex, Float8CurrentScalingQuantizer).items():
            kernels = _per_call_ms(fn, repeats)
            passes = {}
            for kernel, ms in kernels.items():
                kind = _kind(kernel)
                if kind is not None:
                    tbps = x.numel() * BYTES_PER_ELEMENT[kind] / (ms * 1e-3) / 1e12
                    passes[kind] = {"ms": ms, "TB_per_s": tbps}
            row[case] = {"ms": sum(kernels.values()), "passes": passes, "kernels_ms": kernels}
        out["shapes"][name] = row
        copy_ms = row["copy"]["ms"]
        q = row["quantize_e4m3"]
        print(
            f"[te_cast_bandwidth] {name} {tuple(shape)}: copy {copy_ms * 1e3:.1f} us; E4M3 cast "
            f"{q['ms'] * 1e3:.1f} us ({q['ms'] / copy_ms:.2f}x the copy): "
            + ", ".join(f"{k} {v['TB_per_s']:.2f} TB/s" for k, v in q["passes"].items()),
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.te_cast_bandwidth", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", default=None, help="folder for te_cast_bandwidth.json (default: a temporary one)")
    p.add_argument("--repeats", type=int, default=20, help="profiled calls per case (default 20)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        print(NO_TE, file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="lowp-cast-bw-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "te_cast_bandwidth.json").write_text(json.dumps(measure(args.repeats), indent=1))
    print(f"wrote {out / 'te_cast_bandwidth.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
