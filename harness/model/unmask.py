"""Iterative unmasking: what a masked-diffusion model generates (LLaDA's sampler, low-confidence remasking).

The answer starts as `gen_length` mask tokens after the prompt. At each of `steps` steps the model
predicts every position at once; among the positions still masked, the k whose predicted token has the
highest probability are fixed to it and the rest stay masked (LLaDA's `generate` with
remasking='low_confidence', GSAI-ML/LLaDA generate.py): k is the step's share of the block's masks,
split as evenly as the steps allow, the first steps taking the remainder. With `block_length` below
`gen_length` the answer is filled block by block, left to right (semi-autoregressive), `steps` spread
evenly over the blocks. temperature 0 is greedy; above 0, Gumbel noise on the logits (in float64, as
LLaDA adds it) picks the token, and the confidence is still the softmax probability of the pick.

    from harness.model.unmask import generate
    out = generate(model, prompt_ids, gen_length=32, steps=32, mask_token=trainer.objective.mask_token)
"""

from __future__ import annotations

import torch
import torch.nn as nn


def transfer_counts(masked: int, steps: int) -> list[int]:
    """How many of `masked` positions each of `steps` steps fixes: as even as possible, the first
    steps taking the remainder (LLaDA's get_num_transfer_tokens)."""
    base, extra = divmod(masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    u = torch.rand(logits.shape, generator=gen, dtype=torch.float64).to(logits.device)
    gumbel = (-torch.log(u)) ** temperature  # LLaDA's add_gumbel_noise: exp(logits) / gumbel^t
    return (logits.double().exp() / gumbel).argmax(dim=-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    gen_length: int,
    steps: int,
    mask_token: int,
    block_length: int | None = None,
    temperature: float = 0.0,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, P + gen_length) tokens: the prompt (B, P) followed by the generated answer. `model(x)` must
    return (B, T, V) logits of a bidirectional model (harness.model.objective.set_causal(model, False))."""
    block_length = block_length or gen_length
    if gen_length % block_length or steps % (gen_length // block_length):
        raise ValueError(
            f"block_length={block_length}, steps={steps}: gen_length={gen_length} must be a multiple of "
            "block_length and steps a multiple of the number of blocks"
        )
    B, P = prompt.shape
    x = torch.cat(
        [prompt, torch.full((B, gen_length), mask_token, dtype=prompt.dtype, device=prompt.device)], 1
    )
    blocks = gen_length // block_length
    for b in range(blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        counts = torch.tensor(
            [transfer_counts(int(n), steps // blocks) for n in (x[:, lo:hi] == mask_token).sum(1)]
        )
        for step in range(steps // blocks):
            masked = x == mask_token  # (B, T)
            logits = model(x).float()  # (B, T, V)
            pick = _pick(logits, temperature, gen)
            confidence = torch.softmax(logits, dim=-1).gather(-1, pick[..., None]).squeeze(-1)
            confidence[:, hi:] = -torch.inf  # later blocks wait their turn
            confidence = torch.where(masked, confidence, -torch.inf)
            for row in range(B):
                k = int(counts[row, step])
                if k:
                    top = confidence[row].topk(k).indices
                    x[row, top] = pick[row, top]
    return x
