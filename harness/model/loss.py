"""The LM head and cross entropy, whole or in chunks of tokens.

Whole: `loss_fn(lm_head(h), targets)` holds the bf16 logits, their fp32 copy and the saved softmax,
several GiB at vocab 50k (the 1.4B anchor shape: 16,384 tokens x 50,304 x (2 + 4 + 4) bytes = 8 GB),
and its backward makes two more fp32 tensors of that size (the NLL's and the log-softmax's grads).

Fused (`model.cross_entropy_loss_fusion`, Megatron's --cross-entropy-loss-fusion with TE's kernel):
TE's `parallel_cross_entropy` reads the bf16 logits once for the loss (fp32 arithmetic) and keeps
them plus one fp32 statistic per row; backward writes d(logits) into the logits' own storage. Peak
extra memory: the bf16 logits alone (1.6 GB at the 1.4B shape). The numbers are the whole path's up
to the order of fp32 operations (the loss and the bf16 logit gradients from fp32 softmax).

Chunked (`model.lm_head_loss_chunks=N`): a fused linear cross entropy, as Liger's
FusedLinearCrossEntropy does. Each chunk of tokens computes its bf16 logits, its loss and, right
there, its gradients (softmax - one-hot, rounded to bf16 as the logits' grad would be); only
d(hidden) and d(W) are kept for backward. Peak extra memory: one chunk's logits instead of all.
The numbers are the whole path's up to the order of fp32 additions: the same bf16 logits, fp32
log-softmax, bf16 logit gradients, bf16 GEMMs accumulating in fp32; d(W) sums the chunks in fp32
and is rounded once, to the weight's dtype.

Weighted (`weighted_cross_entropy`): sum_i w_i CE_i with per-token weights, the masked-diffusion
objective's loss (harness.model.objective), on each of the three paths: whole logits, TE's fused
kernel (per-token losses, a per-token grad_output), or chunks (each chunk's gradient scaled by its
rows' weights instead of 1/n).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Mean cross entropy, in fp32 whatever the logits' dtype; `fused`: TE's fused kernel."""
    if fused:
        return fused_cross_entropy(logits, targets)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy by TE's Triton kernel on the logits as they are (bf16 or fp32, CUDA):
    no fp32 copy; backward overwrites the logits with their gradient (nothing else reads them:
    the LM head's backward needs its input and weight only)."""
    if not logits.is_cuda:
        raise ValueError(
            "model.cross_entropy_loss_fusion=true needs the logits on a CUDA GPU (TE's Triton kernel); "
            "set model.cross_entropy_loss_fusion=false"
        )
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    logits = logits.view(-1, 1, logits.size(-1)) if logits.dim() != 3 else logits  # (B, T, V)
    loss = parallel_cross_entropy(
        logits.contiguous(), targets.reshape(-1).long(), reduce_loss=True, overwrite_input=True
    )
    return loss.reshape(())  # TE returns shape (1,): a scalar like F.cross_entropy's


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 operands, fp32 accumulation, bf16 result (on a CPU the product runs in fp32)."""
    if a.is_cuda:
        return a @ b
    return (a.float() @ b.float()).to(BF16)


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 operands, fp32 accumulation, fp32 result (torch.mm's out_dtype where CUDA has it)."""
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # an older torch: bf16 result
            return (a @ b).float()
    return a.float() @ b.float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunks: int, row_weights=None):
        n = h.shape[0]
        h16, w16 = h.to(BF16), weight.to(BF16)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h16) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        step = -(-n // chunks)
        for s in range(0, n, step):
            e = min(n, s + step)
            t = targets[s:e]
            logits = _mm(h16[s:e], w16.t()).float()  # (rows, V): the LM head's bf16 logits
            lse = torch.logsumexp(logits, dim=-1)
            nll = lse - logits.gather(1, t[:, None]).squeeze(1)
            w = None if row_weights is None else row_weights[s:e].float()
            total += nll.sum() if w is None else (nll * w).sum()
            if need_grad:
                logits.sub_(lse[:, None]).exp_()  # softmax, in place
                logits[torch.arange(e - s, device=t.device), t] -= 1.0
                # d(loss)/d(logits), as the bf16 logits receive it: mean (1/n) or weighted
                g16 = (logits.div_(n) if w is None else logits.mul_(w[:, None])).to(BF16)
                del logits
                grad_h[s:e] = _mm(g16, w16)
                grad_w += _mm_fp32_out(g16.t(), h16[s:e])
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total / n if row_weights is None else total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = (grad_h.float() * grad_out).to(h_dtype) if ctx.needs_input_grad[0] else None
        dw = (grad_w * grad_out).to(w_dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None


def chunked_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int
) -> torch.Tensor:
    """Mean cross entropy of `h @ weight.T` against `targets`, never holding all the logits.
    h: (..., C); weight: (V, C) (no bias); targets: (...)."""
    if chunks < 1:
        raise ValueError(f"model.lm_head_loss_chunks={chunks}: use 0 (whole logits) or a positive count")
    return _ChunkedLinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), chunks)


def weighted_cross_entropy(
    h: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    weights: torch.Tensor,
    chunks: int = 0,
    fused: bool = False,
) -> torch.Tensor:
    """sum_i weights_i * CE(lm_head(h)_i, targets_i) in fp32. h: (B, T, C); targets, weights: (B, T).
    `chunks` > 0: the chunked LM head and loss; `fused`: TE's kernel; else the whole logits."""
    w = weights.reshape(-1).float()
    if chunks > 0:
        flat = h.reshape(-1, h.shape[-1])
        return _ChunkedLinearCrossEntropy.apply(flat, lm_head.weight, targets.reshape(-1), chunks, w)
    logits = lm_head(h)  # (B, T, V)
    if fused:
        if not logits.is_cuda:
            raise ValueError(
                "model.cross_entropy_loss_fusion=true needs the logits on a CUDA GPU (TE's Triton kernel); "
                "set model.cross_entropy_loss_fusion=false"
            )
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

        per_token = parallel_cross_entropy(  # as fused_cross_entropy calls it, one loss per token
            logits.contiguous(), targets.reshape(-1).long(), reduce_loss=False, overwrite_input=True
        )
        return (per_token.float().reshape(-1) * w).sum()
    nll = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return (nll * w).sum()
