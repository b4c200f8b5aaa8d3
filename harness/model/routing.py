"""Megatron Core's MoE routing as plain functions of [tokens, experts] tensors (no module state).

Each function is the unfused path of megatron/core/transformer/moe/moe_utils.py (Megatron-LM d98e8a6),
with Megatron's dtypes: the score functions run in fp32 from the router's logits and the routing
probabilities go back to the logits' dtype (the model's bf16 unless model.moe_router_dtype says
fp32/fp64). Tokens are in Megatron's order, sequence-major ([s, b] flattened), which the
per-sequence loss and the sums over tokens depend on.

    probs, routing_map = topk_routing(logits, 2, score_function="softmax")   # (T, E), (T, E) bool
    permuted, order = permute(tokens, routing_map)       # rows grouped by expert, expert-major
    tokens_back = unpermute(expert_output, order, T)     # the k outputs of each token summed

Megatron's other values (sqrtsoftplus scores; sinkhorn, global_aux_loss, quantile_balancing
balancing; group-limited top-k; the `position` drop policy) are not implemented: validation refuses them.
"""

from __future__ import annotations

import math

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
ROUTER_DTYPES = {None: torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
"""model.moe_router_dtype -> the dtype of the router's logits (null: the model's bf16, Megatron's default)."""
NOT_IMPLEMENTED = {
    "moe_router_score_function": ("sqrtsoftplus",),
    "moe_router_load_balancing_type": ("sinkhorn", "global_aux_loss", "quantile_balancing"),
}
"""Megatron's values lowp does not implement (refused by name, not as unknown)."""
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
"""Load-balancing type -> the name Megatron logs its loss under (z_loss is logged as `z_loss`)."""


class RouterGating(torch.autograd.Function):
    """Megatron's RouterGatingLinearFunction: logits = x W^T from the bf16 values of x (..., h) and W
    (E, h), accumulated in fp32 (fp64 for fp64) and returned in `dtype`; the input and weight grads
    come back rounded to bf16 (the bf16 activations' and parameters' dtype in Megatron)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(x16, w16)
        ctx.dtype, ctx.x_dtype, ctx.w_dtype = dtype, x.dtype, weight.dtype
        acc = torch.promote_types(dtype, torch.float32)
        return (x16.to(acc) @ w16.to(acc).t()).to(dtype)  # (..., E)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x16, w16 = ctx.saved_tensors
        g = g.to(torch.promote_types(ctx.dtype, torch.float32))
        dx = (g @ w16.to(g.dtype)).to(torch.bfloat16).to(ctx.x_dtype)
        g2, x2 = g.reshape(-1, g.shape[-1]), x16.reshape(-1, x16.shape[-1])
        dw = (g2.t() @ x2.to(g.dtype)).to(torch.bfloat16).to(ctx.w_dtype)
        return dx, dw, None


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs (T, E) in the logits' dtype, zero off the top-k; routing_map (T, E) bool): Megatron's
    topk_routing_with_score_function. softmax: over all experts then top-k (pre_softmax), or over
    the top-k logits; sigmoid: top-k of the scores (plus the expert bias, for the choice only),
    normalized over the k when k > 1."""
    if score_function == "softmax":
        if pre_softmax:
            probs, top = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(topk, dim=1)
        else:
            scores, top = logits.topk(topk, dim=1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            _, top = (scores + expert_bias.float()).topk(topk, dim=1)
            scores = scores.gather(1, top)
        else:
            scores, top = scores.topk(topk, dim=1)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"moe_router_score_function={score_function}: use one of {SCORE_FUNCTIONS}")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top, 1).bool()
    return routing_probs, routing_map


def capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's get_capacity: ceil(num_tokens / num_experts * capacity_factor)."""
    return math.ceil((num_tokens / num_experts) * capacity_factor)


