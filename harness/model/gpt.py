"""A precision-agnostic GPT: pre-norm blocks, causal attention, GELU or SwiGLU MLP.

The model never sees a recipe. Every GEMM that a recipe may quantize is built by
`ops.linear(name, ...)`, the MLP activation by `ops.activation(name, ...)` and each norm by
`ops.norm(name, ...)`; the backend decides what those modules do (plain BF16, emulated FP8/FP4,
or TE). Names are the modules' qualified names in this model, so stability overrides (`blocks.0.*`)
and telemetry rows match what `named_modules()` prints.
A backend may also replace whole blocks (TE's fused TransformerLayer) through `blocks=`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.config.schema import ModelConfig
from harness.model.loss import chunked_linear_cross_entropy, loss_fn
from harness.model.moe import MoE, inactive_params, moe_layer_pattern
from harness.numerics import fast


class Ops(Protocol):
    """What a backend provides to build the quantizable parts of the model."""

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module: ...

    def grouped_linear(self, name: str, num_gemms: int, in_features: int, out_features: int) -> nn.Module:
        """MoE experts' linears (harness.model.moe.ExpertOps)."""
        ...

    def activation(self, name: str, kind: str) -> nn.Module: ...

    def norm(self, name: str, cfg: ModelConfig) -> nn.Module: ...


def bf16_values(x: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor rounded to bf16 values, kept in fp32 storage (a bf16 tensor passes unchanged).

    TE's bf16 TransformerLayer holds the embeddings, the residual stream and the norm parameters in
    bf16; the emulated GPT (fp32 masters, fp32 storage for speed on CPUs) holds the same values."""
    return x.to(torch.bfloat16).float() if x.dtype == torch.float32 else x


def residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """bf16_values(x + y): the residual stream's add, rounded to bf16 values (TE's bf16 add, which
    adds in fp32 and rounds). For fp32 storage on CUDA, one fused pass forward and one backward
    with the same values (the add and the two casts were three passes each way, twice a layer)."""
    if x.is_cuda and x.dtype == torch.float32:
        return _BF16Residual.apply(x, y)
    return bf16_values(x + y)


def _round_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return fast.bf16_round(x + y)  # == (x + y).to(bf16).float(), in a form no compiler folds


def _round_grad(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fast.bf16_round(g), g.to(torch.bfloat16)


class _BF16Residual(torch.autograd.Function):
    """bf16_values(x + y) with autograd's own backward values: the gradient rounded to bf16 (the
    backward of the two casts), fp32 storage for x's, y's dtype for y's."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.y_dtype = y.dtype
        return _fused(_round_sum, x)(x, y)

    @staticmethod
    def backward(ctx, g):
        gx, g16 = _fused(_round_grad, g)(g)
        return gx, (g16 if ctx.y_dtype == torch.bfloat16 else gx.to(ctx.y_dtype))


def _fused(fn, like: torch.Tensor):
    """fn compiled for CUDA tensors (harness.numerics.fast.compiled: eager where it cannot be);
    eager elsewhere."""
    return fast.compiled(fn, "cuda", True) if like.is_cuda else fn


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 from bf16 values of x and of its parameters, as TE's kernel does;
    the output stays fp32 (the consumer rounds it, or, where TE fuses the cast, quantizes it).
    The emulated backend's norm also follows TE's reduction order where it can
    (harness.backends.emulated.TEOrderLayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = bf16_values(self.weight)
        b = bf16_values(self.bias) if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class RMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, bf16_values(self.weight), self.eps)


