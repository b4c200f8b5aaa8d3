"""The LM head of the *_fp8headbwd recipes (recipe.fp8_lm_head_fprop=false): BF16 logits, FP8 backward.

The logits GEMM is the BF16 one every other recipe runs, so the loss the model reports is not
quantized; the head's dgrad (dx = dy W) and wgrad (dW = dy^T x) run on TE's current-scaling FP8
operands through TE's own GEMM, as TE's Linear backward does them (module/linear.py: the same
quantizer usages, `general_gemm` layouts NN and NT): the gradient in the recipe's backward format
(E5M2 under hybrid; E4M3 with recipe.fp8_lm_head_grad_format=e4m3), the weight and the input in
E4M3, each with its own per-tensor amax scale, and the recipe's accumulation
(recipe.fp8_fast_accumulation). TE is imported when the head is built.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.config.schema import RecipeConfig


class FP8BackwardHead(nn.Linear):
    """nn.Linear (no bias) whose backward GEMMs run in FP8 with current scaling."""

    def __init__(self, in_features: int, out_features: int, r: RecipeConfig):
        # built on the CPU in fp32 like the BF16 head (the model moves it): the same random draws,
        # so a run starts from the weights of the BF16 run of its seed
        super().__init__(in_features, out_features, bias=False)
        import transformer_engine_torch as tex

        e5m2 = r.fp8 == "hybrid" and r.fp8_lm_head_grad_format != "e4m3"
        grad = tex.DType.kFloat8E5M2 if e5m2 else tex.DType.kFloat8E4M3
        self.formats = (tex.DType.kFloat8E4M3, grad)  # (weight and input, gradient)
        self.scaling = {"force_pow_2_scales": r.power_2_scales, "amax_epsilon": r.amax_epsilon}
        self.split_accumulator = r.fp8_fast_accumulation != "all"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return _FP8BackwardLinear.apply(x, self.weight, self)


class _FP8BackwardLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, head: FP8BackwardHead) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.head = head
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        from transformer_engine.pytorch.cpp_extensions import general_gemm
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

        x, weight = ctx.saved_tensors
        head: FP8BackwardHead = ctx.head
        operand, grad_format = head.formats

        def quantize(t, fmt):  # both copies: TE 2.20 has no columnwise-only per-tensor cast
            q = Float8CurrentScalingQuantizer(fmt, t.device, rowwise=True, columnwise=True, **head.scaling)
            return q(t.contiguous())

        def gemm(a, b, layout: str, dtype: torch.dtype) -> torch.Tensor:  # TE's Linear backward GEMMs
            kw = {"grad": True, "use_split_accumulator": head.split_accumulator}
            return general_gemm(a, b, out_dtype=dtype, layout=layout, **kw)[0]

        dy_q = quantize(dy.reshape(-1, dy.shape[-1]), grad_format)  # (N, V)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx = dy W
            dx = gemm(quantize(weight, operand), dy_q, "NN", x.dtype).view_as(x)
        if ctx.needs_input_grad[1]:  # dW = dy^T x
            dw = gemm(quantize(x.reshape(-1, x.shape[-1]), operand), dy_q, "NT", weight.dtype)
        return dx, dw, None
