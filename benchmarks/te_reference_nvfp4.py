"""Golden vectors for NVFP4 row scaling and 4over6 from TE's own pure-PyTorch reference.

    python -m benchmarks.te_reference_nvfp4 --out DIR [--te-python SITE]

Quantizes a fixed, seeded set of bf16 inputs on the CPU with
`transformer_engine.pytorch.custom_recipes.reference_nvfp4.NVFP4QuantizerRef` (TE 2.20.2) in every
mode TE's reference accepts: row scaling on/off x 4over6 off, or on with the E4M3 bound 448/256 and
the MAE/MSE error, x 1x16 / 16x16 tiles (row scaling: 1x16 only), plus the input role's RHT
columnwise copy with and without row scaling. Both copies of each. Writes DIR/nvfp4_reference.pt
(the inputs; per case TE's packed codes, E4M3 block scales as bytes and global amaxes per tensor or
line, both copies; for the 32x64 inputs also the dequantized values) and DIR/nvfp4_reference.json
(a summary: versions, modes, per case the shapes and SHA-256 of every tensor). lowp's
tests/numerics/test_nvfp4_options.py reads the .pt from tests/assets/nvfp4_reference/.

TE's reference has no dequantize; the values stored are TE's dequantize kernel's formula
(common/cast/nvfp4/dequantize_nvfp4.cuh: code x fl32(fl32(sf x amax) x fl32(1 / (6 x bound))), the
line's amax for a row-scaled copy) on TE's own codes, decoded with the reference's cast_from_fp4x2.

By default this imports the installed TE (needs its compiled extension, e.g. on the GPU box).
`--te-python SITE` instead loads reference_nvfp4.py, gemm.py and reference_utils.py from an unpacked
wheel (SITE holds `transformer_engine/`), supplying only what they import from the compiled side:
the base classes `QuantizedTensorStorage` and `Quantizer` as plain classes, and `is_custom`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

NAME = "nvfp4_reference"
SHAPES = ((32, 64), (64, 128), (128, 48))
KINDS = ("normal", "mixed", "tiny")
DEQ_SHAPE = (32, 64)  # the inputs whose dequantized values are stored (keeps the file small)


def inputs() -> dict[str, torch.Tensor]:
    """Seeded bf16 inputs: per shape, plain normals; a mix of outlier elements and columns, all-zero
    rows and 16-blocks, rows of very different ranges and a near-underflow row; and tiny values."""
    g = torch.Generator().manual_seed(2202)
    out = {}
    for m, k in SHAPES:
        base = torch.randn(m, k, generator=g)
        mixed = base * torch.logspace(-4, 3, m)[:, None]  # each row its own range
        mixed[:, 5] *= 40.0
        mixed[m // 2, 7] = 3.0e4
        mixed[1] = 0.0  # an all-zero row
        mixed[2, :16] = 0.0  # an all-zero block
        mixed[3] = base[3] * 1e-30  # a row near the bottom of the range
        mixed[4, 16:32] = torch.tensor([6.0, 4.0, 2.0, 1.0] * 4)  # values on the E2M1 grid
        tiny = base * 1e-12
        for kind, x in (("normal", base), ("mixed", mixed), ("tiny", tiny)):
            out[f"{kind}_{m}x{k}"] = x.bfloat16()
    return out


def modes() -> list[dict]:
    """Every combination TE's reference takes (row scaling needs 1x16; RHT, the input role's
    columnwise transform, is never combined with 4over6: TE's recipe refuses it)."""
    out = []
    for row_scaled in (False, True):
        for tile in ((1, 16), (16, 16)):
            if row_scaled and tile == (16, 16):
                continue
            base = dict(row_scaled=row_scaled, tile=list(tile), four_over_six=False, rht=False)
            out.append({**base, "e4m3_max": 448, "err_mode": "MAE"})
            for e4m3_max in (448, 256):
                for err_mode in ("MAE", "MSE"):
                    out.append({**base, "four_over_six": True, "e4m3_max": e4m3_max, "err_mode": err_mode})
        rht = dict(row_scaled=row_scaled, tile=[1, 16], four_over_six=False, rht=True)
        out.append({**rht, "e4m3_max": 448, "err_mode": "MAE"})
    return out


def mode_id(mode: dict) -> str:
    parts = ["rowscaled" if mode["row_scaled"] else "tensor", "x".join(map(str, mode["tile"]))]
    if mode["four_over_six"]:
        parts.append(f"4over6-{mode['err_mode']}-{mode['e4m3_max']}")
    if mode["rht"]:
        parts.append("rht")
    return "_".join(parts)


