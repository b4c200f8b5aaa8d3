"""On a GPU with TE: does harness.numerics.te_layernorm give TE's LayerNorm to the bit, and with FMAs where?

For each tuned hidden size it compares, against tex.layernorm_fwd (bf16 in and out):
- mu, bit for bit;
- rsigma, for each choice of FMA at M2 += d*d and at rn*M2 + eps;
- the output computed from TE's own mu and rsigma, with and without an FMA at gamma*y + beta;
- the whole output with the best choices.
It writes OUT/te_layernorm_probe.json and prints the best FMA sites as LOWP_TE_LN_FMA=... (last line).

    python scripts/te_layernorm_probe.py [--rows 4096]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch


def differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (same dtype sizes: bf16 with bf16, fp32 with fp32)."""
    as_int = {2: torch.int16, 4: torch.int32}
    return int(
        (a.contiguous().view(as_int[a.element_size()]) != b.contiguous().view(as_int[b.element_size()])).sum()
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4096, help="rows; each hidden size also runs with rows - 1")
    p.add_argument("--hidden", default="64,256,768,1024,2048,4096")
    args = p.parse_args()
    from transformer_engine.pytorch.module._common import apply_normalization

    from harness.numerics.te_layernorm import kernel_layout, te_layer_norm, te_rsigma

    eps = 1e-5
    res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": args.rows}
    totals: dict = {}
    shapes = [(int(h), r) for h in args.hidden.split(",") for r in (args.rows, args.rows - 1)]
    for hidden, rows in shapes:  # rows % 4 != 0: TE's general kernel instead of the tuned one
        if kernel_layout(hidden, rows) is None:
            res[f"{hidden}x{rows}"] = "not covered by harness.numerics.te_layernorm"
            continue
        g = torch.Generator(device="cuda").manual_seed(hidden)
        cases = {
            "randn": torch.randn(rows, hidden, device="cuda", generator=g),
            "shifted": torch.randn(rows, hidden, device="cuda", generator=g) * 0.05 + 1.5,
            "wide": torch.randn(rows, hidden, device="cuda", generator=g)
            * torch.logspace(-3, 2, hidden, device="cuda"),
        }
        w = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
        b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
        for name, x in cases.items():
            xb = x.bfloat16()
            out_te, mu_te, rs_te = apply_normalization(
                xb, None, w, b, eps, None, torch.bfloat16, "LayerNorm", 0, False
            )
            r = {"elements": xb.numel(), "kernel": kernel_layout(hidden, rows)[0]}
            x32 = xb.float()
            mu, _ = te_rsigma(x32, eps, frozenset())
            r["mu_differ"] = differ(mu, mu_te.float().reshape(-1))
            for m2, rsf in itertools.product((0, 1), (0, 1)):
                fma = frozenset(s for s, on in (("m2", m2), ("rs", rsf)) if on)
                rs = te_rsigma(x32, eps, fma)[1]
                r[f"rsigma_differ[{','.join(sorted(fma)) or 'none'}]"] = differ(rs, rs_te.float().reshape(-1))
            for outf in (0, 1):
                fma = frozenset({"out"} if outf else ())
                y = te_layer_norm(x32, w.float(), b.float(), eps, fma, stats=(mu_te, rs_te)).bfloat16()
                r[f"out_from_te_stats_differ[{'out' if outf else 'none'}]"] = differ(y, out_te)
            r["torch_layer_norm_out_differ"] = differ(
                torch.nn.functional.layer_norm(x32, (hidden,), w.float(), b.float(), eps).bfloat16(), out_te
            )
            res[f"{hidden}x{rows}/{name}"] = r
            for k, v in r.items():
                if "[" in k:
                    totals[k] = totals.get(k, 0) + v
            print(hidden, rows, name, json.dumps(r), flush=True)
    best_rs = min((k for k in totals if k.startswith("rsigma")), key=lambda k: totals[k])
    best_out = min((k for k in totals if k.startswith("out_from")), key=lambda k: totals[k])
    sites = sorted(
        set(best_rs[best_rs.index("[") + 1 : -1].split(","))
        | set(best_out[best_out.index("[") + 1 : -1].split(","))
    )
    sites = [s for s in sites if s != "none"]
    res["totals"], res["best_fma_sites"] = totals, sites
    whole = 0
    for hidden, rows in shapes:
        if kernel_layout(hidden, rows) is None:
            continue
        g = torch.Generator(device="cuda").manual_seed(hidden + 1)
        xb = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
        w = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
        b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
        out_te = apply_normalization(xb, None, w, b, eps, None, torch.bfloat16, "LayerNorm", 0, False)[0]
        y = te_layer_norm(xb.float(), w.float(), b.float(), eps, frozenset(sites)).bfloat16()
        res[f"whole/{hidden}x{rows}"] = n = differ(y, out_te)
        whole += n
    res["whole_out_differ_total"] = whole
    out = Path(os.environ.get("OUT", "."))
    (out / "te_layernorm_probe.json").write_text(json.dumps(res, indent=1))
    print("totals", json.dumps(totals), "whole", whole)
    print("LOWP_TE_LN_FMA=" + ",".join(sites))


if __name__ == "__main__":
    main()
