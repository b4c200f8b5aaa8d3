"""The Megatron-LM flags of the Llama/Qwen architecture fields (GQA, head size, RoPE theta and
Llama 3.1 scaling, tied embeddings, QK norm, QKV-only bias), kept apart from harness.interop.megatron's
recipe and run flags.

Megatron's defaults are lowp's defaults for GPT presets (MHA, hidden/heads, theta 10000, no QK
norm, no QKV bias), so a GPT config prints none of these; its one difference, tied embeddings, is
Megatron's default and lowp's opt-in (`untie_embeddings_and_output_weights`)."""

from __future__ import annotations

from harness.config.schema import ModelConfig

UNTIE = "--untie-embeddings-and-output-weights"
# Megatron's RotaryEmbedding._apply_scaling fixes Llama 3.1's other three parameters
MEGATRON_ROPE_FIXED = (1.0, 4.0, 8192)


def architecture_flags(m: ModelConfig, flags: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """`flags` (the shape flags, which always untie) with the architecture's own flags."""
    out = [f for f in flags if f[0] != UNTIE or m.untie_embeddings_and_output_weights]
    if m.num_query_groups is not None and m.num_query_groups != m.num_attention_heads:
        out += [("--group-query-attention", None), ("--num-query-groups", m.num_query_groups)]
    if m.kv_channels is not None and m.kv_channels != m.hidden_size // m.num_attention_heads:
        out.append(("--kv-channels", m.kv_channels))
    if m.rotary_base != 10000.0 and m.position_embedding == "rope":
        # Megatron parses --rotary-base as an int; every released theta is one
        assert float(m.rotary_base).is_integer(), m.rotary_base
        out.append(("--rotary-base", int(m.rotary_base)))
    if m.rope_scaling and m.position_embedding == "rope":
        fixed = (m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_position_embeddings)
        if fixed != MEGATRON_ROPE_FIXED:
            raise ValueError(
                f"model.rope_low_freq_factor/high_freq_factor/original_max_position_embeddings={fixed}: "
                f"Megatron-LM fixes them at {MEGATRON_ROPE_FIXED} and has no flags for them"
            )
        out += [("--use-rope-scaling", None), ("--rope-scaling-factor", m.rope_scaling_factor)]
    if m.qk_layernorm:
        out.append(("--qk-layernorm", None))
    if m.add_qkv_bias and not m.add_bias_linear:
        out.append(("--add-qkv-bias", None))
    return out
