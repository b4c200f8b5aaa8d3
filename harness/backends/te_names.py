"""TEGPT parameter names <-> the emulated GPT's (the canonical names checkpoints are written in).

te.TransformerLayer(fuse_qkv_params=True) holds each block's parameters under its own module names;
the layouts are the same (QKV interleaved per head in both models), so only the names map. An MoE
block's LayerNormMLP is harness.backends.te_moe.TEMoEMLP: its norm is `layernorm_mlp.norm` and its
MoE layer `layernorm_mlp.moe`, whose parameters and buffers have the emulated model's names.
"""

from __future__ import annotations

from collections.abc import Iterable

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
MOE_NORM, MOE_MLP = "layernorm_mlp.norm.", "layernorm_mlp.moe."  # an MoE block's ln2 and mlp


def moe_blocks(names: Iterable[str]) -> set[int]:
    """The blocks that are MoE blocks, read from an emulated model's names (each has a router)."""
    return {int(n.split(".")[1]) for n in names if n.startswith("blocks.") and ".mlp.router." in n}


def te_name(name: str, moe: bool = False) -> str:
    """An emulated GPT parameter's name in TEGPT; `moe`: its block is an MoE block (moe_blocks)."""
    if not name.startswith("blocks."):
        return name  # wte, wpe, ln_f, lm_head: the same modules in both models
    _, i, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    if moe and rest.startswith("mlp."):
        return f"blocks.{i}.layer.{MOE_MLP}{rest[len('mlp.') :]}"
    if moe and module == "ln2":
        return f"blocks.{i}.layer.{MOE_NORM}{kind}"
    if module not in BLOCK_NAMES or kind not in ("weight", "bias"):
        raise KeyError(f"{name}: no TE counterpart")
    return f"blocks.{i}.layer.{BLOCK_NAMES[module]}{kind}"


def te_names(names: Iterable[str]) -> dict[str, str]:
    """Each of an emulated model's names (all of them, so its MoE blocks are known) in TEGPT."""
    names = list(names)
    moe = moe_blocks(names)
    return {n: te_name(n, n.startswith("blocks.") and int(n.split(".")[1]) in moe) for n in names}


def canonical_name(name: str) -> str:
    """A TEGPT parameter's name in the emulated GPT (the inverse of te_name)."""
    if not name.startswith("blocks."):
        return name
    _, i, rest = name.split(".", 2)
    assert rest.startswith("layer."), name
    rest = rest[len("layer.") :]
    if rest.startswith(MOE_MLP):
        return f"blocks.{i}.mlp.{rest[len(MOE_MLP) :]}"
    if rest.startswith(MOE_NORM) and rest[len(MOE_NORM) :] in ("weight", "bias"):
        return f"blocks.{i}.ln2.{rest[len(MOE_NORM) :]}"
    # longest prefix first: "layernorm_qkv.layer_norm_" before "layernorm_qkv."
    for module, prefix in sorted(BLOCK_NAMES.items(), key=lambda kv: -len(kv[1])):
        if rest.startswith(prefix) and rest[len(prefix) :] in ("weight", "bias"):
            return f"blocks.{i}.{module}.{rest[len(prefix) :]}"
    raise KeyError(f"{name}: no emulated counterpart")
