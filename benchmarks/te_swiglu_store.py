"""FP8 storage of the SwiGLU input through TE's own op, `te.ops.SwiGLU(cache_quantized_input=True)`.

    python -m benchmarks te_swiglu_store --out $OUT        # the spec: the 1.4B SwiGLU MLP, one H200

MegaDLMs (and Megatron) keep the MLP activation's input for backward in FP8 with
`activation_func_fp8_input_store` (megatron/core/fusions/fused_bias_swiglu.py: `input.to(
torch.float8_e4m3fn)`, an unscaled cast: torch saturates values beyond 448 to 448, magnitudes up to
2^-10 flush to zero).
TE's op instead quantizes it with a per-tensor current-scaled E4M3 quantizer (ops/basic/activation.py:
Float8CurrentScalingQuantizer(E4M3), amax -> scale each call): the same storage, other numbers.

lowp's TE blocks are te.TransformerLayer, whose MLP is a fused LayerNormMLP that does not take a
te.ops activation, so this benchmark builds the 1.4B shape's SwiGLU MLP on its own as TE's fusible ops
(te.ops.Sequential: LayerNorm, Linear h -> 2f, SwiGLU, Linear f -> h; bf16 parameters) and, per recipe
(bf16, tensorwise, delayed, blockwise, lowp's presets through harness.backends.te_recipe), runs it with
and without `cache_quantized_input`: forward+backward time (CUDA events, median of the timed calls),
the bytes the forward leaves allocated for backward, peak memory, and the input gradient's and fc1
weight gradient's error against the uncached run (same weights, input and output gradient). Beside
that, in plain PyTorch on the uncached BF16 run's real SwiGLU input: SwiGLU's backward from the input
stored in BF16 vs stored by TE's current-scaled E4M3 cast vs by Megatron's unscaled cast (relative
error of d(input), share of stored values that saturate or flush to zero). Needs CUDA and TE.
"""

from __future__ import annotations

import statistics
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import specs

E4M3_MAX = 448.0
NO_GPU = "te_swiglu_store: needs a CUDA GPU and Transformer Engine; run it on one"


@dataclass(frozen=True)
class Options:
    tokens: int = field(default=16384, metadata={"help": "rows of the MLP input (micro-batch x sequence)"})
    hidden: int = field(default=2048, metadata={"help": "model width h"})
    ffn: int = field(default=5632, metadata={"help": "SwiGLU width f (fc1 makes 2f)"})
    warmup: int = field(default=3, metadata={"help": "calls before timing"})
    timed: int = field(default=10, metadata={"help": "timed forward+backward calls (median)"})
    recipes: tuple[str, ...] = field(
        default=("bf16", "tensorwise", "delayed", "blockwise"), metadata={"help": "lowp recipe presets"}
    )


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    return {}  # trains nothing


def _mlp(opts: Options, cache: bool, seed: int = 0):
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(seed)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    return te.ops.Sequential(
        te.ops.LayerNorm(opts.hidden, **kw),
        te.ops.Linear(opts.hidden, 2 * opts.ffn, bias=False, **kw),
        te.ops.SwiGLU(cache_quantized_input=cache),
        te.ops.Linear(opts.ffn, opts.hidden, bias=False, **kw),
    )


def _recipe(name: str):
    from harness.backends.te_recipe import build_te_recipe
    from harness.config.schema import StabilityConfig
    from harness.config.store import load_preset

    return build_te_recipe(load_preset("recipe", name), StabilityConfig())


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def measure(opts: Options, name: str, cache: bool, x, dy) -> dict:
    """Time, memory and gradients of one (recipe, cache) pair."""
    import torch
    import transformer_engine.pytorch as te

    recipe = _recipe(name)
    mlp = _mlp(opts, cache)

    def step():
        xi = x.detach().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = mlp(xi)
        y.backward(dy)
        return xi.grad

    for _ in range(opts.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(opts.timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    for p in mlp.parameters():
        p.grad = None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    xi = x.detach().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = mlp(xi)
    saved = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    y.backward(dy)
    fc1 = next(p for n, p in mlp.named_parameters() if p.dim() == 2)
    return {
        "step_ms": statistics.median(times),
        "saved_for_backward_mib": saved / 2**20,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "dx": xi.grad.detach().clone(),
        "dw_fc1": fc1.grad.detach().clone(),
    }


def swiglu_backward(a, dy):
    """d(input) of SwiGLU(a) = silu(a1) * a2 (TE's order: the gate is the first half), in fp32."""
    import torch

    a = a.float().detach().requires_grad_()
    g, v = a.chunk(2, dim=-1)
    y = torch.nn.functional.silu(g) * v
    (da,) = torch.autograd.grad(y, a, dy.float())
    return da


def storage_numerics(a, dy) -> dict:
    """SwiGLU's d(input) from the input stored in BF16, by TE's current-scaled E4M3, by Megatron's cast."""
    import torch

    ref = swiglu_backward(a, dy)
    amax = a.float().abs().max()
    scale = E4M3_MAX / amax
    te_codes = (a.float() * scale).to(torch.float8_e4m3fn)
    te_store = te_codes.float() / scale
    mg_store = a.to(torch.float8_e4m3fn).float()  # Megatron: input.to(torch.float8_e4m3fn)
    nonzero = a != 0
    out = {"input_amax": float(amax)}
    scaled = {
        "te_current_scaled_e4m3": (te_store, a.float() * scale),
        "megatron_unscaled_e4m3": (mg_store, a),
    }
    for label, (stored, cast_input) in scaled.items():
        out[label] = {
            "d_input_rel_error": _rel(swiglu_backward(stored.to(a.dtype), dy), ref),
            "input_rel_error": _rel(stored, a),
            "flushed_to_zero": float(((stored == 0) & nonzero).sum() / nonzero.sum().clamp_min(1)),
            "saturated": float((cast_input.float().abs() > E4M3_MAX).float().mean()),
        }
    return out


def swiglu_input(opts: Options, x):
    """The uncached BF16 MLP's real SwiGLU input (fc1's output) and a matching output gradient."""
    import torch

    mlp = _mlp(opts, False)
    with torch.no_grad():
        a = mlp[1](mlp[0](x))
    return a, torch.randn(a.shape[0], opts.ffn, device="cuda", dtype=torch.bfloat16)


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(NO_GPU)
    result: dict = {"_meta": specs.meta(spec, opts), "runs": {}, "errors": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(opts.tokens, opts.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(opts.tokens, opts.hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
    for name in opts.recipes:
        base = None
        for cache in (False, True):
            label = f"{name}_{'cached_fp8' if cache else 'bf16_input'}"
            try:
                m = measure(opts, name, cache, x, dy)
                dx, dw = m.pop("dx"), m.pop("dw_fc1")
                if base is None:
                    base = (dx, dw)
                else:
                    m["dx_rel_error_vs_uncached"] = _rel(dx, base[0])
                    m["dw_fc1_rel_error_vs_uncached"] = _rel(dw, base[1])
                result["runs"][label] = m
            except Exception as exc:  # noqa: BLE001  (the next pair still runs)
                result["errors"][label] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                traceback.print_exc()
            specs.write_json(out, result)
    try:
        a, da = swiglu_input(opts, x)
        result["storage_numerics"] = storage_numerics(a, da)
    except Exception as exc:  # noqa: BLE001
        result["errors"]["storage_numerics"] = str(exc)
    specs.write_json(out, result)
    for label, m in result["runs"].items():
        print(f"{label:28s} {m['step_ms']:8.2f} ms  saved {m['saved_for_backward_mib']:8.1f} MiB", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
