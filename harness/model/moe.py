"""The mixture-of-experts MLP: Megatron Core's MoELayer with its TopKRouter, the allgather token
dispatcher (one rank holds every expert: no expert parallelism), grouped experts and the shared
expert, in place of a block's dense MLP where `moe_layer_pattern` says so.

    blocks.3.mlp                  MoE
    blocks.3.mlp.router           weight (E, h); buffer expert_bias (E,) with the aux-loss-free balancing
    blocks.3.mlp.experts.fc1      a grouped linear: weight (E, 2F or F, h), one GEMM per expert
    blocks.3.mlp.experts.fc2      a grouped linear: weight (E, h, F)
    blocks.3.mlp.shared_experts   the dense MLP every token also takes (fc1, fc2), optional
    blocks.3.mlp.shared_experts_gate   (1, h): Qwen2-MoE's sigmoid gate on it, optional

Forward (megatron/core/transformer/moe/{moe_layer,router,token_dispatcher,experts}.py, d98e8a6):
shared expert; router logits (routing.RouterGating) -> z-loss -> top-k probs and map -> capacity
dropping -> load-balancing loss -> the expert bias's token counts; tokens permuted into
contiguous per-expert rows, each expert's fc1 -> activation -> x its routing probability -> fc2,
unpermuted (the k outputs of a token summed), plus the shared expert. The router's losses are not
part of the LM loss: `Routing.take_losses` hands them to the trainer, which adds them to the
training objective as Megatron's MoEAuxLossAutoScaler does (the gradient of each is the LM
loss's scale) and logs them beside loss/train.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from harness.config.schema import ModelConfig
from harness.model import routing as R

BF16 = torch.bfloat16


class ExpertOps(Protocol):
    """What a backend provides for the routed experts (the rest of harness.model.gpt.Ops)."""

    def grouped_linear(self, name: str, num_gemms: int, in_features: int, out_features: int) -> nn.Module:
        """A group of `num_gemms` bias-free linears: `forward(x (M, in), m_splits) -> (M, out)`,
        GEMM i on the m_splits[i] rows that follow GEMM i-1's (TE's GroupedLinear). Its `align_size`
        (0: none) is the row count its recipe needs each expert padded to."""
        ...

    def activation(self, name: str, kind: str) -> nn.Module: ...


def moe_layer_pattern(cfg: ModelConfig) -> list[int]:
    """1 for each MoE block, 0 for each dense one (Megatron's moe_layer_freq: an int N makes every
    N-th block from the first an MoE block, a list is the pattern itself); all 0 without experts."""
    if cfg.num_moe_experts is None:
        return [0] * cfg.num_layers
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(cfg.num_layers)]
    return [int(v) for v in freq]


def expert_groups(cfg: ModelConfig) -> list[str]:
    """The module names of the model's expert groups (`blocks.3.mlp.experts.fc1`), fc1 and fc2 of each
    MoE block in order; none for a dense model."""
    return [
        f"blocks.{i}.mlp.experts.{fc}" for i, moe in enumerate(moe_layer_pattern(cfg)) if moe
        for fc in ("fc1", "fc2")
    ]  # fmt: skip


class Router(nn.Module):
    """Megatron's TopKRouter: the gating GEMM in model.moe_router_dtype, then routing.py's steps.
    `expert_bias` (fp32, saved with the model) and the token counts it is updated from
    (`local_tokens_per_expert`, counted in training forwards, zeroed by each update) exist only
    with model.moe_router_enable_expert_bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=cfg.init_method_std)
        with_bias = cfg.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(cfg.num_moe_experts) if with_bias else None)
        counts = torch.zeros(cfg.num_moe_experts) if with_bias else None
        self.register_buffer("local_tokens_per_expert", counts, persistent=False)
        self.stats: torch.Tensor | None = None
        """`routing_stats` of the last forward with autograd on, until `Routing` takes them."""

    def forward(self, tokens: torch.Tensor, seq_length: int):
        """tokens (T, h) in [s, b] order -> (probs (T, E), routing_map (T, E), losses): `losses` maps
        Megatron's metric name to (the term added to the objective, the logged value = term / coeff);
        computed only with autograd on (training), as Megatron does."""
        c = self.cfg
        logits = R.RouterGating.apply(tokens, self.weight, R.ROUTER_DTYPES[c.moe_router_dtype])  # (T, E)
        training = self.training and torch.is_grad_enabled()
        losses: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if c.moe_z_loss_coeff is not None and training:
            losses["z_loss"] = _logged(R.z_loss(logits, c.moe_z_loss_coeff), c.moe_z_loss_coeff)
        probs, routing_map = R.topk_routing(
            logits,
            c.moe_router_topk,
            score_function=c.moe_router_score_function,
            pre_softmax=c.moe_router_pre_softmax,
            scaling_factor=c.moe_router_topk_scaling_factor,
            expert_bias=self.expert_bias,
        )
        routed = routing_map  # before capacity dropping: the dropped-token count's reference
        if c.moe_expert_capacity_factor is not None:
            probs, routing_map = R.drop_tokens(
                probs, routing_map, c.moe_router_topk, c.moe_expert_capacity_factor
            )
        if training:  # what Routing logs of the load; no host sync
            self.stats = routing_stats(logits, routed, routing_map, c.moe_router_score_function)
        coeff, kind = c.moe_aux_loss_coeff, c.moe_router_load_balancing_type
        if training and coeff > 0 and kind in R.LOSS_NAMES:
            aux_map, scores = R.aux_loss_scores(logits, c.moe_router_topk, c.moe_router_score_function)
            if kind == "aux_loss":
                loss = R.aux_loss(scores, aux_map, c.moe_router_topk, coeff)
            else:
                loss = R.seq_aux_loss(scores, aux_map, seq_length, c.moe_router_topk, coeff)
            losses[R.LOSS_NAMES[kind]] = _logged(loss, coeff)
        if self.expert_bias is not None and torch.is_grad_enabled():  # not in evaluation
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map, losses