def norm(cfg: ModelConfig, layer_norm: type[nn.LayerNorm] = LayerNorm, dim: int | None = None) -> nn.Module:
    """The model's norm over `dim` features (default the model width; QK norm: the head size);
    `layer_norm`: the LayerNorm class a backend uses."""
    dim = dim or cfg.hidden_size
    if cfg.normalization == "LayerNorm":
        return layer_norm(dim, eps=cfg.layernorm_epsilon)
    if cfg.normalization == "RMSNorm":
        return RMSNorm(dim, eps=cfg.layernorm_epsilon)
    raise ValueError(f"model.normalization={cfg.normalization}: use LayerNorm or RMSNorm")


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (D/2,) in fp32 on the CPU, theta^(-2i/D), for both backends (TE's
    RotaryPositionEmbedding gets them too). model.rope_scaling: Llama 3.1's scaling, in the
    operations of transformers' _compute_llama3_parameters (Megatron's _apply_scaling is the same):
    wavelengths above original/low_freq_factor divided by the factor, below original/high_freq_factor
    kept, interpolated between."""
    D = head_dims(cfg)[2]
    inv_freq = 1.0 / cfg.rotary_base ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    if not cfg.rope_scaling:
        return inv_freq
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_cache(seq_len: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); rotate pairs (x1, x2) of the two halves, in fp32 for accuracy
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """SDPA in the operands' dtype; on a CPU in fp32 (no fast bf16 kernel there), rounded back.
    `causal=False`: every position attends to every other (a masked-diffusion model's attention).
    On CUDA cuDNN's fused attention comes first where it applies: TE's DotProductAttention runs
    cuDNN's on Hopper too, and at the 1.4B shape it is faster than the flash kernel (H200: 26.5 vs
    47.5 ms a step, benchmarks/RESULTS.md)."""
    if q.is_cuda:
        with _cuda_sdpa_order():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    return y.to(q.dtype)


def _cuda_sdpa_order():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    order += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without priorities: its own order
        return contextlib.nullcontext()


def head_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query heads H, key/value groups G, head size D): Megatron's num_query_groups, kv_channels."""
    heads = cfg.num_attention_heads
    return heads, cfg.num_query_groups or heads, cfg.kv_channels or cfg.hidden_size // heads


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads, optional QK norm (before RoPE, as Megatron's
    qk_layernorm and Qwen3) and optional QKV-only bias (Megatron's add_qkv_bias, Qwen2).
    `causal` False (harness.model.objective.set_causal): bidirectional, as a masked-diffusion LM."""

    causal = True

    def __init__(self, cfg: ModelConfig, ops: Ops, prefix: str):
        super().__init__()
        self.n_head, self.n_group, self.head_dim = H, G, D = head_dims(cfg)
        h = cfg.hidden_size
        self.qkv = ops.linear(f"{prefix}.qkv", h, (H + 2 * G) * D, cfg.add_bias_linear or cfg.add_qkv_bias)
        self.proj = ops.linear(f"{prefix}.proj", H * D, h, cfg.add_bias_linear)
        # over each head (TE's q_norm/k_norm are plain te.RMSNorm/LayerNorm modules, not fused)
        self.q_norm = norm(cfg, dim=D) if cfg.qk_layernorm else None
        self.k_norm = norm(cfg, dim=D) if cfg.qk_layernorm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        H, G, D = self.n_head, self.n_group, self.head_dim
        # rows per query group [its H/G queries, key, value], as Megatron and TE (interleaved) lay them
        # out; with G == H this is [q k v] per head, the same views (and strides) as plain MHA
        qkv = self.qkv(x).view(B, T, G, H // G + 2, D)
        # one split, not three index ops: its backward is one concatenation where three selects
        # would each fill a zero tensor of qkv's size and add them up
        q, k, v = qkv.split([H // G, 1, 1], dim=3)
        q = q.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)  # (B, G, T, D)
        if self.q_norm is not None:  # in fp32 from the bf16 values, the output rounded (TE's RMSNorm)
            q, k = self.q_norm(q.float()).to(q.dtype), self.k_norm(k.float()).to(k.dtype)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        if G != H:  # each group's key/value serves its H/G query heads
            k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
        y = causal_attention(q, k, v, self.causal)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, prefix: str, ffn_hidden_size: int | None = None):
        """`ffn_hidden_size`: the width, if not model.ffn_hidden_size (an MoE layer's shared expert)."""
        super().__init__()
        h, f = cfg.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        gated = cfg.activation == "swiglu"
        # SwiGLU: one fused fc1 producing both the gate and the value (Megatron's layout)
        self.fc1 = ops.linear(f"{prefix}.fc1", h, 2 * f if gated else f, cfg.add_bias_linear)
        self.act = ops.activation(f"{prefix}.act", cfg.activation)
        self.fc2 = ops.linear(f"{prefix}.fc2", f, h, cfg.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, index: int):
        super().__init__()
        prefix = f"blocks.{index}"
        self.ln1 = ops.norm(f"{prefix}.ln1", cfg)
        self.attn = Attention(cfg, ops, f"{prefix}.attn")
        self.ln2 = ops.norm(f"{prefix}.ln2", cfg)
        self.mlp = block_mlp(cfg, ops, f"{prefix}.mlp", moe_layer_pattern(cfg)[index] == 1)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        # the residual stream holds bf16 values, as in TE's bf16 TransformerLayer
        x = residual_add(x, self.attn(self.ln1(x), rope))
        return residual_add(x, self.mlp(self.ln2(x)))


def block_mlp(cfg: ModelConfig, ops: Ops, prefix: str, moe: bool) -> nn.Module:
    """The block's dense MLP, or its MoE layer (with its shared expert, a dense MLP, if it has one)."""
    if not moe:
        return MLP(cfg, ops, prefix)
    shared_size = cfg.moe_shared_expert_intermediate_size
    shared = MLP(cfg, ops, f"{prefix}.shared_experts", shared_size) if shared_size else None
    return MoE(cfg, ops, prefix, shared)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, blocks: nn.ModuleList | None = None):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = (
            nn.Embedding(cfg.seq_length, cfg.hidden_size) if cfg.position_embedding == "learned" else None
        )
        self.blocks = (
            blocks if blocks is not None else nn.ModuleList(Block(cfg, ops, i) for i in range(cfg.num_layers))
        )
        self.ln_f = ops.norm("ln_f", cfg)
        # the LM head stays in high precision under every recipe (docs/numerics.md section 1); tied, it is
        # the embedding matrix itself (one parameter, named wte.weight)
        self.lm_head = ops.linear("lm_head", cfg.hidden_size, cfg.vocab_size, False)
        if not cfg.untie_embeddings_and_output_weights:
            self.lm_head.weight = self.wte.weight
        if cfg.position_embedding == "rope":
            cos, sin = rope_cache(cfg.seq_length, rope_inv_freq(cfg))
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_method_std
        # GPT-2 style: residual output projections scaled by 1/sqrt(2 * layers)
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            if name.startswith("blocks.") and not _is_plain_block_param(name):
                continue  # a backend's own blocks (TE) keep their initialisation
            # routed and shared experts' fc2 too (Megatron's output_layer_init_method)
            is_out = name.endswith(("attn.proj.weight", "mlp.fc2.weight", "experts.fc2.weight"))
            nn.init.normal_(p, mean=0.0, std=out_std if is_out else std)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(idx))  # (B, T, V)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy; with model.lm_head_loss_chunks > 0 the LM head and the
        loss run fused in chunks of tokens (harness.model.loss), never holding the whole logits."""
        h = self.hidden(idx)
        chunks = self.cfg.lm_head_loss_chunks
        if chunks > 0:  # the LM head has no bias
            return chunked_linear_cross_entropy(h, self.lm_head.weight, targets, chunks)
        return loss_fn(self.lm_head(h), targets, fused=self.cfg.cross_entropy_loss_fusion)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, T, C): everything before the LM head."""
        B, T = idx.shape
        x = bf16_values(self.wte(idx))  # (B, T, C): bf16 values (TE: bf16 embeddings)
        if self.wpe is not None:
            x = bf16_values(x + bf16_values(self.wpe.weight[:T]))
        rope = (self.rope_cos, self.rope_sin) if self.wpe is None else None
        for block in self.blocks:
            x = block(x, rope) if isinstance(block, Block) else block(x)
        return self.ln_f(x)


