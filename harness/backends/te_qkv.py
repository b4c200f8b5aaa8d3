"""The packed QKV gradient of the TE backend (`backend.packed_qkv_grad`).

With learned positions, no QK norm and as many
key/value heads as query heads, TE 2.20's MultiheadAttention hands DotProductAttention the fused
QKV output as one packed (B, T, H, 3, D) tensor, and DotProductAttention takes q, k and v from it
with `select`. cuDNN's backward writes dq, dk and dv into one packed dQKV buffer, but autograd sees
three SelectBackward nodes: each allocates a zero tensor of the packed size, copies its slice in,
and two adds sum them (about 4 ms a step on the 8B slice, 3% of the step). `split_packed_qkv`
takes q, k, v out through one node whose backward returns that dQKV buffer itself when the three
grads are its slices (else it stacks them: one copy). The attention kernel and every number are
unchanged: q, k, v are the same views, and DotProductAttention finds the same packed layout from
their pointers.
"""

from __future__ import annotations

import torch


def _tiles(grads: tuple, dim: int, shape: torch.Size, stride: tuple[int, ...]) -> torch.Tensor | None:
    """The packed buffer (`shape`, `stride`) whose consecutive slices along `dim` the grads are,
    or None where they are not (then the caller stacks them)."""
    g0 = grads[0]
    if any(g is None or type(g) is not torch.Tensor for g in grads) or g0.dim() != len(shape) - 1:
        return None
    storage = g0.untyped_storage().data_ptr()
    for i, g in enumerate(grads):
        if g.untyped_storage().data_ptr() != storage or g.stride() != g0.stride() or g.dtype != g0.dtype:
            return None
        if g.storage_offset() != g0.storage_offset() + i * stride[dim]:
            return None
    if [*g0.stride()[:dim], stride[dim], *g0.stride()[dim:]] != list(stride):
        return None
    return g0.as_strided(shape, stride, g0.storage_offset())


class _SplitPacked(torch.autograd.Function):
    """A packed tensor -> its slices along `dim`, as views; backward hands back the packed
    gradient buffer without a copy when the slices' grads tile it (else one stack)."""

    @staticmethod
    def forward(ctx, packed: torch.Tensor, dim: int):
        ctx.dim = dim % packed.dim()
        ctx.shape, ctx.stride = packed.shape, packed.stride()
        ctx.dtype, ctx.device = packed.dtype, packed.device
        return tuple(packed.select(ctx.dim, i) for i in range(packed.shape[ctx.dim]))

    @staticmethod
    def backward(ctx, *grads):
        whole = _tiles(grads, ctx.dim, ctx.shape, ctx.stride)
        if whole is not None:
            return whole, None
        part = ctx.shape[: ctx.dim] + ctx.shape[ctx.dim + 1 :]
        filled = [
            g if g is not None else torch.zeros(part, dtype=ctx.dtype, device=ctx.device) for g in grads
        ]
        return torch.stack(filled, dim=ctx.dim), None


def split_packed_qkv(packed: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v (or k, v) as views of `packed` along `dim` through one autograd node."""
    return _SplitPacked.apply(packed, dim)


def _unpack_hook(module, args, kwargs):
    """DotProductAttention forward pre-hook: a packed plain-tensor qkv_layer becomes q, k, v."""
    packed = kwargs.get("qkv_layer")
    if packed is None or type(packed) is not torch.Tensor or not packed.requires_grad:
        return None  # FP8 (quantized) QKV, no grad (eval), or q/k/v given separately: TE's own path
    q, k, v = split_packed_qkv(packed, kwargs.get("qkv_interleave_dim", -3))
    kwargs = {**kwargs, "qkv_layer": None}
    return (q, k, v, *args[3:]), kwargs


def install_packed_qkv_grad(layer) -> object:
    """On one te.TransformerLayer: q, k, v leave the packed QKV through `split_packed_qkv`."""
    return layer.self_attention.core_attention.register_forward_pre_hook(_unpack_hook, with_kwargs=True)
