"""An emulated TE Linear: the three GEMMs on exactly the operand copies TE quantizes.

docs/numerics.md section 1:
    fprop  y  = x  W^T : x rowwise  x W rowwise
    dgrad  dx = dy W   : dy rowwise x W columnwise
    wgrad  dW = dy^T x : dy columnwise x x columnwise (x's copy made in forward and saved)
Operands are quantized from bf16 (activations, bf16(W), incoming bf16 grads), dequantized, and
multiplied in fp32; fprop and dgrad outputs are rounded to bf16 as `bf16_linear` does, the wgrad
output too unless `wgrad_fp32` (Megatron's fp32 main grads: TE's fused wgrad accumulation writes the
GEMM's fp32 result into `main_grad`; docs/numerics.md section 1). With fp8_wgrad=False the wgrad GEMM
takes the bf16 operands instead.

`recipe.backward_override` (TE 2.20, docs/numerics.md "backward_override"; TE module/linear.py
`_linear_setup_ctx` turns the backward's FP8 off): the grad is not quantized and both backward GEMMs
run in bf16 on it (so no `grad` telemetry row is written), with
    high_precision: dgrad dx = dy bf16(W),              wgrad dW = dy^T bf16(x)
    dequantized:    dgrad dx = dy bf16(deq(W rowwise)), wgrad dW = dy^T bf16(deq(x rowwise))
and no columnwise copies are made in forward. The weight's two copies are
cached until the next optimizer step (or an in-place write to W): TE (driven by Megatron's
is_first_microbatch) quantizes W once per optimizer step, not once per micro-batch.

`fast_gemm` (the default on CUDA) runs the three GEMMs on each copy's `gemm_operand()` instead:
bf16 tensor-core GEMMs on values exact in bf16, with the scales that are not folded into the
GEMM's fp32 result (harness.numerics.fast says which recipes that changes beyond accumulation
order). Codes and scales are the same either way.
"""

from __future__ import annotations

import torch

from harness import recipes
from harness.config.schema import RecipeConfig
from harness.numerics import fast
from harness.numerics.context import NumericsContext
from harness.numerics.quantizers import Quantizer, make_quantizer, quantize_pair

BF16 = torch.bfloat16


