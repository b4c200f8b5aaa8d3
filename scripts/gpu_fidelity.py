"""Bit-for-bit fidelity of the emulated quantizers against Transformer Engine on a GPU.

    OUT=/some/dir python scripts/gpu_fidelity.py [--seed 0]

For delayed (a given scale), tensorwise (E4M3/E5M2, power-of-two scales, amax epsilon) and
blockwise (1x128 / 128x128, power-of-two or fp32 scales) it quantizes fresh random bf16 CUDA
tensors of several shapes with TE's quantizers (Float8Quantizer, Float8CurrentScalingQuantizer,
Float8BlockQuantizer) and with lowp's emulator on the same CUDA tensors, and compares codes and
scale_inv of both copies bit for bit (128x128 scales in their valid region only: TE leaves the
padding uninitialised). It also compares lowp on CUDA with lowp on the CPU (device independence),
which runs without TE too. One case failing never stops the others. Writes
$OUT/gpu_fidelity.json (OUT defaults to ".") and prints mismatch counts per case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import traceback
from pathlib import Path

import torch

from harness.numerics import quantize

SHAPES = [(256, 512), (128, 128), (300, 200), (1000, 384), (2, 192, 256), (17, 1000)]
INPUTS = ("normal", "outliers", "tiny", "decades")


def make_input(kind: str, shape, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """The golden README's four input kinds (normal, outliers, tiny, decades) at any shape."""
    x = torch.randn(shape, generator=gen)
    k = shape[-1]
    if kind == "outliers":
        x[..., ::97] *= 300.0
        x.view(-1, k)[min(7, x.numel() // k - 1)] = 0.0
    elif kind == "tiny":
        x = x * 1e-6
    elif kind == "decades":
        x = x * torch.logspace(-8, 3, k)
    return x.to(dtype)


def cases():
    """(name, te_kind, te_kwargs, lowp_recipe, lowp_kwargs)."""
    out = [
        ("delayed_e4m3", "delayed", {"fp8": "e4m3"}, "delayed", {"role": "input"}),
        ("delayed_e5m2", "delayed", {"fp8": "e5m2"}, "delayed", {"role": "grad"}),
        ("current_e4m3", "current", {"fp8": "e4m3"}, "tensorwise", {"role": "input"}),
        ("current_e5m2", "current", {"fp8": "e5m2"}, "tensorwise", {"role": "grad"}),
        (
            "current_e4m3_pow2",
            "current",
            {"fp8": "e4m3", "pow2": True},
            "tensorwise",
            {"role": "input", "power_2_scales": True},
        ),
        (
            "current_e4m3_eps",
            "current",
            {"fp8": "e4m3", "eps": 1e-3},
            "tensorwise",
            {"role": "input", "amax_epsilon": 1e-3},
        ),
    ]
    for dim in (1, 2):
        for pow2 in (True, False):
            tag = f"block{dim}d_e4m3" + ("" if pow2 else "_fp32scale")
            role = "input" if dim == 1 else "weight"
            out.append(
                (
                    tag,
                    "block",
                    {"fp8": "e4m3", "dim": dim, "pow2": pow2},
                    "blockwise",
                    {"role": role, "power_2_scales": pow2},
                )
            )
    out.append(
        (
            "block1d_e5m2",
            "block",
            {"fp8": "e5m2", "dim": 1, "pow2": True},
            "blockwise",
            {"role": "grad", "fp8": "hybrid"},
        )
    )
    return out


def te_quantize(kind: str, kw: dict, x: torch.Tensor, scale: torch.Tensor | None):
    """TE's two copies as {data_row, data_col, sinv_row, sinv_col} (uint8 / fp32 tensors)."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex

    dtype = tex.DType.kFloat8E4M3 if kw["fp8"] == "e4m3" else tex.DType.kFloat8E5M2
    if kind == "delayed":
        q = te.Float8Quantizer(
            scale.clone(), torch.zeros(1, device=x.device), dtype, rowwise=True, columnwise=True
        )
    elif kind == "current":
        q = te.Float8CurrentScalingQuantizer(
            dtype,
            x.device,
            rowwise=True,
            columnwise=True,
            force_pow_2_scales=kw.get("pow2", False),
            amax_epsilon=kw.get("eps", 0.0),
        )
    else:
        q = te.Float8BlockQuantizer(
            dtype,
            rowwise=True,
            columnwise=True,
            amax_epsilon=0.0,
            force_pow_2_scales=kw["pow2"],
            block_scaling_dim=kw["dim"],
        )
    t = q(x)
    if kind in ("delayed", "current"):
        col = t._transpose if getattr(t, "_transpose", None) is not None else None
        return {"data_row": t._data, "data_col": col, "sinv_row": t._scale_inv, "sinv_col": t._scale_inv}
    return {
        "data_row": t._rowwise_data,
        "data_col": t._columnwise_data,
        "sinv_row": t._rowwise_scale_inv,
        "sinv_col": t._columnwise_scale_inv,
    }


def lowp_quantize(recipe: str, kw: dict, x: torch.Tensor, scale: torch.Tensor | None):
    extra = {"scale": scale} if recipe == "delayed" else {}
    row = quantize(x, recipe, **kw, **extra)
    col = quantize(x, recipe, columnwise=True, **kw, **extra)
    return {"data_row": row.data, "data_col": col.data, "sinv_row": row.scale_inv, "sinv_col": col.scale_inv}


def valid_region(d: dict, kind: str, te_kw: dict, shape) -> dict:
    """Block scale tensors cut to their valid region (TE leaves its padding uninitialised)."""
    if kind != "block":
        return d
    m, k = math.prod(shape[:-1]), shape[-1]
    mb, kb = math.ceil(m / 128), math.ceil(k / 128)
    if te_kw["dim"] == 2:
        row, col = (mb, kb), (kb, mb)
    else:  # 1x128: rowwise (K/128, M), columnwise (M/128, K)
        row, col = (kb, m), (mb, k)
    out = dict(d)
    out["sinv_row"] = d["sinv_row"][: row[0], : row[1]] if d["sinv_row"] is not None else None
    out["sinv_col"] = d["sinv_col"][: col[0], : col[1]] if d["sinv_col"] is not None else None
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


def run_case(kind, te_kw, recipe, kw, x, scale, have_te):
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

    return {
        f"{d}/{f}": _cast_saturates(torch_cast, torch.float32, f, d)
        for d in ("cpu", "cuda")
        for f in (E4M3, E5M2)
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_fidelity: no CUDA device")
    try:
        import transformer_engine.pytorch  # noqa: F401

        have_te, te_error = True, None
    except Exception as e:  # report, then still check lowp's device independence
        have_te, te_error = False, repr(e)
    gen = torch.Generator().manual_seed(args.seed)
    summary = {
        "te_available": have_te,
        "te_error": te_error,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "torch_fp8_cast_saturates": cast_saturation(),
        "cases": {},
    }
    total_bad = 0
    for name, kind, te_kw, recipe, kw in cases():
        for shape in SHAPES:
            for inp in INPUTS:
                key = f"{name}/{'x'.join(map(str, shape))}/{inp}"
                try:
                    x = make_input(inp, shape, gen).cuda()
                    scale = None
                    if kind == "delayed":  # an arbitrary fp32 scale, as the amax history would give
                        fmax = 448.0 if te_kw["fp8"] == "e4m3" else 57344.0
                        amax = x.float().abs().max().clamp_min(1e-30)
                        scale = (
                            torch.tensor(fmax, device=x.device)
                            / amax
                            * (0.5 + torch.rand(1, generator=gen).item())
                        )
                        scale = scale.reshape(1).float()
                    res = run_case(kind, te_kw, recipe, kw, x, scale, have_te)
                except Exception as e:
                    res = {"error": repr(e), "trace": traceback.format_exc(limit=3)}
                summary["cases"][key] = res
                fields = [v for r in res.values() if isinstance(r, dict) for k, v in r.items()]
                bad = sum(1 for v in fields if not isinstance(v, int) or v) + ("error" in res)
                total_bad += bad
                print(f"{key:<44} {'OK' if not bad else 'MISMATCH ' + json.dumps(res)}")
    summary["total_mismatching_fields"] = total_bad
    (out_dir / "gpu_fidelity.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(summary['cases'])} cases, {total_bad} mismatching fields; TE available: {have_te}")


if __name__ == "__main__":
    main()