def _is_plain_block_param(name: str) -> bool:
    plain = (".attn.qkv.", ".attn.proj.", ".mlp.fc1.", ".mlp.fc2.", ".mlp.router.", ".mlp.experts.")
    return any(part in name for part in plain) or ".mlp.shared_experts" in name


def count_params(model: nn.Module) -> dict[str, int]:
    """Parameter counts; `active_non_embedding` is N of the 6*N*tokens FLOP count (anchors.md):
    `non_embedding` less the routed experts a token does not use (each MoE layer's E - k)."""
    total = sum(p.numel() for p in model.parameters())
    # a tied embedding is also the LM head, whose GEMM is in 6*N: only an untied one is left out
    cfg = getattr(model, "cfg", None)
    tied = cfg is not None and not cfg.untie_embeddings_and_output_weights
    skip = ("wpe.",) if tied else ("wte.", "wpe.")
    emb = sum(p.numel() for n, p in model.named_parameters() if n.startswith(skip))
    non_embedding = total - emb
    return {
        "total": total,
        "non_embedding": non_embedding,
        "active_non_embedding": non_embedding - inactive_params(model),
    }


def flops_per_token(cfg: ModelConfig, non_embedding_params: int, causal: bool = True) -> float:
    """Model FLOPs per token: 6*N + causal attention 6*L*h*seq (anchors.md's count; full attention,
    `causal=False`, twice that: 12*L*h*seq, Megatron's count without the causal halving), h the width of
    the attention (heads x head size: the model width unless kv_channels says otherwise). For an MoE
    model N is the parameters a token uses (count_params' active_non_embedding): its top-k routed
    experts, the shared expert and the router, as Megatron's num_floating_point_operations counts
    the top-k and shared experts (which leaves out the router's h x E GEMM and the norms, in lowp's 6N)."""
    heads, _, head_dim = head_dims(cfg)
    attention = 6 if causal else 12
    return 6 * non_embedding_params + attention * cfg.num_layers * heads * head_dim * cfg.seq_length