def load_reference(te_python: str | None):
    """TE's reference_nvfp4 module: the installed TE's, or the unpacked wheel's under `te_python`."""
    if te_python is None:
        from transformer_engine.pytorch.custom_recipes import reference_nvfp4

        return reference_nvfp4
    root = Path(te_python) / "transformer_engine"
    pkgs = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.custom_recipes")
    for name in (*pkgs, "transformer_engine.pytorch.tensor"):
        mod = types.ModuleType(name)
        mod.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = mod
    sys.modules["transformer_engine.pytorch.quantized_tensor"] = _base_classes()
    utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
    utils.is_custom = lambda x=None: bool(getattr(x, "custom", False)) and not isinstance(x, torch.Tensor)
    sys.modules[utils.__name__] = utils
    for leaf in ("reference_utils", "gemm", "reference_nvfp4"):
        name = f"transformer_engine.pytorch.custom_recipes.{leaf}"
        spec = importlib.util.spec_from_file_location(name, root / "pytorch/custom_recipes" / f"{leaf}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["transformer_engine.pytorch.custom_recipes.reference_nvfp4"]


def _base_classes() -> types.ModuleType:
    """transformer_engine.pytorch.quantized_tensor's two base classes, as plain classes."""
    mod = types.ModuleType("transformer_engine.pytorch.quantized_tensor")

    class QuantizedTensorStorage:
        pass

    class Quantizer:
        def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
            self.rowwise_usage, self.columnwise_usage = rowwise, columnwise
            self.internal, self.optimize_for_gemm = False, False

    mod.QuantizedTensorStorage, mod.Quantizer = QuantizedTensorStorage, Quantizer
    return mod


def quantize(ref, x: torch.Tensor, mode: dict) -> dict[str, torch.Tensor]:
    """Both copies of x under `mode` with TE's NVFP4QuantizerRef."""
    qz = ref.NVFP4QuantizerRef(
        dtype=ref.reference_utils.Fp4Formats.E2M1,
        rowwise=True,
        columnwise=True,
        quant_tile_shape=tuple(mode["tile"]),
        row_scaled_nvfp4=mode["row_scaled"],
        nvfp4_use_4over6=mode["four_over_six"],
        nvfp4_e4m3_max=mode["e4m3_max"],
        nvfp4_4over6_err_mode=mode["err_mode"],
        with_rht=mode["rht"],
    )
    t = qz.quantize(x)
    out = {
        "qx": t.data.view(torch.uint8),
        "sx": t.scale.view(torch.uint8),
        "amax_row": t.global_amax_row.reshape(-1).float(),
        "qx_t": t.data_t.view(torch.uint8),
        "sx_t": t.scale_t.view(torch.uint8),
        "amax_col": t.global_amax_col.reshape(-1).float(),
    }
    if tuple(x.shape) == DEQ_SHAPE:
        bound = float(t.nvfp4_e4m3_max) if mode["four_over_six"] else 448.0
        out["deq"] = dequantize(ref, t.data, t.scale, t.global_amax_row, bound)
        out["deq_t"] = dequantize(ref, t.data_t, t.scale_t, t.global_amax_col, bound)
    return out


def dequantize(ref, data, scale, amax, bound: float) -> torch.Tensor:
    """TE's dequantize formula (dequantize_nvfp4.cuh:66-69) on the reference's codes: fp32."""
    vals = ref.cast_from_fp4x2(data.view(torch.uint8), torch.float32)  # (rows, cols)
    sf = scale.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)[:, : vals.shape[1]]
    line = amax.reshape(-1, 1).float() if amax.numel() > 1 else amax.reshape(1, 1).float()
    factor = torch.tensor(1.0 / (6.0 * bound), dtype=torch.float32)
    return vals * ((sf * line) * factor)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def te_version(te_python: str | None) -> str:
    if te_python is None:
        import transformer_engine

        return getattr(transformer_engine, "__version__", "unknown")
    meta = sorted(Path(te_python).glob("transformer_engine-*.dist-info"))
    return meta[0].name.split("-")[1].removesuffix(".dist") if meta else "unknown"


def build(te_python: str | None) -> tuple[dict, dict]:
    ref = load_reference(te_python)
    xs = inputs()
    cases, summary = {}, []
    for mode in modes():
        for name, x in xs.items():
            key = f"{mode_id(mode)}/{name}"
            out = quantize(ref, x, mode)
            cases[key] = {"input": name, "mode": mode, **out}
            summary.append({"case": key, **{k: [list(v.shape), sha(v)] for k, v in out.items()}})
    source = "installed TE" if te_python is None else f"unpacked wheel at {te_python} (base classes stubbed)"
    meta = {
        "te_version": te_version(te_python),
        "torch": str(torch.__version__),
        "source": source,
        "reference": "transformer_engine/pytorch/custom_recipes/reference_nvfp4.py NVFP4QuantizerRef, CPU",
        "cases": len(cases),
    }
    return {"meta": meta, "inputs": xs, "cases": cases}, {"meta": meta, "modes": modes(), "cases": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.te_reference_nvfp4", description=__doc__)
    ap.add_argument("--out", required=True, help="directory for nvfp4_reference.pt and .json")
    ap.add_argument("--te-python", default=None, help="site dir of an unpacked TE wheel (dev aid)")
    args = ap.parse_args(argv)
    golden, summary = build(args.te_python)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(golden, out / f"{NAME}.pt")
    (out / f"{NAME}.json").write_text(json.dumps(summary, indent=1) + "\n")
    size = (out / f"{NAME}.pt").stat().st_size
    te = summary["meta"]["te_version"]
    print(f"{len(golden['cases'])} cases from TE {te} -> {out}/{NAME}.pt ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
