"""The Megatron-LM flags of the Llama/Qwen architecture fields (GQA, head size, RoPE theta and
Llama 3.1 scaling, tied embeddings, QK norm, QKV-only bias), kept apart from harness.interop.megatron's
recipe and run flags.

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
