"""The TE MoE model against the emulated one, layer by layer (GPU with TE): both built from the same
bf16-valued weights (x4 the init, so that every part shapes the logits), every expert taking every
token (top-k = all: no routing decision for rounding to flip). Per variant of qwen3_moe_tiny it
writes the max |logit difference|, the emulated model's distance from its own fp32-GEMM evaluation
(the bf16 noise tests/test_hf_te_gpu.py bounds with), per block the max difference of the block
outputs, MoE outputs and pre-MoE norms, and block 0's MoE layer fed the same bf16 input on both.

    python -m benchmarks.moe_te_function [--out DIR]     -> DIR/moe_te_function.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

VARIANTS = {
    "A": ["model=qwen3_moe_tiny", "model.moe_router_topk=8"],
    "B_bf16router": ["model=qwen3_moe_tiny", "model.moe_router_topk=8", "model.moe_router_dtype=null"],
    "C_ffn128": ["model=qwen3_moe_tiny", "model.moe_router_topk=8", "model.moe_ffn_hidden_size=128"],
    "D_4exp": ["model=qwen3_moe_tiny", "model.num_moe_experts=4", "model.moe_router_topk=4"],
    "E_noqk": ["model=qwen3_moe_tiny", "model.moe_router_topk=8", "model.qk_layernorm=false"],
    "F_1layer": ["model=qwen3_moe_tiny", "model.moe_router_topk=8", "model.num_layers=1"],
}


def compare(over: list[str]) -> dict:
    from harness.interop.hf_weights import load_into
    from tests.test_hf_te_gpu import forward, forward_fp32
    from tests.test_moe_te_gpu import _built

    cfg, eb, emu = _built(over, "emulated")
    with torch.no_grad():
        for p in emu.parameters():
            p.copy_(p.to(torch.bfloat16).float() * 4)
    _, tb, te = _built(over, "te")
    load_into(te, {n: p.detach().clone() for n, p in emu.named_parameters()})
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 64), device="cuda")
    acts: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            acts[name] = (out[0] if isinstance(out, tuple) else out).detach().float()

        return hook

    pairs = []
    for i, (e, t) in enumerate(zip(emu.blocks, te.blocks)):
        mlp = t.layer.layernorm_mlp
        pairs += [(e, f"emu{i}"), (e.mlp, f"emu_mlp{i}"), (e.ln2, f"emu_ln2{i}")]
        pairs += [(t, f"te{i}"), (mlp, f"te_mlp{i}"), (mlp.norm, f"te_ln2{i}")]
    handles = [m.register_forward_hook(keep(name)) for m, name in pairs]
    a, b = forward(eb, emu, idx), forward(tb, te, idx)
    for h in handles:
        h.remove()
    r = {"logit_diff": (a - b).abs().max().item(), "noise": (a - forward_fp32(emu, idx)).abs().max().item()}
    for i in range(cfg.model.num_layers):
        for part in ("", "_mlp", "_ln2"):
            r[f"block{i}{part}"] = (acts[f"emu{part}{i}"] - acts[f"te{part}{i}"]).abs().max().item()
        r[f"mlp_mag{i}"] = acts[f"emu_mlp{i}"].abs().max().item()
    x = acts["emu_ln20"].to(torch.bfloat16)  # the same input to both MoE layers: the experts alone
    with torch.no_grad(), eb.autocast():
        ye = emu.blocks[0].mlp(x.float()).float()
    with torch.no_grad(), tb.autocast():
        yt = te.blocks[0].layer.layernorm_mlp.moe(x).float()
    r["moe_same_input"], r["moe_same_input_mag"] = (ye - yt).abs().max().item(), ye.abs().max().item()
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.moe_te_function", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = p.parse_args(argv)
    out = {}
    for name, over in VARIANTS.items():
        out[name] = compare(over)
        print(name, out[name], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "moe_te_function.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