class QuantizedLinear:
    """Per-module numerics: a quantizer per role, delayed-scaling state, the weight cache."""

    def __init__(
        self,
        name: str,
        recipe: RecipeConfig,
        context: NumericsContext,
        *,
        fp8_wgrad: bool = True,
        margin: float = 0.0,
        fused_input_cast: bool = False,
        fused_grad_cast: bool = False,
        fp32_output: bool = False,
        wgrad_fp32: bool = False,
        fast_gemm: bool | None = None,
    ):
        """`fused_input_cast` / `fused_grad_cast`: TE casts this GEMM's input (norm or activation
        output) / grad output (the activation's backward) to FP8 inside the kernel that computes it,
        straight from fp32, with no bf16 rounding first (RecipeSpec.fused_casts in harness.recipes).
        `fp32_output`: the output keeps fp32 storage (bf16 values) so that the activation after it
        runs in fp32 and its backward hands back an unrounded gradient. `fast_gemm`: GEMMs on
        `gemm_operand()` values (harness.numerics.fast); None = on CUDA tensors only."""
        self.name, self.recipe, self.context, self.fp8_wgrad = name, recipe, context, fp8_wgrad
        self.fused_input_cast, self.fused_grad_cast = fused_input_cast, fused_grad_cast
        self.fp32_output, self.wgrad_fp32 = fp32_output, wgrad_fp32
        self.backward_override = recipe.backward_override
        if self.backward_override is not None:
            # TE quantizes the norm's output in the norm kernel only without an override
            # (layernorm_linear.py:244-250, with_quantized_norm), and its LayerNormMLP refuses one
            # (layernorm_mlp.py:253): the override runs as LayerNormLinear + Linear, whose inputs and
            # grads are bf16 tensors, so no operand is cast from fp32 and fc1's output is bf16.
            self.fused_input_cast = self.fused_grad_cast = self.fp32_output = False
        self.fast_gemm = fast_gemm
        self.calls = 0
        self._weight_cache: tuple | None = None
        if recipes.get(recipe.name).delayed_scaling:
            fwd, bwd = context.delayed_states(name, recipe, margin)
            self.quantizers = {
                "input": self._delayed(recipe, "input", fwd, 0),
                "weight": self._delayed(recipe, "weight", fwd, 1),
                "grad": self._delayed(recipe, "grad", bwd, 0),
            }
        else:
            gen = context.generator
            self.quantizers = {
                r: make_quantizer(recipe, r, generator=gen) for r in ("input", "weight", "grad")
            }

    @staticmethod
    def _delayed(recipe, role, state, i):
        return make_quantizer(
            recipe, role, scale=lambda: state.current_scale(i), record=lambda a: state.record(i, a)
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        use_fast = self.set_fused(x)
        return (_FastQuantizedLinearFn if use_fast else _QuantizedLinearFn).apply(x, weight, bias, self)

    def set_fused(self, x: torch.Tensor) -> bool:
        """Whether this call on x takes the fast GEMMs; the built-in quantizers fuse their casts
        then (the same codes either way)."""
        use_fast = x.is_cuda if self.fast_gemm is None else self.fast_gemm
        for qz in self.quantizers.values():
            if isinstance(qz, Quantizer):
                qz.fused = use_fast
        return use_fast

    def quantize_input(self, x2: torch.Tensor, need_columnwise: bool):
        row, col = quantize_pair(self.quantizers["input"], x2, True, need_columnwise)
        self.context.telemetry.add(self.name, "input", x2, row)
        return row, col

    def quantize_weight(self, weight: torch.Tensor, need_columnwise: bool):
        """Both copies of bf16(W), recomputed only when W may have changed.

        The cache is keyed on the optimizer steps taken (NumericsContext.weights_generation, bumped
        by the backend after each; optimizers that write `p.data` bump no version counter) and on
        W's storage and version counter (in-place writes between steps: load_state_dict, a
        user's `p.copy_`). No value comparison: that is a host sync per Linear, hundreds a step on
        a GPU. Quantizing W is deterministic (no stochastic rounding for weights), so a reused copy
        is the copy a recomputation would give.
        """
        key = (self.context.weights_generation, weight.data_ptr(), weight._version, tuple(weight.shape))
        cache = self._weight_cache
        if cache is None or cache[2] != key or (need_columnwise and cache[1] is None):
            w16 = weight.detach().to(BF16)
            row, col = quantize_pair(self.quantizers["weight"], w16, True, need_columnwise)
            self._weight_cache = cache = (row, col, key, w16)
        self.context.telemetry.add(self.name, "weight", cache[3], cache[0])
        return cache[0], cache[1]

    def weight_bf16(self) -> torch.Tensor:
        """bf16(W) of the cached copies (the operand a high-precision dgrad reads)."""
        return self._weight_cache[3]

    @property
    def columnwise_copies(self) -> bool:
        """Forward makes the columnwise copies the backward GEMMs read (TE: not with an override)."""
        return self.backward_override is None

    def quantize_grad(self, dy2: torch.Tensor, need_rowwise: bool, need_columnwise: bool):
        row, col = quantize_pair(self.quantizers["grad"], dy2, need_rowwise, need_columnwise)
        if row is not None:
            self.context.telemetry.add(self.name, "grad", dy2, row)
        return row, col

    def __repr__(self) -> str:
        q = self.quantizers
        extra = "" if self.fp8_wgrad else ", wgrad=bf16"
        extra += f", backward={self.backward_override}" if self.backward_override else ""
        extra += ", dW fp32" if self.wgrad_fp32 else ""
        extra += {None: "", True: ", fast GEMM", False: ", reference GEMM"}[self.fast_gemm]
        fused = [r for r, f in (("input", self.fused_input_cast), ("grad", self.fused_grad_cast)) if f]
        extra += f", fused fp32 cast={'+'.join(fused)}" if fused else ""
        return f"{self.recipe.name}(input={q['input']!r}, weight={q['weight']!r}, grad={q['grad']!r}{extra})"


def _deq2d(q, rows: int) -> torch.Tensor:
    return q.dequantize().reshape(rows, -1).float()


def _input_2d(x: torch.Tensor, mod: QuantizedLinear) -> torch.Tensor:
    """(M, K): TE quantizes the bf16 activation, or the fp32 one where the cast is fused."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2.float() if mod.fused_input_cast else x2.to(BF16)


def _remember(ctx, mod: QuantizedLinear, x, weight, bias) -> None:
    ctx.mod, ctx.x_dtype, ctx.x_shape = mod, x.dtype, x.shape
    ctx.w_dtype, ctx.b_dtype = weight.dtype, bias.dtype if bias is not None else None
    ctx.first = mod.context.claim_first()


def _override_operands(mod: QuantizedLinear, x2, xr, wr, m: int, n: int) -> tuple:
    """(x (M, K) for wgrad, W (N, K) for dgrad), both bf16, under recipe.backward_override: TE's
    saved original input and weight (high_precision), or its rowwise forward copies dequantized to
    the activation dtype (dequantized; linear.py backward, `weight_for_dgrad`, `inputmat`)."""
    if mod.backward_override == "dequantized":
        return xr.dequantize().reshape(m, -1).to(BF16), wr.dequantize().reshape(n, -1).to(BF16)
    return x2.to(BF16), mod.weight_bf16()


def _wgrad_fp8(mod: QuantizedLinear, need_dw: bool) -> bool:
    """The wgrad GEMM reads FP8 copies (neither fp8_wgrad=False nor a backward_override)."""
    return need_dw and mod.fp8_wgrad and mod.backward_override is None


def _quantized_grad(ctx, dy: torch.Tensor):
    """(dy (M, N) as TE quantizes it, its rowwise copy, its columnwise copy or None, fp8 wgrad?);
    under backward_override the copies are None: both GEMMs take bf16 dy."""
    mod: QuantizedLinear = ctx.mod
    dy2 = dy.reshape(-1, dy.shape[-1])
    dy2 = dy2.float() if mod.fused_grad_cast else dy2.to(BF16)
    if mod.backward_override is not None:
        return dy2, None, None, False
    fp8_dw = _wgrad_fp8(mod, ctx.needs_input_grad[1])
    dyr, dyc = mod.quantize_grad(dy2, True, fp8_dw)
    return dy2, dyr, dyc, fp8_dw


def _bias_grad_and_update(ctx, dy2: torch.Tensor) -> torch.Tensor | None:
    """dbias from the unquantized grad; the delayed-scaling backward update after the last backward
    of this forward (TE)."""
    db = None
    if ctx.needs_input_grad[2] and ctx.b_dtype is not None:
        db = dy2.float().sum(0).to(BF16).to(ctx.b_dtype)
    if ctx.first:
        ctx.mod.context.update_backward()
    return db


class _QuantizedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mod: QuantizedLinear):
        mod.calls += 1
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x2 = _input_2d(x, mod)  # (M, K)
        xr, xc = mod.quantize_input(x2, _wgrad_fp8(mod, need_dw))
        wr, wc = mod.quantize_weight(weight, need_dx and mod.columnwise_copies)
        m, n = x2.shape[0], weight.shape[0]
        xq, wq = _deq2d(xr, m), _deq2d(wr, n)  # (M, K), (N, K) fp32
        if bias is not None:
            y = torch.addmm(bias.to(BF16).float(), xq, wq.t())
        else:
            y = xq @ wq.t()
        # what wgrad reads: x's columnwise copy, or bf16 x when wgrad runs in high precision
        if mod.columnwise_copies:
            x_saved = _deq2d(xc, m) if xc is not None else x2.to(BF16)
            w_saved = _deq2d(wc, n) if need_dx else None
        else:
            x_saved, w_saved = _override_operands(mod, x2, xr, wr, m, n)  # bf16
        ctx.save_for_backward(x_saved if need_dw else None, w_saved if need_dx else None)
        _remember(ctx, mod, x, weight, bias)
        y = y.to(BF16).float() if mod.fp32_output else y.to(BF16)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        mod: QuantizedLinear = ctx.mod
        x_saved, wc = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dy2, dyr, dyc, fp8_dw = _quantized_grad(ctx, dy)  # (M, N)
        dx = dw = None
        if need_dx:
            dy_x = _deq2d(dyr, dy2.shape[0]) if dyr is not None else dy2.float()
            dx = (dy_x @ wc.float()).to(BF16).to(ctx.x_dtype).view(ctx.x_shape)
        if need_dw:
            dy_w = _deq2d(dyc, dy2.shape[0]) if fp8_dw else dy2.float()
            x_w = x_saved.float()
            dw = dy_w.t() @ x_w  # (N, K), fp32
            dw = (dw if mod.wgrad_fp32 else dw.to(BF16)).to(ctx.w_dtype)
        return dx, dw, _bias_grad_and_update(ctx, dy2), None


class _FastQuantizedLinearFn(torch.autograd.Function):
    """_QuantizedLinearFn's operands and order, GEMMs on `gemm_operand()` (harness.numerics.fast)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mod: QuantizedLinear):
        mod.calls += 1
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x2 = _input_2d(x, mod)  # (M, K)
        xr, xc = mod.quantize_input(x2, _wgrad_fp8(mod, need_dw))
        wr, wc = mod.quantize_weight(weight, need_dx and mod.columnwise_copies)
        m, n = x2.shape[0], weight.shape[0]
        (xa, xs), (wa, ws) = fast.operand(xr, m), fast.operand(wr, n)  # (M, K), (N, K)
        b = bias.to(BF16) if bias is not None else None
        y = fast.mm_bf16(xa, wa.t(), fast.alpha_of(xs, ws), b, fp32_storage=mod.fp32_output)  # (M, N)
        if mod.columnwise_copies:
            x_bwd, w_bwd = (xc if xc is not None else x2.to(BF16)), wc
        else:
            x_bwd, w_bwd = _override_operands(mod, x2, xr, wr, m, n)  # bf16
        xw, xws = fast.operand(x_bwd, m) if need_dw else (None, None)
        wd, wds = fast.operand(w_bwd, n) if need_dx else (None, None)
        ctx.save_for_backward(xw, xws, wd, wds)
        _remember(ctx, mod, x, weight, bias)
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        mod: QuantizedLinear = ctx.mod
        xw, xws, wd, wds = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dy2, dyr, dyc, fp8_dw = _quantized_grad(ctx, dy)  # (M, N)
        m = dy2.shape[0]
        dx = dw = None
        if need_dx:
            da, das = fast.operand(dyr if dyr is not None else dy2, m)
            dx = fast.mm_bf16(da, wd, fast.alpha_of(das, wds)).to(ctx.x_dtype).view(ctx.x_shape)
        if need_dw:
            dwa, dws = fast.operand(dyc if fp8_dw else dy2, m)
            dw = fast.mm(dwa.t(), xw, fast.alpha_of(dws, xws))  # (N, K), fp32
            dw = (dw if mod.wgrad_fp32 else dw.to(BF16)).to(ctx.w_dtype)
        return dx, dw, _bias_grad_and_update(ctx, dy2), None
