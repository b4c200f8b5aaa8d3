"""Capture: which operands TE's backward GEMMs receive under `backward_override`, bit for bit.

    python -m benchmarks.te_backward_override --out DIR [--seed 0]

On a GPU with Transformer Engine (lowp pins 2.20.2), te.Linear and te.LayerNormLinear (bf16
parameters, with bias) run one forward and backward on small fixed seeded bf16 tensors with a few
outliers, under Float8CurrentScaling (tensorwise) and Float8BlockScaling (blockwise) with
backward_override None, high_precision and dequantized. TE's module-level `general_gemm`, which the
forward and both backward GEMMs call, is wrapped for the run: for every call it records the layout
(TN fprop, NN dgrad, NT wgrad), the output's dtype and shape, and per operand either its quantized
storage (class, codes as uint8, scale inverses as float32, and for the backward GEMMs `.dequantize()`,
in bf16 where exact, else float32) or its plain values.

Writes `te_backward_override_tensorwise.pt` and `te_backward_override_blockwise.pt` (CPU tensors:
inputs x, w, b, dy (and the norm's weight and bias), TE's y, dx, dw, db and the GEMM calls, per
module and override) and `te_backward_override.json` (versions, recipes' repr, shapes, what each
backward GEMM received, the files' sizes, and every case that failed with its error) under `--out`.
A case that fails is recorded and the next one runs. tests/numerics/test_backward_override.py reads
the .pt files from tests/assets/te_backward_override/.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

M, K, N = 128, 128, 64  # tokens, in_features, out_features (the shapes of the stored capture)
RECIPES = ("tensorwise", "blockwise")
OVERRIDES = (None, "high_precision", "dequantized")
MODULES = ("linear", "layernorm_linear")
CODE_ATTRS = ("_data", "_transpose", "_rowwise_data", "_columnwise_data")
SCALE_ATTRS = ("_scale_inv", "_rowwise_scale_inv", "_columnwise_scale_inv")
NO_GPU = "te_backward_override: needs a CUDA GPU and Transformer Engine; run it on one"


def inputs(seed: int) -> dict:
    """Seeded bf16 x (M, K), w (N, K), b (N,), dy (M, N), norm weight/bias (K,): a few outliers each."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def draw(shape, std, outliers, factor):
        t = torch.randn(shape, generator=g) * std
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:outliers]
        flat[idx] *= factor
        return t.to(torch.bfloat16)

    return {
        "x": draw((M, K), 1.0, 6, 40.0),
        "w": draw((N, K), 0.05, 3, 20.0),
        "b": draw((N,), 0.1, 0, 1.0),
        "dy": draw((M, N), 1e-3, 4, 50.0),
        "ln_weight": (1.0 + draw((K,), 0.1, 0, 1.0).float()).to(torch.bfloat16),
        "ln_bias": draw((K,), 0.05, 0, 1.0),
    }


def make_recipe(name: str, override):
    """TE's recipe object as lowp's tensorwise (HYBRID: E5M2 grads) and blockwise (E4M3) presets build it."""
    from transformer_engine.common import recipe as R

    if name == "tensorwise":
        return R.Float8CurrentScaling(fp8_format=R.Format.HYBRID, backward_override=override)
    return R.Float8BlockScaling(fp8_format=R.Format.E4M3, backward_override=override)


def snapshot(t, dequantized: bool = True) -> dict:
    """One GEMM operand as CPU tensors: quantized storage (codes, scales, and with `dequantized` its
    `.dequantize()`) or plain values."""
    import torch
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor, QuantizedTensorStorage

    if t is None:
        return {"kind": "none"}
    if isinstance(t, (QuantizedTensorStorage, QuantizedTensor)):
        rec = {"kind": "quantized", "class": type(t).__name__}
        for attr in CODE_ATTRS + SCALE_ATTRS:
            v = getattr(t, attr, None)
            if isinstance(v, torch.Tensor):
                v = v.detach()
                if attr in CODE_ATTRS:
                    v = v.view(torch.uint8) if v.element_size() == 1 else v
                else:
                    v = v.float()
                rec[attr] = v.cpu().clone()
        for attr in ("_fp8_dtype", "_is_2D_scaled"):
            if hasattr(t, attr):
                rec[attr] = str(getattr(t, attr))
        try:
            if dequantized:
                rec["dequantized"] = _compact(t.dequantize().detach().float().cpu())
        except Exception as e:  # a storage holding only one usage may refuse; keep the codes
            rec["dequantize_error"] = f"{type(e).__name__}: {e}"
        return rec
    if isinstance(t, torch.Tensor):
        return {"kind": "plain", "dtype": str(t.dtype), "values": t.detach().cpu().clone()}
    return {"kind": type(t).__name__}


