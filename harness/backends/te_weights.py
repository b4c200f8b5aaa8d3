"""An emulated GPT's weights in a TE GPT (`TEGPT`): parameter names, the fused QKV layout, the copy.

TE 2.20.2's `te.TransformerLayer(fuse_qkv_params=True)` names its parameters
`self_attention.layernorm_qkv.{layer_norm_weight, layer_norm_bias, weight, bias}`,
`self_attention.proj.{weight, bias}` and `layernorm_mlp.{layer_norm_weight, layer_norm_bias,
fc1_weight, fc1_bias, fc2_weight, fc2_bias}`; the embeddings, final norm and LM head are the same
modules in both models. lowp's QKV rows already have TE's per-head layout (qkv_weight_interleaved), so
the copy is a rename. Used to start both backends from the same weights (benchmarks/fidelity/) and
checked without TE by tests/numerics/test_te_mapping.py.
"""

from __future__ import annotations

import torch

from harness.backends.te_names import te_name as te_param_name  # noqa: F401 - the one map of TE names
from harness.backends.te_names import te_names


def qkv_interleave(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows [q; k; v] (heads inside each) -> the per-head layout [h0: q k v, h1: q k v, ...] that TE's
    qkv_weight_interleaved and lowp's GPT both use; only the scrambled control needs it."""
    d = t.shape[0] // (3 * n_head)
    return t.reshape(3, n_head, d, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def te_state_from_emulated(sd: dict, n_head: int, interleave: bool = False) -> dict:
    """An emulated GPT state_dict in TEGPT's parameter names and layouts (values unchanged)."""
    out, names = {}, te_names(sd)
    for name, t in sd.items():
        if interleave and ".attn.qkv." in name:  # weight and bias
            t = qkv_interleave(t, n_head)
        out[names[name]] = t
    return out


def round_to_bf16_(model: torch.nn.Module) -> None:
    """The emulated fp32 weights onto the bf16 grid, so the TE model can hold them exactly."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def load_into_te(te_model: torch.nn.Module, sd: dict, n_head: int, interleave: bool = False) -> int:
    """Copy an emulated state_dict into a TE model; every TE parameter must get exactly one source.
    Returns the number of parameters copied."""
    mapped = te_state_from_emulated(sd, n_head, interleave)
    params = dict(te_model.named_parameters())
    missing, unused = sorted(set(params) - set(mapped)), sorted(set(mapped) - set(params))
    if missing or unused:
        raise KeyError(f"TE params without a source: {missing}; unused emulated tensors: {unused}")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != mapped[name].shape:
                raise ValueError(f"{name}: TE {tuple(p.shape)} vs {tuple(mapped[name].shape)}")
            p.copy_(mapped[name].to(p.device, p.dtype))
    return len(params)
