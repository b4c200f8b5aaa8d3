"""The expert MLP alone, forward and backward, through every grouped-GEMM path lowp can use (CUDA).

    python -m benchmarks moe_experts                      # the spec: every shape, routing and path
    python -m benchmarks.moe_experts --spec moe_experts --shapes qwen3_30b_a3b --paths te,torch_bf16

One SwiGLU expert MLP (fc1: hidden -> 2 x expert FFN, SwiGLU, fc2: expert FFN -> hidden; no bias) on
`tokens x top-k` routed rows, already permuted (rows grouped by expert, as after Megatron's
permutation), timed from the permuted input to its gradient and the weight gradients:

- `te` / `te_grouped_tensor`: TE's `GroupedLinear` (Megatron's TEGroupedMLP) under `te.autocast` with
  the recipe, on its default split-quantize path / its grouped-tensor path (`use_grouped_tensor=True`,
  only where TE's `is_module_grouped_tensor_path_supported` allows it on this device's cuBLASLt); both
  leave each expert's wgrad in BF16 in `.grad` (TE's default);
- `te_main_grad`: the `te` path with `fuse_wgrad_accumulation=True` and an fp32 `main_grad` per expert
  weight, as lowp's TE backend (and Megatron with gradient-accumulation fusion) runs it: each wgrad
  GEMM adds into the fp32 main grad (beta = 1), the read-modify-write `lowp_grouped` also pays;
- `torch_bf16`: `torch._grouped_mm` (BF16) for both GEMMs, autograd's backward (its wgrad leaves
  the GEMM in BF16);
- `lowp_grouped`: lowp's `backend.moe_experts=grouped` (harness.backends.grouped_gemm):
  `torch._grouped_mm` fprop and dgrad, the Triton wgrad summed in fp32 into an fp32 main grad, as
  TE's GroupedLinear does with fuse_wgrad_accumulation;
- `torch_fp8`: `torch._scaled_grouped_mm` for the six GEMMs (fprop, dgrad, wgrad of both), E4M3 codes
  with one current-scaling scale per expert and tensor (TE's tensorwise recipe with fp8=e4m3, each
  expert quantized on its own as TE's split-quantize does), fast accumulation in fprop only; the casts
  are eager torch (per-expert amax by scatter_reduce, one cast per copy);
- `gemm_bf16` / `gemm_fp8`: the six GEMMs alone, their operands made before timing (no casts, no
  SwiGLU, no autograd): `torch._grouped_mm` on BF16, `torch._scaled_grouped_mm` on E4M3 codes with
  torch_fp8's layouts and scales. The fastest grouped kernel here at the shape, so the bound of any
  path built on it; each row also gives its fraction of the device's dense peak for its dtype
  (`peak_fraction`, from conf/hardware when the device is one lowp knows).

Routings: `balanced` (every expert the same rows), `zipf` (expert i gets a share ~ 1/(i+1)), `empty`
(an eighth of the experts get no rows, the rest equal). Rows per expert are multiples of 16 (the FP8
GEMMs' alignment, Megatron's moe_router_padding_for_quantization); the per-expert counts are recorded.
Each case: 3 warm-up iterations, then CUDA-event time over `repeats`; TFLOP/s counts the six GEMMs
(18 x rows x hidden x FFN); peak memory is the allocator's peak during the timed iterations above what
was allocated before the case (weights, inputs and their gradients included). Writes one JSON.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import specs

# name -> (experts, hidden, expert FFN, top-k, tokens)
SHAPES = {
    "qwen3_30b_a3b": (128, 2048, 768, 8, 16384),
    "e64_h4096_f1536": (64, 4096, 1536, 8, 16384),
    "mixtral_like": (8, 4096, 14336, 2, 16384),
    "deepseek_like": (256, 7168, 2048, 8, 4096),
    # one layer's experts in the H200 slices: one micro-batch of 4096 tokens (conf/experiment/h200_*)
    "qwen3_30b_a3b_slice": (128, 2048, 768, 8, 4096),
    "mixtral_8x7b_slice": (8, 4096, 14336, 2, 4096),
}
RECIPES = ("bf16", "tensorwise", "delayed", "blockwise")
PATHS = (
    "te",
    "te_main_grad",
    "te_grouped_tensor",
    "torch_bf16",
    "lowp_grouped",
    "torch_fp8",
    "gemm_bf16",
    "gemm_fp8",
)
ROUTINGS = ("balanced", "zipf", "empty")
ALIGN = 16
E4M3_MAX = 448.0


@dataclass(frozen=True)
class Options:
    shapes: tuple[str, ...] = field(default=tuple(SHAPES), metadata={"help": "shape names, comma-separated"})
    paths: tuple[str, ...] = field(default=PATHS, metadata={"help": "paths, comma-separated"})
    routings: tuple[str, ...] = field(default=ROUTINGS, metadata={"help": "routings, comma-separated"})
    repeats: int = field(default=10, metadata={"help": "timed iterations per case"})


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    for what, given, known in (("shapes", opts.shapes, SHAPES), ("paths", opts.paths, PATHS)):
        bad = [g for g in given if g not in known]
        if bad:
            raise specs.SpecError(f"spec {spec.name}: unknown {what} {bad}; use some of {list(known)}")
    return {}


def counts_for(routing: str, experts: int, rows: int) -> list[int]:
    """Rows per expert, each a multiple of ALIGN, summing to `rows` (rounded down to ALIGN)."""
    units = rows // ALIGN
    if routing == "balanced":
        weights = [1.0] * experts
    elif routing == "zipf":
        weights = [1.0 / (i + 1) for i in range(experts)]
    elif routing == "empty":
        weights = [0.0 if i % 8 == 7 else 1.0 for i in range(experts)]
    else:
        raise ValueError(f"routing {routing!r}: use one of {ROUTINGS}")
    total = sum(weights)
    exact = [units * w / total for w in weights]
    got = [int(e) for e in exact]
    for i in sorted(range(experts), key=lambda i: exact[i] - got[i], reverse=True)[: units - sum(got)]:
        got[i] += 1
    return [g * ALIGN for g in got]


def _te_recipe(name: str):
    from transformer_engine.common import recipe as R

    return {
        "bf16": None,
        "tensorwise": R.Float8CurrentScaling(fp8_format=R.Format.HYBRID),
        "delayed": R.DelayedScaling(
            fp8_format=R.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"
        ),
        "blockwise": R.Float8BlockScaling(fp8_format=R.Format.E4M3),
    }[name]


def _swiglu(h):
    import torch

    a, b = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


def te_case(shape, counts, recipe: str, grouped_tensor: bool, main_grad: bool = False):
    """A closure running one forward+backward of TE's GroupedLinear expert MLP, or a reason it can't;
    with `main_grad`, each wgrad is accumulated into an fp32 main grad (fuse_wgrad_accumulation)."""
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.module import grouped_linear

    E, H, F, _, _ = shape
    rec = _te_recipe(recipe)
    if grouped_tensor and not grouped_linear.is_module_grouped_tensor_path_supported(rec, torch.bfloat16):
        return None, "unavailable: TE's is_module_grouped_tensor_path_supported is False on this cuBLASLt"
    kw = dict(bias=False, params_dtype=torch.bfloat16, device="cuda")
    if grouped_tensor:
        kw["use_grouped_tensor"] = True
    if main_grad:
        kw["fuse_wgrad_accumulation"] = True
    fc1, fc2 = te.GroupedLinear(E, H, 2 * F, **kw), te.GroupedLinear(E, F, H, **kw)
    if main_grad:
        for w in (p for m in (fc1, fc2) for n, p in m.named_parameters() if n.startswith("weight")):
            w.main_grad = torch.zeros(w.shape, device="cuda", dtype=torch.float32)
    rows = sum(counts)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(counts, device="cuda") if grouped_tensor else list(counts)

    def step():
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = fc2(_swiglu(fc1(x, splits)), splits)
        y.backward(dy)

    return step, None


def torch_bf16_case(shape, counts):
    import torch

    E, H, F, _, _ = shape
    w1 = (torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    rows = sum(counts)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)

    def step():
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(_swiglu(h), w2.transpose(-2, -1), offs=offs)
        y.backward(dy)

    return step, None


def lowp_grouped_case(shape, counts):
    import torch

    from harness.backends.grouped_gemm import GroupedLinear

    E, H, F, _, _ = shape
    w1 = (torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    w1.main_grad = torch.zeros(w1.shape, device="cuda")
    w2.main_grad = torch.zeros(w2.shape, device="cuda")
    rows = sum(counts)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)

    def step():
        y = GroupedLinear.apply(_swiglu(GroupedLinear.apply(x, w1, ends)), w2, ends)
        y.backward(dy)

    return step, None


def _per_expert_cast(x, group, experts: int):
    """E4M3 codes of x (rows grouped by expert) with one current-scaling scale per expert (TE's rule:
    scale = 448 / amax, 1 where amax is 0), and each row's dequantization scale."""
    import torch

    row_amax = x.abs().amax(dim=1).float()
    amax = torch.zeros(experts, device=x.device).scatter_reduce(0, group, row_amax, "amax", include_self=True)
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    codes = (x.float() * scale[group][:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, (1.0 / scale)


def _weight_cast(w):
    """Per-expert E4M3 codes of (E, N, K) weights and each expert's dequantization scale."""
    import torch

    amax = w.abs().amax(dim=(1, 2)).float()
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    codes = (w.float() * scale[:, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, 1.0 / scale


# torch._scaled_grouped_mm's operands for each GEMM of a linear y = x W_e^T (mat_a row-major, mat_b
# column-major, a scale per row of mat_a and per column of mat_b); torch_fp8 and gemm_fp8 both use them.
def _fp8_fprop(xq, x_row_scales, wq, ws):
    """y = x W^T: xq (rows, K), wq (E, N, K), ws per expert."""
    E, N, _ = wq.shape
    return xq, wq.transpose(-2, -1), x_row_scales, ws[:, None].expand(E, N).contiguous()


def _fp8_dgrad(dyq, dy_row_scales, wt, ws):
    """dx = dy W: dyq (rows, N), wt (E, K, N) the columnwise copy of W, ws per expert."""
    E, K, _ = wt.shape
    return dyq, wt.transpose(-2, -1), dy_row_scales, ws[:, None].expand(E, K).contiguous()


def _fp8_wgrad(dyt, dys, xt, xs):
    """dW_e = dy_e^T x_e: dyt (N, rows) and xt (K, rows) the transposed copies, dys and xs per expert."""
    return dyt, xt.t(), dys.repeat_interleave(dyt.shape[0]), xs.repeat_interleave(xt.shape[0])


class _FP8GroupedLinear:
    """y = x W_e^T per expert on torch._scaled_grouped_mm: fprop, dgrad and wgrad all in E4M3."""

    @staticmethod
    def function():
        import torch

        out = dict(out_dtype=torch.bfloat16)

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w, offs, group):
                xq, xs = _per_expert_cast(x, group, w.shape[0])
                wq, ws = _weight_cast(w)
                fprop = _fp8_fprop(xq, xs[group].contiguous(), wq, ws)
                y = torch._scaled_grouped_mm(*fprop, offs=offs, use_fast_accum=True, **out)
                ctx.save_for_backward(xq, xs, wq, ws, offs, group)
                return y

            @staticmethod
            def backward(ctx, dy):
                xq, xs, wq, ws, offs, group = ctx.saved_tensors
                dyq, dys = _per_expert_cast(dy.contiguous(), group, wq.shape[0])
                wt = wq.transpose(-2, -1).contiguous()  # (E, K, N): the columnwise copy
                dx = torch._scaled_grouped_mm(
                    *_fp8_dgrad(dyq, dys[group].contiguous(), wt, ws), offs=offs, **out
                )
                wgrad = _fp8_wgrad(dyq.t().contiguous(), dys, xq.t().contiguous(), xs)
                dw = torch._scaled_grouped_mm(*wgrad, offs=offs, **out)
                return dx, dw, None, None

        return Fn


def torch_fp8_case(shape, counts):
    import torch

    E, H, F, _, _ = shape
    fn = _FP8GroupedLinear.function()
    w1 = (torch.randn(E, 2 * F, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, F, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    rows = sum(counts)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    c = torch.tensor(counts, device="cuda")
    offs = c.cumsum(0).to(torch.int32)
    group = torch.repeat_interleave(torch.arange(E, device="cuda"), c)

    def step():
        y = fn.apply(_swiglu(fn.apply(x, w1, offs, group)), w2, offs, group)
        y.backward(dy)

    return step, None


def gemm_operands(shape, counts, device: str = "cuda") -> dict:
    """Random BF16 operands of the expert MLP's GEMMs: x (rows, H), a = SwiGLU output (rows, F), dy
    (rows, H), dh = fc1's output gradient (rows, 2F), w1 (E, 2F, H), w2 (E, H, F)."""
    import torch

    E, H, F, _, _ = shape
    rows = sum(counts)
    bf = dict(device=device, dtype=torch.bfloat16)
    ops = {n: torch.randn(rows, k, **bf) for n, k in (("x", H), ("a", F), ("dy", H), ("dh", 2 * F))}
    return ops | {"w1": torch.randn(E, 2 * F, H, **bf) * 0.02, "w2": torch.randn(E, H, F, **bf) * 0.02}


def gemm_case(shape, counts, fp8: bool, device: str = "cuda", ops: dict | None = None):
    """The expert MLP's six GEMMs (fprop, dgrad, wgrad of fc1 and fc2) alone on `ops` (gemm_operands),
    made before timing; the step returns their outputs in that order."""
    import torch

    E, H, F, _, _ = shape
    c = torch.tensor(counts, device=device)
    offs = c.cumsum(0).to(torch.int32)
    ops = ops or gemm_operands(shape, counts, device)
    x, a, dy, dh, w1, w2 = (ops[n] for n in ("x", "a", "dy", "dh", "w1", "w2"))
    if not fp8:
        gemms = [
            (x, w1.transpose(-2, -1)),  # fc1 fprop (rows, 2F)
            (a, w2.transpose(-2, -1)),  # fc2 fprop (rows, H)
            (dy, w2),  # fc2 dgrad (rows, F)
            (dh, w1),  # fc1 dgrad (rows, H)
            (dy.t(), a),  # fc2 wgrad (E, H, F)
            (dh.t(), x),  # fc1 wgrad (E, 2F, H)
        ]
        step = lambda: [torch._grouped_mm(ma, mb, offs=offs) for ma, mb in gemms]  # noqa: E731
        return step, None
    group = torch.repeat_interleave(torch.arange(E, device=device), c)
    (xq, xs), (aq, as_), (dyq, dys), (dhq, dhs) = (_per_expert_cast(t, group, E) for t in (x, a, dy, dh))
    (w1q, w1s), (w2q, w2s) = _weight_cast(w1), _weight_cast(w2)
    w1t, w2t = w1q.transpose(-2, -1).contiguous(), w2q.transpose(-2, -1).contiguous()  # columnwise copies
    xt, at, dyt, dht = (t.t().contiguous() for t in (xq, aq, dyq, dhq))
    rows_of = lambda s: s[group].contiguous()  # noqa: E731 - each row's scale
    args = [
        (_fp8_fprop(xq, rows_of(xs), w1q, w1s), True),  # fc1 fprop
        (_fp8_fprop(aq, rows_of(as_), w2q, w2s), True),  # fc2 fprop
        (_fp8_dgrad(dyq, rows_of(dys), w2t, w2s), False),  # fc2 dgrad
        (_fp8_dgrad(dhq, rows_of(dhs), w1t, w1s), False),  # fc1 dgrad
        (_fp8_wgrad(dyt, dys, at, as_), False),  # fc2 wgrad
        (_fp8_wgrad(dht, dhs, xt, xs), False),  # fc1 wgrad
    ]
    sg, kw = torch._scaled_grouped_mm, dict(offs=offs, out_dtype=torch.bfloat16)
    step = lambda: [sg(*ops, use_fast_accum=fast, **kw) for ops, fast in args]  # noqa: E731
    return step, None


def check_torch_paths() -> dict:
    """The torch paths' forward and input gradient against fp32 GEMMs per expert on the operands they
    multiply (bf16 values; for torch_fp8 the dequantized per-expert E4M3 codes), on a small case with
    an empty expert: max |difference| / max |reference| (bf16 output rounding is ~4e-3)."""
    import torch

    E, H, F = 4, 256, 128
    counts = [64, 0, 32, 160]
    c = torch.tensor(counts, device="cuda")
    offs, group = c.cumsum(0).to(torch.int32), torch.repeat_interleave(torch.arange(E, device="cuda"), c)
    torch.manual_seed(0)
    x = torch.randn(sum(counts), H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, F, H, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    dy = torch.randn(sum(counts), F, device="cuda", dtype=torch.bfloat16)

    def reference(xv, wv, dyv):
        y, dx, dw, start = [], [], [], 0
        for e, n in enumerate(counts):
            xe, dye = xv[start : start + n].float(), dyv[start : start + n].float()
            y.append(xe @ wv[e].float().t())
            dx.append(dye @ wv[e].float())
            dw.append(dye.t() @ xe)
            start += n
        return torch.cat(y), torch.cat(dx), torch.stack(dw)

    def rel(a, b):
        return ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    out = {}
    for name, fn in (
        ("torch_bf16", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
        ("torch_fp8", lambda: _FP8GroupedLinear.function().apply(x, w, offs, group)),
    ):
        try:
            x.grad = w.grad = None
            y = fn()
            y.backward(dy)
            if name == "torch_fp8":
                xq, xs = _per_expert_cast(x.detach(), group, E)
                wq, ws = _weight_cast(w.detach())
                dq, ds = _per_expert_cast(dy, group, E)
                ref = reference(
                    xq.float() * xs[group][:, None],
                    wq.float() * ws[:, None, None],
                    dq.float() * ds[group][:, None],
                )
            else:
                ref = reference(x.detach(), w.detach(), dy)
            out[name] = {"y": rel(y, ref[0]), "dx": rel(x.grad, ref[1]), "dw": rel(w.grad, ref[2])}
        except Exception as exc:  # noqa: BLE001 - recorded; the timed cases say the same
            out[name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    return out


def time_case(step, repeats: int) -> dict:
    import torch

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return {
        "ms": start.elapsed_time(end) / repeats,
        "peak_gib_above_case_start": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def device_peaks(device_name: str) -> dict | None:
    """Dense peak TFLOP/s per dtype of the device, from the hardware preset its name picks (hardware=auto's
    rule: "NVIDIA H200" -> conf/hardware/h200.yaml); None for a device lowp has no preset of."""
    from harness.backends.hardware import preset_for_name
    from harness.config.store import load_preset

    preset = preset_for_name(device_name)
    return None if preset == "unknown_gpu" else dict(load_preset("hardware", preset).peak_tflops)


def _cublaslt_version():
    try:
        import transformer_engine_torch as tex

        return int(tex.get_cublasLt_version())
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        return f"unknown ({type(exc).__name__}: {exc})"


def cases(opts: Options):
    """(shape name, routing, path, recipe) in the order they run."""
    for shape in opts.shapes:
        for routing in opts.routings:
            for path in opts.paths:
                one = {"torch_bf16": ("bf16",), "lowp_grouped": ("bf16",), "torch_fp8": ("tensorwise_e4m3",)}
                one |= {"gemm_bf16": ("bf16",), "gemm_fp8": ("tensorwise_e4m3",)}
                for recipe in one.get(path, RECIPES):
                    yield shape, routing, path, recipe


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("moe_experts: needs a CUDA GPU")
    try:
        import transformer_engine

        te_version = transformer_engine.__version__
    except ImportError:
        te_version = None
    result = {
        "_meta": {
            **specs.meta(spec, opts),
            "how": __doc__.split("\n\n")[2].replace("\n", " "),
            "transformer_engine": te_version,
            "cublaslt": _cublaslt_version() if te_version else None,
            "shapes": {
                k: dict(zip(("experts", "hidden", "ffn", "topk", "tokens"), SHAPES[k])) for k in opts.shapes
            },
        },
        "torch_paths_check": check_torch_paths(),
        "cases": [],
    }
    peaks = device_peaks(torch.cuda.get_device_name(0))
    result["_meta"]["peak_tflops"] = peaks
    t0 = time.perf_counter()
    for shape_name, routing, path, recipe in cases(opts):
        shape = SHAPES[shape_name]
        E, H, F, k, tokens = shape
        counts = counts_for(routing, E, tokens * k)
        row = {"shape": shape_name, "routing": routing, "path": path, "recipe": recipe, "rows": sum(counts)}
        row["tokens_per_expert"] = {
            "min": min(counts),
            "max": max(counts),
            "empty": counts.count(0),
            "all": counts,
        }
        try:
            if path.startswith("te") and te_version is None:
                step, why = None, "unavailable: Transformer Engine is not installed"
            elif path.startswith("te"):
                step, why = te_case(
                    shape, counts, recipe, path == "te_grouped_tensor", path == "te_main_grad"
                )
            elif path == "torch_bf16":
                step, why = torch_bf16_case(shape, counts)
            elif path == "lowp_grouped":
                step, why = lowp_grouped_case(shape, counts)
            elif path in ("gemm_bf16", "gemm_fp8"):
                step, why = gemm_case(shape, counts, fp8=path == "gemm_fp8")
            else:
                step, why = torch_fp8_case(shape, counts)
            if step is None:
                row["status"] = why
            else:
                row.update(time_case(step, opts.repeats), status="ok")
                row["tflops"] = 18 * row["rows"] * H * F / (row["ms"] * 1e-3) / 1e12
                peak = (peaks or {}).get("bf16" if recipe == "bf16" else "fp8")
                if peak:
                    row["peak_fraction"] = row["tflops"] / peak
        except Exception as exc:  # noqa: BLE001 - the next case still runs; the reason is recorded
            row["status"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
            row["traceback"] = traceback.format_exc(limit=4)[-1200:]
        step = None
        torch.cuda.empty_cache()
        result["cases"].append(row)
        result["_meta"]["seconds"] = round(time.perf_counter() - t0, 1)
        specs.write_json(out, result)
        shown = (
            f"{row['ms']:.2f} ms {row['tflops']:.0f} TFLOP/s" if row["status"] == "ok" else row["status"][:90]
        )
        print(f"[moe_experts] {shape_name} {routing} {path} {recipe}: {shown}", flush=True)
    return result


def table(result: dict, routing: str = "balanced") -> str:
    """RESULTS.md's table: ms (TFLOP/s) per shape and path x recipe, one routing."""
    rows = [c for c in result["cases"] if c["routing"] == routing]
    cols = sorted({(c["path"], c["recipe"]) for c in rows}, key=lambda pr: (PATHS.index(pr[0]), pr[1]))
    lines = ["| shape | " + " | ".join(f"{p} {r}" for p, r in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for shape in dict.fromkeys(c["shape"] for c in rows):
        cells = []
        for p, r in cols:
            c = next((c for c in rows if c["shape"] == shape and c["path"] == p and c["recipe"] == r), None)
            ok = c is not None and c["status"] == "ok"
            cells.append(f"{c['ms']:.1f} ms ({c['tflops']:.0f})" if ok else (c["status"][:20] if c else "-"))
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