def _logged(term: torch.Tensor, coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    return term, term.detach().float() / coeff


def routing_stats(
    logits: torch.Tensor, routed: torch.Tensor, kept: torch.Tensor, score_function: str
) -> torch.Tensor:
    """(2E + 2,) fp32 sums over the micro-batch's T tokens, all additive over micro-batches and ranks:
    the tokens each expert keeps (kept (T, E) map), the tokens routed to each before capacity dropping
    (routed (T, E) map), the summed per-token entropy in nats of the router's scores over all E
    experts (softmax of the logits, or sigmoid normalized over the experts: the distribution the
    load-balancing loss reads, expert bias excluded), and T."""
    with torch.no_grad():
        if score_function == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        entropy = torch.special.entr(scores).sum()  # sum over tokens of -sum_e p log p
        tokens = torch.full((1,), logits.shape[0], dtype=torch.float32, device=logits.device)
        return torch.cat([kept.sum(dim=0).float(), routed.sum(dim=0).float(), entropy[None], tokens])


class Experts(nn.Module):
    """The routed experts (Megatron's TEGroupedMLP): fc1 and fc2 are grouped linears of the backend
    (`ExpertOps.grouped_linear`), so that each expert's GEMM is one call a recipe can quantize on
    its own; the activation runs on all permuted rows at once, then each row is weighted by its
    routing probability before fc2 (Megatron applies the probabilities inside the experts).

    Under an FP8/FP4 recipe each expert's rows are first padded with +0.0 rows to the recipe's
    alignment (16, 32 for MXFP8, 128 for NVFP4), with probability 0, and the padding rows are dropped
    from fc2's output (Megatron's default: TE's Fp8Padding / Fp8Unpadding, docs/numerics_grouped.md
    §1.4); the backward drops their gradient and pads the output gradient with zeros. When fc1 and
    fc2 differ in recipe (a stability override on one of them), the larger alignment serves both
    (the alignments are 16, 32 and 128, so it is a multiple of each)."""

    def __init__(self, cfg: ModelConfig, ops: ExpertOps, prefix: str):
        super().__init__()
        E, h, f = cfg.num_moe_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        self.num_experts, self.ffn_hidden_size = E, f
        gated = cfg.activation == "swiglu"
        self.fc1 = ops.grouped_linear(f"{prefix}.fc1", E, h, 2 * f if gated else f)
        self.act = ops.activation(f"{prefix}.act", cfg.activation)
        self.fc2 = ops.grouped_linear(f"{prefix}.fc2", E, f, h)
        self.align_size = max(getattr(self.fc1, "align_size", 0), getattr(self.fc2, "align_size", 0))
        """The rows each expert's count is aligned to (0: none)."""
        self.pad_rows = not cfg.moe_router_padding_for_quantization
        """False where the router padded the counts already (Megatron's skip_routed_expert_padding)."""

    def forward(self, x: torch.Tensor, m_splits: list[int], probs: torch.Tensor) -> torch.Tensor:
        align = self.align_size if self.pad_rows else 0
        rows = None
        if align:
            padded = [-(-m // align) * align for m in m_splits]
            rows = padded_rows(m_splits, padded, x.device)  # (M,) each real row's place
            x = x.new_zeros(sum(padded), x.shape[1]).index_copy(0, rows, x)
            probs = probs.new_zeros(sum(padded)).index_copy(0, rows, probs)
            m_splits = padded
        hidden = self.act(self.fc1(x, m_splits))  # (M, F)
        hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
        out = self.fc2(hidden, m_splits)  # (M, h)
        return out if rows is None else out.index_select(0, rows)


def padded_rows(m_splits: list[int], padded: list[int], device) -> torch.Tensor:
    """Where each of the sum(m_splits) rows lands when expert e's m_splits[e] rows start its
    padded[e]-row segment (the padding rows follow them)."""
    starts = torch.tensor([0, *padded[:-1]], device=device).cumsum(0)
    counts = torch.tensor(m_splits, device=device)
    offsets = torch.arange(int(counts.sum()), device=device)
    firsts = torch.tensor([0, *m_splits[:-1]], device=device).cumsum(0)
    return (offsets - firsts.repeat_interleave(counts)) + starts.repeat_interleave(counts)


class MoE(nn.Module):
    """An MoE block's MLP; `shared_experts` is the dense MLP the caller built for it (or None)."""

    def __init__(
        self, cfg: ModelConfig, ops: ExpertOps, prefix: str, shared_experts: nn.Module | None = None
    ):
        super().__init__()
        self.topk = cfg.moe_router_topk
        self.router = Router(cfg)
        self.experts = Experts(cfg, ops, f"{prefix}.experts")
        self.shared_experts = shared_experts
        self.shared_experts_gate = None
        if shared_experts is not None and cfg.moe_shared_expert_gate:
            self.shared_experts_gate = nn.Parameter(torch.empty(1, cfg.hidden_size))
            nn.init.normal_(self.shared_experts_gate, std=cfg.init_method_std)
        self.losses: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """The router's losses of the last forward with autograd on, until `Routing` takes them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x16 = x.to(BF16)  # Megatron's bf16 activations: the gradients of its consumers add in bf16
        shared = self._shared(x16) if self.shared_experts is not None else None  # first, as Megatron
        tokens = x16.transpose(0, 1).reshape(T * B, C)  # (T*B, C): Megatron's [s, b] token order
        probs, routing_map, self.losses = self.router(tokens, T)
        if not self.experts.pad_rows and self.experts.align_size:  # Megatron's dispatch_preprocess
            routing_map = self._routed_padding(routing_map)
        permuted, order = R.permute(tokens, routing_map)  # (M, C), M = sum of the map
        m_splits = routing_map.sum(dim=0).tolist()  # tokens per expert (a host sync, as Megatron's)
        out = self.experts(permuted, m_splits, R.permute_probs(probs, routing_map))
        y = R.unpermute(out, order, T * B).view(T, B, C).transpose(0, 1)  # (B, T, C)
        return y if shared is None else y + shared

    def _routed_padding(self, routing_map: torch.Tensor) -> torch.Tensor:
        """moe_router_padding_for_quantization: counts aligned by routing unrouted tokens at
        probability 0 (routing.pad_routing_map); the router's losses and bias counts keep the
        unpadded map. An expert left unaligned is an error, as TE's FP8/FP4 GEMMs refuse it."""
        align = self.experts.align_size
        padded = R.pad_routing_map(routing_map, align)
        counts = padded.sum(dim=0)
        if bool((counts % align).any()):
            e = int((counts % align).nonzero()[0])
            raise ValueError(
                f"model.moe_router_padding_for_quantization=true: expert {e} has {int(counts[e])} tokens "
                f"with every token of the micro-batch routed to it, not a multiple of {align}; use more "
                "tokens per micro-batch or set it false (zero rows instead)"
            )
        return padded

    def _shared(self, x16: torch.Tensor) -> torch.Tensor:
        out = self.shared_experts(x16)
        if self.shared_experts_gate is None:
            return out
        gate = R.RouterGating.apply(x16, self.shared_experts_gate, BF16)  # F.linear on bf16, as Megatron
        return out * torch.sigmoid(gate)

    def inactive_params(self) -> int:
        """Parameters a token does not use: the routed experts beyond its top-k."""
        per_expert = sum(p.numel() for p in self.experts.parameters()) // self.experts.num_experts
        return (self.experts.num_experts - self.topk) * per_expert


class Routing:
    """The training loop's handle on a model's MoE layers (none for a dense model: then every
    method is a no-op). Per micro-batch `take_losses` returns the objective's router term; per
    step `finish_step` updates the expert biases (Megatron's finalize_model_grads) and averages
    the logged losses; `metrics` holds them, by Megatron's names, averaged over the MoE layers.

    `observed` holds what an MoE user looks at, per MoE layer (`<name>_layer_<i>`, i the block's
    index: Megatron's per-layer names) and averaged over the MoE layers (`<name>`), for the step's
    global batch: each layer's router losses, the tokens per expert as max / mean
    (`tokens_per_expert_max_mean`, 1 when balanced), the fraction of experts without tokens
    (`experts_without_tokens`), the mean per-token entropy of the router's scores in nats
    (`router_entropy`, at most ln E), and with a capacity factor the fraction of the routed token
    slots dropped (`dropped_tokens`). They are device tensors: nothing here syncs with the host
    (the counts are summed over micro-batches on device and over ranks with the router losses)."""

    def __init__(self, model: nn.Module):
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
        self.layers = [m for _, m in named]
        self.indices = [_block_index(name, i) for i, (name, _) in enumerate(named)]
        self.experts = [layer.experts for layer in self.layers]
        self.metrics: dict[str, torch.Tensor] = {}
        self.observed: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._stats: torch.Tensor | None = None  # (layers, 2E + 2): routing_stats summed over the step

    @property
    def logged(self) -> dict[str, torch.Tensor]:
        """Everything the step logs under moe/: `metrics` and `observed`."""
        return {**self.metrics, **self.observed}

    def take_losses(self, accum: int) -> torch.Tensor | None:
        """The sum of the router losses of the forward just run (None where there are none); their
        logged values, averaged over the MoE layers (and per layer) and the `accum` micro-batches,
        are kept, and so are the routers' token counts."""
        terms = []
        for index, layer in zip(self.indices, self.layers):
            for name, (term, logged) in layer.losses.items():
                terms.append(term)
                self._add(name, logged / (len(self.layers) * accum))
                self._add(f"{name}_layer_{index}", logged / accum)
            layer.losses = {}
        stats = [layer.router.stats for layer in self.layers if layer.router.stats is not None]
        if stats:
            step = torch.stack(stats)
            self._stats = step if self._stats is None else self._stats + step
            for layer in self.layers:
                layer.router.stats = None
        return torch.stack([t.float() for t in terms]).sum() if terms else None

    def _add(self, name: str, value: torch.Tensor) -> None:
        self._pending[name] = self._pending[name] + value if name in self._pending else value

    def finish_step(self, all_reduce_sum, world: int) -> None:
        """After the step's last backward: expert biases moved by the token counts summed over the
        ranks, and the logged losses averaged and the token counts summed over the ranks into
        `metrics` and `observed`."""
        routers = [layer.router for layer in self.layers if layer.router.expert_bias is not None]
        if routers:
            counts = torch.stack([r.local_tokens_per_expert for r in routers])  # (layers, E)
            all_reduce_sum([counts])
            rate = routers[0].cfg.moe_router_bias_update_rate
            biases = R.updated_expert_bias(counts, torch.stack([r.expert_bias for r in routers]), rate)
            for r, bias in zip(routers, biases):
                r.expert_bias.copy_(bias)
                r.local_tokens_per_expert.zero_()
        pending, self._pending = self._pending, {}
        stats, self._stats = self._stats, None
        reduced = list(pending.values()) + ([stats] if stats is not None else [])
        if reduced:
            all_reduce_sum(reduced)  # one flat buffer
        values = {name: value / world for name, value in pending.items()}
        self.metrics = {name: v for name, v in values.items() if "_layer_" not in name}
        self.observed = {name: v for name, v in values.items() if "_layer_" in name}
        if stats is not None:
            dropping = self.layers[0].router.cfg.moe_expert_capacity_factor is not None
            self.observed.update(load_metrics(stats, self.indices, dropping))


def _block_index(name: str, order: int) -> int:
    """The block an MoE layer sits in (`blocks.3.mlp` -> 3); its order among the MoE layers else."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "blocks" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return order


def load_metrics(stats: torch.Tensor, indices: list[int], dropping: bool) -> dict[str, torch.Tensor]:
    """The load metrics of `Routing.observed` from routing_stats summed over a step, (layers, 2E + 2):
    per layer (`<name>_layer_<i>`) and their mean over the layers (`<name>`). A layer that kept no
    token has max / mean NaN."""
    E = (stats.shape[1] - 2) // 2
    kept, routed, entropy, tokens = stats[:, :E], stats[:, E : 2 * E], stats[:, -2], stats[:, -1]
    mean = kept.mean(dim=1)
    per_layer = {
        "tokens_per_expert_max_mean": kept.max(dim=1).values / mean,
        "experts_without_tokens": (kept == 0).float().mean(dim=1),
        "router_entropy": entropy / tokens,
    }
    if dropping:
        per_layer["dropped_tokens"] = 1 - kept.sum(dim=1) / routed.sum(dim=1)
    out = {}
    for name, values in per_layer.items():
        out[name] = values.mean()
        out.update({f"{name}_layer_{i}": v for i, v in zip(indices, values.unbind())})
    return out


def inactive_params(model: nn.Module) -> int:
    """Parameters of `model` that no token uses (FLOPs count the active ones only)."""
    return sum(m.inactive_params() for m in model.modules() if isinstance(m, MoE))