def drop_tokens(
    probs: torch.Tensor, routing_map: torch.Tensor, topk: int, capacity_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's apply_router_token_dropping with its default drop policy `probs` and no padding
    to capacity: each expert keeps its `capacity` highest-probability tokens (of all T*k routed
    token slots' even share), the rest of its tokens are dropped from the map and the probs."""
    num_tokens, num_experts = probs.shape
    cap = capacity(num_tokens * topk, num_experts, capacity_factor)
    if cap > num_tokens:  # no expert can be over capacity
        return probs, routing_map
    _, keep = torch.topk(probs, k=cap, dim=0, sorted=False)
    capacity_mask = torch.zeros_like(probs).scatter(0, keep, 1).bool()
    final_map = torch.logical_and(routing_map, capacity_mask)
    return probs * final_map, final_map


def aux_loss_scores(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map, scores) the load-balancing losses read: Megatron's
    compute_routing_scores_for_aux_loss, the scores of all experts (softmax, or sigmoid normalized
    over the experts) in fp32 and their own top-k (no expert bias, no dropping)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, top = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits).int().scatter(1, top, 1).bool()
    return routing_map, scores


def switch_load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """Megatron's switch_load_balancing_loss_func: coeff * E * sum_i f_i P_i, with f_i the fraction
    of the T*k routed slots expert i got and P_i its mean score."""
    per_expert = scores.sum(dim=0)
    return torch.sum(per_expert * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens)
    )


def aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """The micro-batch's load-balancing loss (aux_loss): over all its tokens at once."""
    num_tokens, num_experts = scores.shape
    return switch_load_balancing_loss(scores, routing_map.sum(dim=0), num_tokens, topk, num_experts, coeff)


def seq_aux_loss(
    scores: torch.Tensor, routing_map: torch.Tensor, seq_length: int, topk: int, coeff: float
) -> torch.Tensor:
    """The per-sequence load-balancing loss (seq_aux_loss, DeepSeek-V2/V3): the batch folded into the
    expert dimension ([s, b*E]), so each sequence's experts count apart; summed, then / b."""
    num_experts = scores.shape[1]
    bsz = scores.shape[0] // seq_length
    scores, routing_map = scores.reshape(seq_length, -1), routing_map.reshape(seq_length, -1)
    loss = switch_load_balancing_loss(scores, routing_map.sum(dim=0), seq_length, topk, num_experts, coeff)
    return loss / bsz


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Megatron's z_loss_func (ST-MoE): coeff * mean over tokens of logsumexp(logits)^2."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def updated_expert_bias(
    tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float
) -> torch.Tensor:
    """Megatron's get_updated_expert_bias (after the all-reduce of the counts): each bias moves by
    `rate` towards balance, up for experts below the mean count, down above it."""
    average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average - tokens_per_expert) * rate


def pad_routing_map(routing_map: torch.Tensor, align: int) -> torch.Tensor:
    """moe_utils.py: pad_routing_map (Megatron's moe_router_padding_for_quantization): each expert
    with c routed tokens also takes its first (-c) mod `align` unrouted tokens, lowest token index
    first, so that its count is a multiple of `align`; they keep probability 0. An expert with too few
    unrouted tokens takes them all and stays unaligned (the caller refuses that)."""
    need = (-routing_map.sum(dim=0)) % align  # (E,)
    ranks = torch.cumsum((~routing_map).int(), dim=0)  # (T, E) rank of each unrouted token
    return routing_map | (~routing_map & (ranks <= need))


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(permuted (sum of the map, h), sorted_indices): each token copied once per expert it goes to,
    the copies grouped by expert in expert order, tokens in their order inside a group (Megatron's
    permute without probs: the argsort of the transposed map's nonzeros)."""
    sorted_indices = routing_map.T.nonzero(as_tuple=True)[1]  # (sum of the map,)
    return tokens.index_select(0, sorted_indices), sorted_indices


def permute_probs(probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """Each permuted row's routing probability, in permute's order (Megatron's allgather
    dispatcher: probs.T masked by routing_map.T)."""
    return probs.T.contiguous().masked_select(routing_map.T.contiguous())


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(num_tokens, h): each token's expert outputs added back at its row in their dtype, in expert
    order (Megatron's unpermute without probs, which the experts have applied already)."""
    out = torch.zeros(num_tokens, permuted.shape[-1], dtype=permuted.dtype, device=permuted.device)
    return out.index_add(0, sorted_indices, permuted)
