"""Does harness.numerics.te_layernorm give TE's LayerNorm forward to the bit, and with FMAs where?

    python -m benchmarks.fidelity.layernorm_probe --spec fidelity_layernorm [--rows 4096]

For each hidden size, at `rows` (TE's tuned kernel where it has one) and `rows - 1` (its general
kernel), and three input kinds, it compares against TE's own LayerNorm (bf16 in and out): mu bit for
bit; rsigma for each choice of FMA at M2 += d*d and at rn*M2 + eps; the output computed from TE's mu
and rsigma with and without an FMA at gamma*y + beta; then the whole output with the best choices,
and torch's layer_norm for scale. The best FMA sites are stored and printed last (`fma_sites=...`):
where they differ from harness.numerics.te_layernorm.FMA_SITES, that default is what to change.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import specs

EPS = 1e-5


@dataclass(frozen=True)
class Options:
    rows: int = field(default=4096, metadata={"help": "rows; each hidden size also runs with rows - 1"})
    hidden: tuple[int, ...] = field(
        default=(64, 256, 768, 1024, 2048, 4096), metadata={"help": "hidden sizes"}
    )


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    return {}  # kernels only: no model config


def differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (same dtype sizes: bf16 with bf16, fp32 with fp32)."""
    as_int = {2: torch.int16, 4: torch.int32}
    return int(
        (a.contiguous().view(as_int[a.element_size()]) != b.contiguous().view(as_int[b.element_size()])).sum()
    )


def te_norm(x, w, b):
    """TE's LayerNorm forward as its modules call it: (out, mu, rsigma)."""
    from transformer_engine.pytorch.module._common import apply_normalization

    return apply_normalization(x, None, w, b, EPS, None, torch.bfloat16, "LayerNorm", 0, False)


def inputs(hidden: int, rows: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """randn, a shifted mean and a wide per-column range; bf16 gamma near 1 and a small beta."""
    g = torch.Generator(device="cuda").manual_seed(hidden)
    randn = lambda: torch.randn(rows, hidden, device="cuda", generator=g)  # noqa: E731
    cases = {"randn": randn(), "shifted": randn() * 0.05 + 1.5}
    cases["wide"] = randn() * torch.logspace(-3, 2, hidden, device="cuda")
    w = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    return cases, w, b


def probe_case(x: torch.Tensor, w, b, kernel: str) -> dict:
    """mu, rsigma under each FMA choice, and the output from TE's statistics, against TE's kernel."""
    from harness.numerics.te_layernorm import te_layer_norm, te_rsigma

    xb = x.bfloat16()
    out_te, mu_te, rs_te = te_norm(xb, w, b)
    x32, hidden = xb.float(), x.shape[-1]
    mu = te_rsigma(x32, EPS, frozenset())[0]
    r = {"elements": xb.numel(), "kernel": kernel, "mu_differ": differ(mu, mu_te.float().reshape(-1))}
    for m2, rsf in itertools.product((0, 1), (0, 1)):
        fma = frozenset(s for s, on in (("m2", m2), ("rs", rsf)) if on)
        rs = te_rsigma(x32, EPS, fma)[1]
        r[f"rsigma_differ[{','.join(sorted(fma)) or 'none'}]"] = differ(rs, rs_te.float().reshape(-1))
    for outf in (0, 1):
        fma = frozenset({"out"} if outf else ())
        y = te_layer_norm(x32, w.float(), b.float(), EPS, fma, stats=(mu_te, rs_te)).bfloat16()
        r[f"out_from_te_stats_differ[{'out' if outf else 'none'}]"] = differ(y, out_te)
    ref = torch.nn.functional.layer_norm(x32, (hidden,), w.float(), b.float(), EPS).bfloat16()
    r["torch_layer_norm_out_differ"] = differ(ref, out_te)
    return r


def best_sites(totals: dict) -> list[str]:
    """The FMA sites of the rsigma and output choices with the fewest differing elements."""
    pick = lambda prefix: min((k for k in totals if k.startswith(prefix)), key=lambda k: totals[k])  # noqa: E731
    sites = set()
    for k in (pick("rsigma"), pick("out_from")):
        sites |= set(k[k.index("[") + 1 : -1].split(","))
    return sorted(sites - {"none"})


def whole(shapes, sites: list[str]) -> dict:
    """The whole output with `sites`, on fresh inputs of every shape."""
    from harness.numerics.te_layernorm import te_layer_norm

    out = {}
    for hidden, rows in shapes:
        g = torch.Generator(device="cuda").manual_seed(hidden + 1)
        xb = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
        w = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
        b = (0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
        y = te_layer_norm(xb.float(), w.float(), b.float(), EPS, frozenset(sites)).bfloat16()
        out[f"whole/{hidden}x{rows}"] = differ(y, te_norm(xb, w, b)[0])
    return out


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    from harness.numerics.te_layernorm import kernel_layout

    res: dict = {"_meta": specs.meta(spec, opts), "rows": opts.rows}
    shapes = [(h, r) for h in opts.hidden for r in (opts.rows, opts.rows - 1)]  # rows % 4: tuned or general
    covered, totals = [], {}
    for hidden, rows in shapes:
        if kernel_layout(hidden, rows) is None:
            res[f"{hidden}x{rows}"] = "not covered by harness.numerics.te_layernorm"
            continue
        covered.append((hidden, rows))
        cases, w, b = inputs(hidden, rows)
        for name, x in cases.items():
            r = res[f"{hidden}x{rows}/{name}"] = probe_case(x, w, b, kernel_layout(hidden, rows)[0])
            for k in (k for k in r if "[" in k):  # the FMA choices, summed over every case
                totals[k] = totals.get(k, 0) + r[k]
            print(hidden, rows, name, json.dumps(r), flush=True)
        specs.write_json(out, res)
    res["totals"], res["best_fma_sites"] = totals, best_sites(totals)
    per_shape = whole(covered, res["best_fma_sites"])
    res |= per_shape
    res["whole_out_differ_total"] = sum(per_shape.values())
    specs.write_json(out, res)
    print("totals", json.dumps(totals), "whole", res["whole_out_differ_total"])
    print("fma_sites=" + ",".join(res["best_fma_sites"]))  # te_layernorm.FMA_SITES if they differ from it
    return res


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