def _compact(values):
    """bf16 where that is exact (most dequantized copies), else float32: keeps the files small."""
    import torch

    as_bf16 = values.to(torch.bfloat16)
    return as_bf16.clone() if torch.equal(as_bf16.float(), values) else values.clone()


class GemmRecorder:
    """Wraps `general_gemm` in TE's linear modules; each call appends {layout, A, B, out, ...}."""

    def __init__(self):
        self.calls: list[dict] = []
        self._saved: list[tuple] = []
        self._seen: dict[int, tuple] = {}  # id -> (object, its copies, snapshot): an operand used twice

    def __enter__(self):
        import importlib

        for modname in ("linear", "layernorm_linear"):
            mod = importlib.import_module(f"transformer_engine.pytorch.module.{modname}")
            original = mod.general_gemm
            self._saved.append((mod, original))
            mod.general_gemm = self._wrap(original, modname)
        return self

    def __exit__(self, *exc):
        for mod, original in self._saved:
            mod.general_gemm = original
        self._saved.clear()

    def _snapshot(self, t, dequantized: bool) -> dict:
        """snapshot(t), shared with an earlier call on the same object holding the same copies."""
        present = tuple(a for a in CODE_ATTRS if getattr(t, a, None) is not None)
        seen = self._seen.get(id(t))
        if seen is not None and seen[0] is t and seen[1] == present:
            return seen[2]
        snap = snapshot(t, dequantized)
        self._seen[id(t)] = (t, present, snap)
        return snap

    def _wrap(self, original, modname):
        def general_gemm(A, B, *args, **kwargs):
            rec = {
                "module": modname,
                "layout": kwargs.get("layout", "TN"),
                "grad": bool(kwargs.get("grad", False)),
                "has_bias": kwargs.get("bias") is not None,
                "accumulate": bool(kwargs.get("accumulate", False)),
                "out_dtype": str(kwargs.get("out_dtype")),
                "quantization_params": type(kwargs.get("quantization_params")).__name__,
                "use_split_accumulator": bool(kwargs.get("use_split_accumulator", False)),
                "positional_args": len(args),
            }
            try:
                deq = rec["layout"] != "TN"  # the backward GEMMs' operands (keeps the files small)
                rec["A"], rec["B"] = self._snapshot(A, deq), self._snapshot(B, deq)
            except Exception as e:
                rec["snapshot_error"] = f"{type(e).__name__}: {e}"
            result = original(A, B, *args, **kwargs)
            try:  # the values are the module's y, dx, dW, db (saved once, in the case)
                out = result[0] if isinstance(result, (tuple, list)) else result
                rec["out"] = {"dtype": str(out.dtype), "shape": list(out.shape)}
                rec["bias_grad_fused"] = isinstance(result, (tuple, list)) and result[1] is not None
            except Exception as e:
                rec["out_error"] = f"{type(e).__name__}: {e}"
            self.calls.append(rec)
            return result

        return general_gemm


