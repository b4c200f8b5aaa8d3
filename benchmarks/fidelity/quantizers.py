"""Bit-for-bit fidelity of the emulated quantizers against Transformer Engine on a GPU.

    python -m benchmarks.fidelity.quantizers --spec fidelity_quantizers [--seed 0]

For delayed (a given scale), tensorwise (E4M3/E5M2, power-of-two scales, amax epsilon) and blockwise
(1x128 / 128x128, power-of-two or fp32 scales) it quantizes fresh random bf16 CUDA tensors of several
shapes and the four input kinds with TE's quantizers and with lowp's emulator on the same tensors,
and compares codes and scale_inv of both copies bit for bit (128x128 scales in their valid region
only: TE leaves the padding uninitialised). It also compares lowp on CUDA with lowp on the CPU
(device independence), which runs without TE too. One case failing never stops the others.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import specs
from harness.numerics import quantize
from tests.numerics.references.inputs import KINDS, make_input
from tests.numerics.references.te_quantize import te_quantize

SHAPES = ((256, 512), (128, 128), (300, 200), (1000, 384), (2, 192, 256), (17, 1000))


@dataclass(frozen=True)
class Options:
    seed: int = field(default=0, metadata={"help": "generator seed of the inputs and delayed scales"})


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    return {}  # quantizers only: no model config


def cases() -> list[tuple]:
    """(name, TE quantizer kind, its kwargs, lowp recipe, lowp quantize kwargs)."""
    out = [
        ("delayed_e4m3", "delayed", {"fp8": "e4m3"}, "delayed", {"role": "input"}),
        ("delayed_e5m2", "delayed", {"fp8": "e5m2"}, "delayed", {"role": "grad"}),
        ("current_e4m3", "current", {"fp8": "e4m3"}, "tensorwise", {"role": "input"}),
        ("current_e5m2", "current", {"fp8": "e5m2"}, "tensorwise", {"role": "grad"}),
        ("current_e4m3_pow2", "current", {"fp8": "e4m3", "pow2": True}, "tensorwise",
         {"role": "input", "power_2_scales": True}),
        ("current_e4m3_eps", "current", {"fp8": "e4m3", "eps": 1e-3}, "tensorwise",
         {"role": "input", "amax_epsilon": 1e-3}),
    ]  # fmt: skip
    for dim in (1, 2):
        for pow2 in (True, False):
            tag = f"block{dim}d_e4m3" + ("" if pow2 else "_fp32scale")
            kw = {"role": "input" if dim == 1 else "weight", "power_2_scales": pow2}
            out.append((tag, "block", {"fp8": "e4m3", "dim": dim, "pow2": pow2}, "blockwise", kw))
    e5m2 = {"fp8": "e5m2", "dim": 1, "pow2": True}
    out.append(("block1d_e5m2", "block", e5m2, "blockwise", {"role": "grad", "fp8": "hybrid"}))
    return out


def lowp_quantize(recipe: str, kw: dict, x: torch.Tensor, scale: torch.Tensor | None) -> dict:
    extra = {"scale": scale} if scale is not None else {}
    row = quantize(x, recipe, **kw, **extra)
    col = quantize(x, recipe, columnwise=True, **kw, **extra)
    return {"data_row": row.data, "data_col": col.data, "sinv_row": row.scale_inv, "sinv_col": col.scale_inv}


def valid_region(d: dict, kind: str, te_kw: dict, shape) -> dict:
    """Block scale tensors cut to their valid region (TE leaves its padding uninitialised)."""
    if kind != "block":
        return d
    m, k = math.prod(shape[:-1]), shape[-1]
    mb, kb = math.ceil(m / 128), math.ceil(k / 128)
    row, col = (
        ((mb, kb), (kb, mb)) if te_kw["dim"] == 2 else ((kb, m), (mb, k))
    )  # 1x128: (K/128, M), (M/128, K)
    out = dict(d)
    for key, (a, b) in (("sinv_row", row), ("sinv_col", col)):
        out[key] = d[key][:a, :b] if d[key] is not None else None
    return out


def mismatches(a: dict, b: dict) -> dict:
    """Differing elements per field (compared as bits); a string where they cannot be compared."""
    out = {}
    for key in a:
        x, y = a[key], b[key]
        if x is None or y is None:
            out[key] = "missing"
            continue
        x, y = x.detach().cpu().contiguous(), y.detach().cpu().contiguous()
        if x.numel() != y.numel() or x.dtype.itemsize != y.dtype.itemsize:
            out[key] = f"shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
            continue
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.dtype.itemsize]
        out[key] = int((x.view(bits).reshape(-1) != y.view(bits).reshape(-1)).sum())
        if x.shape != y.shape:
            out[key + "_shape"] = f"{tuple(x.shape)} vs {tuple(y.shape)}"
    return out


def run_case(kind, te_kw, recipe, kw, x, scale, have_te) -> dict:
    shape = tuple(x.shape)
    lowp_cuda = valid_region(lowp_quantize(recipe, kw, x, scale), kind, te_kw, shape)
    cpu_scale = None if scale is None else scale.cpu()
    lowp_cpu = valid_region(lowp_quantize(recipe, kw, x.cpu(), cpu_scale), kind, te_kw, shape)
    result = {"lowp_cuda_vs_cpu": mismatches(lowp_cuda, lowp_cpu)}
    if have_te:
        te_out = valid_region(te_quantize(kind, te_kw, x, scale), kind, te_kw, shape)
        result["lowp_vs_te"] = mismatches(lowp_cuda, te_out)
    return result


def cast_saturation() -> dict:
    """Whether this torch's own fp32 -> FP8 casts saturate, per device (lowp clamps where not)."""
    from harness.numerics.formats import E4M3, E5M2, _cast_saturates, torch_cast

    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return {
        f"{d}/{f}": _cast_saturates(torch_cast, torch.float32, f, d) for d in devices for f in (E4M3, E5M2)
    }


