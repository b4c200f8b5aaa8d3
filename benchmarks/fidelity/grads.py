"""Step-0 gradients, emulated vs TE vs TE BF16 from the same weights and batch; and TE's own
sensitivity: how far its curve and gradients move when 0.1% of the weights move one bf16 ulp (the
floor below which no emulator can hold TE's curve, since its GEMMs' rounding differs by about that)."""

from __future__ import annotations

import torch

from analysis.fidelity import rel
from benchmarks.fidelity.common import Setup, curve, emulated_start, load_weights
from harness.backends.te_names import te_names


def bump_ulps(sd: dict, frac: float = 1e-3, seed: int = 0) -> dict:
    """A copy of a bf16-valued state_dict with a random `frac` of every matrix's elements moved one
    bf16 ulp away from zero: a perturbation of about the size by which two GEMM orders differ."""
    gen, out = torch.Generator().manual_seed(seed), {}
    for name, t in sd.items():
        if t.dim() < 2 or not t.is_floating_point():
            out[name] = t
            continue
        bits = t.to(torch.bfloat16).view(torch.int16).clone()
        pick = torch.rand(t.shape, generator=gen) < frac
        bits[pick] += 1  # sign-magnitude: +1 on the bits is one ulp further from zero either side
        out[name] = bits.view(torch.bfloat16).to(t.dtype)
    return out


def step0_grads(setup: Setup, overrides: list[str], weights: dict) -> dict:
    """One forward and backward of the first batch from `weights`: the loss and every parameter's
    gradient as the optimizer would read it (fp32 main_grad where there is one), by emulated name."""
    tr = setup.trainer(*overrides)
    load_weights(tr, weights)
    te = tr.backend.name == "te"
    names = {t: n for n, t in te_names(weights).items()} if te else {n: n for n in weights}
    tr.backend.microbatch(0, 1)
    x, y = tr._next_batch()
    with tr.backend.autocast():
        loss = tr.model.loss(x, y)
    loss.backward()
    tr.backend.microbatch(None, 1)
    grads = {}
    for name, p in tr.model.named_parameters():
        g = p.main_grad if hasattr(p, "main_grad") else p.grad
        grads[names[name]] = g.detach().float().cpu()
    return {"loss": float(loss.detach()), "grads": grads}


def compare_grads(setup: Setup, recipe: str) -> dict:
    """Per parameter: rel(emu, te) = |g_emu - g_te| / |g_te|; rel(te, bf16) and rel(emu, bf16), how far
    each backend's quantized gradient is from the unquantized one; |g_emu| / |g_te|. An operand that
    one backend quantizes and the other does not shows as rel(emu, bf16) far from rel(te, bf16)."""
    sd = emulated_start(setup, recipe)[1]
    em = step0_grads(setup, [f"recipe={recipe}", "backend=emulated"], sd)
    te = step0_grads(setup, [f"recipe={recipe}", "backend=te"], sd)
    ref = step0_grads(setup, ["recipe=bf16", "backend=te"], sd)
    rows = []
    for name, g in te["grads"].items():
        ge, gr = em["grads"][name], ref["grads"][name]
        rows.append([name, rel(ge, g), rel(g, gr), rel(ge, gr), float(ge.norm() / g.norm().clamp_min(1e-30))])
    worst = sorted(rows, key=lambda r: r[1] / max(r[2], 1e-12), reverse=True)[:8]
    med = lambda i: float(torch.tensor([r[i] for r in rows]).median())  # noqa: E731
    return {
        "loss": {"emulated": em["loss"], "te": te["loss"], "te_bf16": ref["loss"]},
        "median_rel_emu_te": med(1),
        "median_rel_te_bf16": med(2),
        "median_rel_emu_bf16": med(3),
        "median_norm_ratio_emu_te": med(4),
        "params_with_rel_emu_te_over_half_rel_te_bf16": sum(r[1] > 0.5 * r[2] for r in rows),
        "params": len(rows),
        "worst": worst,  # by rel(emu, te) / rel(te, bf16)
        "rows": rows,  # [name, rel(emu, te), rel(te, bf16), rel(emu, bf16), |g_emu| / |g_te|]
    }


def sensitivity(setup: Setup, recipe: str, steps: int) -> dict:
    """TE's curve from the shared weights and from the same weights with 0.1% one ulp off, their
    gaps, and the step-0 gradient difference that perturbation makes (to set beside compare_grads')."""
    sd = emulated_start(setup, recipe)[1]
    bumped = bump_ulps(sd)
    ov = [f"recipe={recipe}", "backend=te"]
    a, b = curve(setup, ov, steps, sd), curve(setup, ov, steps, bumped)
    ga, gb = step0_grads(setup, ov, sd)["grads"], step0_grads(setup, ov, bumped)["grads"]
    diffs = {
        k: [[s, abs(va - vb)] for (s, va), (_, vb) in zip(a[k], b[k], strict=True)] for k in ("train", "eval")
    }
    return {
        "te": a,
        "te_bumped": b,
        "abs_diff": diffs,
        "max_abs_diff": {k: max(v for _, v in d) for k, d in diffs.items()},
        "median_rel_grad_bumped_vs_te": float(torch.tensor([rel(gb[n], ga[n]) for n in ga]).median()),
    }