def run_case(module: str, recipe_name: str, override, data: dict) -> dict:
    """One forward and backward of `module` under the recipe; TE's outputs and every GEMM call."""
    import torch
    import transformer_engine.pytorch as te

    dev = "cuda"
    recipe = make_recipe(recipe_name, override)
    if module == "linear":
        layer = te.Linear(K, N, bias=True, params_dtype=torch.bfloat16, device=dev)
        params = {"weight": data["w"], "bias": data["b"]}
    else:
        layer = te.LayerNormLinear(
            K, N, bias=True, params_dtype=torch.bfloat16, device=dev, normalization="LayerNorm", eps=1e-5
        )
        params = {
            "weight": data["w"],
            "bias": data["b"],
            "layer_norm_weight": data["ln_weight"],
            "layer_norm_bias": data["ln_bias"],
        }
    with torch.no_grad():
        for pname, value in params.items():
            getattr(layer, pname).copy_(value.to(dev))
    x = data["x"].to(dev).requires_grad_(True)
    with GemmRecorder() as rec:
        with te.autocast(enabled=True, recipe=recipe):
            y = layer(x)
        y.backward(data["dy"].to(dev))
    torch.cuda.synchronize()
    out = {
        "recipe_repr": repr(recipe),
        "y": y.detach().cpu().clone(),
        "dx": x.grad.detach().cpu().clone(),
        "gemms": rec.calls,
    }
    for pname in params:
        grad = getattr(layer, pname).grad
        out[f"d_{pname}"] = grad.detach().cpu().clone() if grad is not None else None
    return out


def _summary(case: dict) -> dict:
    """What each GEMM received, in words, for the JSON."""
    rows = []
    for call in case["gemms"]:
        row = {"layout": call["layout"], "has_bias": call["has_bias"]}
        for side in ("A", "B"):
            op = call.get(side, {})
            if op.get("kind") == "quantized":
                row[side] = op["class"] + " [" + ", ".join(a for a in CODE_ATTRS if a in op) + "]"
            elif op.get("kind") == "plain":
                row[side] = f"plain {op['dtype']} {tuple(op['values'].shape)}"
            else:
                row[side] = op.get("kind", "?")
        rows.append(row)
    return {"recipe_repr": case["recipe_repr"], "gemms": rows}


def capture(out: Path, seed: int) -> dict:
    """Every (recipe, module, override) case; one .pt per recipe and the JSON summary."""
    import torch
    import transformer_engine

    out.mkdir(parents=True, exist_ok=True)
    data = inputs(seed)
    summary = {
        "torch": torch.__version__,
        "transformer_engine": transformer_engine.__version__,
        "device": torch.cuda.get_device_name(),
        "shapes": {"M": M, "K": K, "N": N},
        "seed": seed,
        "files": {},
        "cases": {},
        "failed": {},
    }
    for recipe_name in RECIPES:
        blob = {"inputs": data, "seed": seed, "te_version": transformer_engine.__version__, "cases": {}}
        for module in MODULES:
            for override in OVERRIDES:
                key = f"{module}/{override or 'none'}"
                try:
                    case = run_case(module, recipe_name, override, data)
                    blob["cases"][key] = case
                    summary["cases"][f"{recipe_name}/{key}"] = _summary(case)
                    print(
                        f"[te_backward_override] {recipe_name} {key}: {len(case['gemms'])} GEMMs", flush=True
                    )
                except Exception as e:
                    summary["failed"][f"{recipe_name}/{key}"] = {
                        "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-3000:],
                    }
                    print(
                        f"[te_backward_override] {recipe_name} {key}: FAILED {type(e).__name__}: {e}",
                        flush=True,
                    )
        path = out / f"te_backward_override_{recipe_name}.pt"
        try:
            torch.save(blob, path)
            summary["files"][path.name] = path.stat().st_size
        except Exception as e:
            summary["failed"][f"{recipe_name}/save"] = {"error": f"{type(e).__name__}: {e}"}
        (out / "te_backward_override.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.te_backward_override", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, help="folder for the .pt files and te_backward_override.json")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    args = p.parse_args(argv)
    try:
        import torch
        import transformer_engine  # noqa: F401
    except ImportError:
        print(NO_GPU, file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 1
    summary = capture(Path(args.out), args.seed)
    total = sum(summary["files"].values())
    print(
        f"[te_backward_override] {len(summary['cases'])} cases, {len(summary['failed'])} failed; "
        f"{total / 1e6:.2f} MB in {sorted(summary['files'])} under {args.out}",
        flush=True,
    )
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