def delayed_scale(x: torch.Tensor, te_kw: dict, gen: torch.Generator) -> torch.Tensor:
    """An arbitrary fp32 scale, as an amax history would give: fp8max / amax times 0.5 to 1.5."""
    fmax = 448.0 if te_kw["fp8"] == "e4m3" else 57344.0
    amax = x.float().abs().max().clamp_min(1e-30)
    return (torch.tensor(fmax, device=x.device) / amax * (0.5 + torch.rand(1, generator=gen).item())).reshape(
        1
    )


def te_import_error() -> str | None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # reported; lowp's device independence is still checked
        return repr(e)
    return None


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("fidelity.quantizers needs a CUDA device (lowp on CUDA vs TE and vs the CPU)")
    te_error = te_import_error()
    gen = torch.Generator().manual_seed(opts.seed)
    result = {"_meta": specs.meta(spec, opts), "te_available": te_error is None, "te_error": te_error}
    result |= {"torch_fp8_cast_saturates": cast_saturation(), "cases": {}}
    total_bad = 0
    for name, kind, te_kw, recipe, kw in cases():
        for shape in SHAPES:
            for inp in KINDS:
                key = f"{name}/{'x'.join(map(str, shape))}/{inp}"
                try:
                    x = make_input(inp, shape, gen).cuda()
                    scale = delayed_scale(x, te_kw, gen) if kind == "delayed" else None
                    res = run_case(kind, te_kw, recipe, kw, x, scale, te_error is None)
                except Exception as e:
                    res = {"error": repr(e), "trace": traceback.format_exc(limit=3)}
                result["cases"][key] = res
                fields = [v for r in res.values() if isinstance(r, dict) for v in r.values()]
                bad = sum(1 for v in fields if not isinstance(v, int) or v) + ("error" in res)
                total_bad += bad
                print(f"{key:<44} {'OK' if not bad else 'MISMATCH ' + json.dumps(res)}")
    result["total_mismatching_fields"] = total_bad
    specs.write_json(out, result)
    print(f"{len(result['cases'])} cases, {total_bad} mismatching fields; TE available: {te_error is None}")
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
