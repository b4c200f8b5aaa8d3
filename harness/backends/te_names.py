"""TEGPT parameter names <-> the emulated GPT's (the canonical names checkpoints are written in).

te.TransformerLayer(fuse_qkv_params=True) holds each block's parameters under its own module names;
the layouts are the same (QKV interleaved per head in both models), so only the names map.
"""

from __future__ import annotations

BLOCK_NAMES = {  # emulated Block module -> te.TransformerLayer parameter prefix
    "ln1": "self_attention.layernorm_qkv.layer_norm_",
    "attn.qkv": "self_attention.layernorm_qkv.",
    "attn.proj": "self_attention.proj.",
    "attn.q_norm": "self_attention.q_norm.",  # qk_layernorm (Qwen3): TE's per-head norms
    "attn.k_norm": "self_attention.k_norm.",
    "ln2": "layernorm_mlp.layer_norm_",
    "mlp.fc1": "layernorm_mlp.fc1_",
    "mlp.fc2": "layernorm_mlp.fc2_",
}


def te_name(name: str) -> str:
    """An emulated GPT parameter's name in TEGPT."""
    if not name.startswith("blocks."):
        return name  # wte, wpe, ln_f, lm_head: the same modules in both models
    _, i, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    if module not in BLOCK_NAMES or kind not in ("weight", "bias"):
        raise KeyError(f"{name}: no TE counterpart")
    return f"blocks.{i}.layer.{BLOCK_NAMES[module]}{kind}"


def canonical_name(name: str) -> str:
    """A TEGPT parameter's name in the emulated GPT (the inverse of te_name)."""
    if not name.startswith("blocks."):
        return name
    _, i, rest = name.split(".", 2)
    assert rest.startswith("layer."), name
    rest = rest[len("layer.") :]
    # longest prefix first: "layernorm_qkv.layer_norm_" before "layernorm_qkv."
    for module, prefix in sorted(BLOCK_NAMES.items(), key=lambda kv: -len(kv[1])):
        if rest.startswith(prefix) and rest[len(prefix) :] in ("weight", "bias"):
            return f"blocks.{i}.{module}.{rest[len(prefix) :]}"
    raise KeyError(f"{name}: no emulated counterpart")
