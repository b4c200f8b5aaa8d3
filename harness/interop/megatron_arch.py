"""The Megatron-LM flags of the Llama/Qwen architecture fields (GQA, head size, RoPE theta and
Llama 3.1 scaling, tied embeddings, QK norm, QKV-only bias) and of the mixture-of-experts fields,
kept apart from harness.interop.megatron's recipe and run flags.

Megatron's defaults are lowp's defaults for GPT presets (MHA, hidden/heads, theta 10000, no QK
norm, no QKV bias), so a GPT config prints none of these; its one difference, tied embeddings, is
Megatron's default and lowp's opt-in (`untie_embeddings_and_output_weights`)."""

from __future__ import annotations

from harness.config.errors import ConfigError
from harness.config.schema import ModelConfig

UNTIE = "--untie-embeddings-and-output-weights"
# Llama 3.1's other three parameters, as RotaryEmbedding fixes them: it passes only the factor to
# _apply_scaling (megatron/core/models/common/embeddings/rotary_pos_embedding.py:84,92-98)
MEGATRON_ROPE_FIXED = {
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position_embeddings": 8192,
}


def architecture_flags(m: ModelConfig, flags: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """`flags` (the shape flags) with the architecture's own flags; a ConfigError for a RoPE
    Megatron cannot express (the export's exit code 2: lowp trains it, Megatron has no flag for it)."""
    out = list(flags)
    if m.untie_embeddings_and_output_weights:
        out.append((UNTIE, None))
    if m.num_query_groups is not None and m.num_query_groups != m.num_attention_heads:
        out += [("--group-query-attention", None), ("--num-query-groups", m.num_query_groups)]
    if m.kv_channels is not None and m.kv_channels != m.hidden_size // m.num_attention_heads:
        out.append(("--kv-channels", m.kv_channels))
    if m.rotary_base != 10000.0 and m.position_embedding == "rope":
        if not float(m.rotary_base).is_integer():  # every released theta is one
            raise ConfigError(
                f"model.rotary_base={m.rotary_base!r}: Megatron-LM parses --rotary-base as an integer "
                "(arguments.py:2418); export with an integer base"
            )
        out.append(("--rotary-base", int(m.rotary_base)))
    if m.rope_scaling and m.position_embedding == "rope":
        odd = {k: getattr(m, k) for k, v in MEGATRON_ROPE_FIXED.items() if getattr(m, k) != v}
        if odd:
            fixed = tuple(MEGATRON_ROPE_FIXED.values())
            raise ConfigError(
                " ".join(f"model.{k}={v!r}" for k, v in odd.items())
                + ": Llama 3.1's low/high frequency factors and original context have no Megatron flags, "
                f"Megatron-LM fixes them at {fixed}; export with those values or model.rope_scaling=false"
            )
        out += [("--use-rope-scaling", None), ("--rope-scaling-factor", m.rope_scaling_factor)]
    if m.qk_layernorm:
        out.append(("--qk-layernorm", None))
    if m.add_qkv_bias and not m.add_bias_linear:
        out.append(("--add-qkv-bias", None))
    return out


# Megatron-LM's defaults for the MoE options printed only where lowp's differ
# (megatron/core/transformer/transformer_config.py, the fields behind these flags)
MOE_DEFAULTS = {"--moe-router-bias-update-rate": 1e-3, "--moe-layer-freq": 1}
# One expert-parallel rank: Megatron's all-to-all dispatcher permutes the tokens by expert as lowp
# does and its all-to-all is the identity. The allgather dispatcher would permute the same way, but
# Megatron refuses it with --moe-router-padding-for-quantization (transformer_config.py:2655-2659),
# and alltoall is what Megatron's MoE examples (Mixtral, Qwen3-MoE, DeepSeek-V3) use.
MOE_DISPATCHER = "alltoall"


def moe_flags(m: ModelConfig) -> list[tuple[str, object]]:
    """The MoE flags (megatron/training/arguments.py `_add_moe_args`, and the TransformerConfig MoE
    fields its ArgumentGroupFactory turns into flags); none for a dense model. The experts' shape,
    router and balancing always; the options where set. lowp's experts are TE's GroupedLinear, which
    Megatron builds with --moe-grouped-gemm (TEGroupedMLP)."""
    if m.num_moe_experts is None:
        return []
    out: list[tuple[str, object]] = [
        ("--num-experts", m.num_moe_experts),
        ("--moe-ffn-hidden-size", m.moe_ffn_hidden_size or m.ffn_hidden_size),  # Megatron's null too
        ("--moe-router-topk", m.moe_router_topk),
        ("--moe-grouped-gemm", None),
        ("--moe-token-dispatcher-type", MOE_DISPATCHER),
        ("--moe-router-score-function", m.moe_router_score_function),
        ("--moe-router-load-balancing-type", m.moe_router_load_balancing_type),
        ("--moe-aux-loss-coeff", float(m.moe_aux_loss_coeff)),
    ]
    shared = m.moe_shared_expert_intermediate_size is not None
    switches = {
        "--moe-router-pre-softmax": m.moe_router_pre_softmax,
        "--moe-router-enable-expert-bias": m.moe_router_enable_expert_bias,
        "--moe-shared-expert-gate": m.moe_shared_expert_gate and shared,
        "--moe-router-padding-for-quantization": m.moe_router_padding_for_quantization,
    }
    out += [(flag, None) for flag, on in switches.items() if on]
    values = {
        "--moe-router-topk-scaling-factor": _float(m.moe_router_topk_scaling_factor),
        "--moe-z-loss-coeff": _float(m.moe_z_loss_coeff),
        "--moe-shared-expert-intermediate-size": m.moe_shared_expert_intermediate_size,
        "--moe-router-dtype": m.moe_router_dtype,
        "--moe-expert-capacity-factor": _float(m.moe_expert_capacity_factor),  # drop policy `probs` both
    }
    out += [(flag, v) for flag, v in values.items() if v is not None]
    rate = float(m.moe_router_bias_update_rate)
    if m.moe_router_enable_expert_bias and rate != MOE_DEFAULTS["--moe-router-bias-update-rate"]:
        out.append(("--moe-router-bias-update-rate", rate))
    if m.moe_layer_freq != MOE_DEFAULTS["--moe-layer-freq"]:
        out.append(("--moe-layer-freq", moe_layer_freq_arg(m.moe_layer_freq)))
    return out


def _float(v) -> float | None:
    """A float field as a float (a YAML `2` is an int), so that it prints as its exact repr."""
    return None if v is None else float(v)


def moe_layer_freq_arg(freq) -> str | int:
    """An int as itself; a 0/1 list as the Python list `moe_freq_type` evaluates (arguments.py:327-350:
    digits, commas and brackets only, no spaces)."""
    if isinstance(freq, int):
        return freq
    return "[" + ",".join(str(int(v)) for v in freq) + "]"
