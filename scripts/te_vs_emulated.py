"""TE vs the emulator from the same weights: step-0 operands bit for bit, loss curves vs two BF16 seeds.

    OUT=/some/dir python scripts/te_vs_emulated.py [--steps 300] [--recipes tensorwise,delayed,blockwise]
        [--parts mapping,operands,curves,grads,sensitivity] [--pair-seeds 1,2] [--no-bf16-pair] [override ...]

Issue 3's GPU criteria on gpt_small / markov / hardware=auto. The emulated GPT's weights, rounded to
bf16 (so both backends hold them exactly), are copied into the TE model (TE's names, interleaved QKV).
Each part is wrapped so one failure does not stop the others; $OUT/te_vs_emulated.json is rewritten
after each. mapping: BF16 logits of both models on one batch (close, not bitwise), norms perturbed
off (1, 0), plus a control with a non-interleaved QKV (far off). operands: block 0's QKV GEMM, TE's
operands captured in a training forward (general_gemm's A = weight, B = quantized LN output) vs
TE's quantizers on TE's bf16 LN output / weight vs lowp's quantize() on the same tensors and on
lowp's own LN output. curves: TE BF16 seeds 0..N-1; per recipe emulated and TE from the same
weights and batches; per logged step |emulated - te| against |seed0 - seed1| and against the mean
|seed_i - seed_j|. grads: step-0 gradients, emulated vs TE vs TE BF16. sensitivity: TE against
itself with 0.1% of the weights one bf16 ulp off, judged by the same criterion (the floor).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # harness, and gpu_fidelity beside this file
from gpu_fidelity import cast_saturation, mismatches, te_quantize, valid_region  # noqa: E402

BASE = ["model=gpt_small", "data=markov", "hardware=auto", "logger=none", "telemetry_interval=0"]
EXTRA: list[str] = []  # overrides from the command line
BLOCK_NAMES = {  # emulated Block module -> te.TransformerLayer parameter prefix (fuse_qkv_params=True)
    "ln1": "self_attention.layernorm_qkv.layer_norm_",
    "attn.qkv": "self_attention.layernorm_qkv.",
    "attn.proj": "self_attention.proj.",
    "ln2": "layernorm_mlp.layer_norm_",
    "mlp.fc1": "layernorm_mlp.fc1_",
    "mlp.fc2": "layernorm_mlp.fc2_",
}


# ---- the weight mapping (pure; tests/numerics/test_te_mapping.py checks it on the CPU) -------------


def qkv_interleave(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows [q; k; v] (heads inside each) -> the per-head layout [h0: q k v, h1: q k v, ...] that TE's
    qkv_weight_interleaved and lowp's GPT both use; here only the scrambled control of check_mapping."""
    d = t.shape[0] // (3 * n_head)
    return t.reshape(3, n_head, d, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def te_param_name(name: str) -> str:
    """An emulated GPT parameter's name in TEGPT."""
    if not name.startswith("blocks."):
        return name  # wte, wpe, ln_f, lm_head: the same modules in both models
    _, i, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")  # kind: weight or bias
    if module not in BLOCK_NAMES or kind not in ("weight", "bias"):
        raise KeyError(f"{name}: no TE counterpart")
    return f"blocks.{i}.layer.{BLOCK_NAMES[module]}{kind}"


def te_state_from_emulated(sd: dict, n_head: int, interleave: bool = False) -> dict:
    """An emulated GPT state_dict in TEGPT's parameter names and layouts (values unchanged)."""
    out = {}
    for name, t in sd.items():
        if interleave and ".attn.qkv." in name:  # weight and bias
            t = qkv_interleave(t, n_head)
        out[te_param_name(name)] = t
    return out


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


def round_to_bf16_(model: torch.nn.Module) -> None:
    """The emulated fp32 weights onto the bf16 grid, so the TE model can hold them exactly."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def load_into_te(te_model: torch.nn.Module, sd: dict, n_head: int, interleave: bool = False) -> int:
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


# ---- the GPU parts -------------------------------------------------------------------------------


def trainer(*overrides: str):
    """A Trainer for BASE + the command line's overrides + these, as harness.train.run builds it."""
    from omegaconf import OmegaConf

    from harness.config.store import compose
    from harness.config.validate import validate
    from harness.hardware import resolve_hardware
    from harness.train import Trainer

    cfg = OmegaConf.to_object(compose([*BASE, *EXTRA, *overrides]))
    cfg.hardware = resolve_hardware(cfg.hardware)
    validate(cfg)
    return Trainer(cfg, Path(os.environ.get("OUT", ".")) / "runs")


def emulated_start(recipe: str, perturb_norms: bool = False, extra: tuple[str, ...] = ()):
    """An emulated trainer with bf16-valued weights, and a CPU copy of its state_dict."""
    em = trainer(f"recipe={recipe}", "backend=emulated", *extra)
    if perturb_norms:  # norms and biases off (1, 0), so a swapped or missed one shows
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in em.model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))
    round_to_bf16_(em.model)
    return em, {k: v.detach().cpu().clone() for k, v in em.model.state_dict().items()}


def check_mapping() -> dict:
    from harness.loss import loss_fn

    em, sd = emulated_start("bf16", perturb_norms=True)
    te = trainer("recipe=bf16", "backend=te")
    x, y = (t.cuda() for t in next(em.batches))
    out = {}
    with torch.no_grad(), em.backend.autocast():
        ref = em.model(x).float()
    for scramble in (False, True):  # lowp's QKV rows already have TE's per-head layout: copy as is
        load_into_te(te.model, sd, em.cfg.model.num_attention_heads, scramble)
        with torch.no_grad(), te.backend.autocast():
            got = te.model(x).float()
        out["control_scrambled_qkv" if scramble else "same_layout"] = {
            "logits_max_abs_diff": float((got - ref).abs().max()),
            "logits_rel_diff": float((got - ref).norm() / ref.norm()),
            "loss_emulated": float(loss_fn(ref, y)),
            "loss_te": float(loss_fn(got, y)),
        }
    return out


FIELDS = ("data_row", "data_col", "sinv_row", "sinv_col")  # gpu_fidelity's names


def te_parts(t) -> dict:
    """Codes and scale_inv of a TE quantized tensor (Float8Tensor or blockwise storage)."""
    if hasattr(t, "_rowwise_data"):
        names = ("_rowwise_data", "_columnwise_data", "_rowwise_scale_inv", "_columnwise_scale_inv")
    else:
        names = ("_data", "_transpose", "_scale_inv", "_scale_inv")
    return dict(zip(FIELDS, (getattr(t, n, None) for n in names)))


def lowp_parts(recipe, role: str, t: torch.Tensor, scale) -> tuple[dict, object]:
    """lowp's two copies in the same fields, and the rowwise result."""
    from harness.numerics import quantize

    extra = {"scale": scale} if scale is not None else {}
    row, col = (quantize(t, recipe, role=role, columnwise=c, **extra) for c in (False, True))
    return dict(zip(FIELDS, (row.data, col.data, row.scale_inv, col.scale_inv))), row


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int | str:
    a, b = a.detach().float().reshape(-1).cpu(), b.detach().float().reshape(-1).cpu()
    if a.numel() != b.numel():
        return f"numel {a.numel()} vs {b.numel()}"
    return int((a.view(torch.int32) != b.view(torch.int32)).sum())


def snapshot(t) -> dict:
    """A quantized operand's codes, scale_inv and dequantized values, copied at the GEMM: a training
    forward frees the rowwise copies it no longer needs (only the columnwise ones live on for wgrad)."""
    clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {
        "parts": {k: clone(v) for k, v in te_parts(t).items()},
        "deq": t.dequantize(dtype=torch.float32).clone(),
        "type": type(t).__name__,
    }


def capture_qkv_gemm(te, x) -> tuple:
    """Snapshots of (weight, input), the operands of the first fprop GEMM (block 0's QKV) in a
    training forward."""
    import transformer_engine.pytorch.module.layernorm_linear as lnl

    orig, seen = lnl.general_gemm, []

    def spy(a, b, *rest, **kw):
        if not seen:
            seen.append((snapshot(a), snapshot(b)))
        return orig(a, b, *rest, **kw)

    lnl.general_gemm = spy
    try:
        with te.backend.autocast():
            te.model(x)
    finally:
        lnl.general_gemm = orig
    return seen[0]


def capture_lowp_qkv_input(em, x) -> dict:
    """lowp's own input operand of block 0's QKV GEMM in a training forward of the emulated GPT:
    its embeddings, bf16 residual, norm and (fused or not, as TE) cast, from the same weights."""
    q = em.model.blocks[0].attn.qkv.quant
    orig, seen = q.quantize_input, []

    def spy(x2, need_columnwise):
        row, col = orig(x2, need_columnwise)
        if not seen:
            seen.append((row, col))
        return row, col

    q.quantize_input = spy
    try:
        with em.backend.autocast():
            em.model(x)
    finally:
        del q.quantize_input  # the class's method again
    row, col = seen[0]
    parts = (
        row.data,
        None if col is None else col.data,
        row.scale_inv,
        None if col is None else col.scale_inv,
    )
    return {"parts": dict(zip(FIELDS, parts)), "deq": row.dequantize().float()}


def te_kind(recipe, role: str) -> tuple[str, dict]:
    """gpu_fidelity's TE quantizer spec for this recipe config and role (forward roles: E4M3)."""
    if recipe.name == "delayed":
        return "delayed", {"fp8": "e4m3"}
    if recipe.name == "tensorwise":
        return "current", {"fp8": "e4m3", "pow2": recipe.power_2_scales, "eps": recipe.amax_epsilon}
    dim = recipe.x_block_dim if role == "input" else recipe.w_block_dim
    return "block", {"fp8": "e4m3", "dim": dim, "pow2": recipe.power_2_scales}


def te_layernorm(mod, h: torch.Tensor) -> torch.Tensor:
    """The LayerNormLinear's norm as its forward runs it, unquantized (bf16 out)."""
    from transformer_engine.pytorch.module._common import apply_normalization

    w, b, margin = mod.layer_norm_weight, mod.layer_norm_bias, getattr(mod, "fwd_ln_sm_margin", 0)
    args = (mod.eps, None, torch.bfloat16, mod.normalization, margin, mod.zero_centered_gamma)
    return apply_normalization(h, None, w, b, *args)[0]


def compare_operands(recipe_name: str) -> dict:
    em, sd = emulated_start(recipe_name)
    te = trainer(f"recipe={recipe_name}", "backend=te")
    n_head, recipe = em.cfg.model.num_attention_heads, em.cfg.recipe
    load_into_te(te.model, sd, n_head)
    x = next(em.batches)[0].cuda()
    w_te, in_te = capture_qkv_gemm(te, x)
    own_in = capture_lowp_qkv_input(em, x)
    mod = te.model.blocks[0].layer.self_attention.layernorm_qkv
    with torch.no_grad():
        h_te = (te.model.wte(x) + te.model.wpe.weight[: x.shape[1]]).reshape(-1, mod.in_features)  # bf16
        ln_te = te_layernorm(mod, h_te)
        from harness.model import bf16_values

        wte, wpe = bf16_values(em.model.wte(x)), bf16_values(em.model.wpe.weight[: x.shape[1]])
        h_em = bf16_values(wte + wpe)  # the emulated GPT's block input (bf16 values, as TE's)
        ln_em = em.model.blocks[0].ln1(h_em).reshape(-1, mod.in_features).to(torch.bfloat16)
    out = {
        "ln": {
            "elements": ln_te.numel(),
            "block_input_differ_after_bf16_rounding": bits_differ(h_em.to(torch.bfloat16), h_te),
            "ln_out_differ_bf16": bits_differ(ln_em, ln_te),
            "ln_out_max_abs_diff": float((ln_em.float() - ln_te.float()).abs().max()),
        }
    }
    scale = torch.ones(1, device="cuda") if recipe.name == "delayed" else None  # step 1: scale 1
    w_em = sd["blocks.0.attn.qkv.weight"].cuda().to(torch.bfloat16)  # lowp's layout: [q; k; v]
    for role, hp, captured, own in (
        ("input", ln_te, in_te, ln_em),
        ("weight", mod.weight.detach(), w_te, None),
    ):
        kind, kw = te_kind(recipe, role)
        cut = lambda d: valid_region(d, kind, kw, tuple(hp.shape))  # noqa: B023, E731
        te_q = cut(te_quantize(kind, kw, hp, scale))
        lowp, lowp_row = lowp_parts(recipe, role, hp, scale)
        te_deq = captured["deq"]  # what TE's GEMM multiplies, as values
        res = {
            "te_operand_type": captured["type"],
            "lowp_vs_te_quantizer_same_tensor": mismatches(cut(lowp), te_q),
            "te_training_operand_vs_te_quantizer": mismatches(cut(captured["parts"]), te_q),
            "dequant_lowp_vs_te_training_operand": bits_differ(lowp_row.dequantize(), te_deq),
        }
        if own is not None:  # lowp's whole path: its own model's operand in a training forward
            res["lowp_model_operand_vs_te_training_operand"] = mismatches(
                cut(own_in["parts"]), cut(captured["parts"])
            )
            res["dequant_lowp_model_operand_vs_te_training_operand"] = bits_differ(own_in["deq"], te_deq)
            own_deq = lowp_parts(recipe, role, own, scale)[1].dequantize()  # the bf16-rounded LN
            res["dequant_lowp_bf16_ln_vs_te_training_operand"] = bits_differ(own_deq, te_deq)
        else:  # the weight quantized in lowp's own model (the same row layout as TE's)
            rows = lowp_parts(recipe, role, w_em, scale)[1].dequantize()
            res["dequant_lowp_model_layout_vs_te_training_operand"] = bits_differ(rows, te_deq)
        if recipe.name == "delayed":  # also a saturating scale (the regime of the H200 CPU bug)
            s2 = (448.0 / hp.float().abs().max() * 1.3).reshape(1)
            res["lowp_vs_te_quantizer_scale_x1.3"] = mismatches(
                lowp_parts(recipe, role, hp, s2)[0], te_quantize(kind, kw, hp, s2)
            )
        out[role] = res
    return out


def curve(overrides: list[str], steps: int, weights: dict | None = None) -> dict:
    """Train `steps` steps as Trainer.fit does (logged train loss, eval loss) from `weights`."""
    from harness import metrics as M

    tr = trainer(*overrides, f"steps={steps}")
    if weights is not None and tr.backend.name == "te":
        load_into_te(tr.model, weights, tr.cfg.model.num_attention_heads)
    elif weights is not None:
        tr.model.load_state_dict(weights)
    train, evals, errors, t0 = [], [], [], time.perf_counter()
    for step in range(steps):
        loss, grad_norm, lr = tr.train_step(step)
        tr.metrics.record(step, loss, grad_norm, lr)
        if step in (0, steps - 1):
            try:
                tr.backend.verify_active(tr.model, step)
            except Exception as e:  # recorded, not fatal: the curve still tells something
                errors.append(f"verify_active step {step}: {e!r}")
        if tr.metrics.should_log(step, steps - 1):
            train.append([step + 1, tr.metrics.row(step)[M.LOSS_TRAIN]])
        if (step + 1) % tr.cfg.eval_interval == 0 or step == steps - 1:
            evals.append([step + 1, tr.evaluate()])
    return {
        "train": train,
        "eval": evals,
        "wall_s": round(time.perf_counter() - t0, 1),
        "errors": errors,
        "backend": tr.backend.name,
        "recipe_repr": str(tr.backend.describe().get("recipe_repr")),
    }


def step0_grads(overrides: list[str], weights: dict) -> dict:
    """One forward and backward of the first batch from `weights`: the loss and every parameter's
    gradient as the optimizer would read it (fp32 main_grad where there is one), by emulated name."""
    tr = trainer(*overrides)
    if tr.backend.name == "te":
        load_into_te(tr.model, weights, tr.cfg.model.num_attention_heads)
        names = {te_param_name(n): n for n in weights}
    else:
        tr.model.load_state_dict(weights)
        names = {n: n for n in weights}
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


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_grads(recipe: str) -> dict:
    """Step-0 gradients, emulated vs TE, against TE BF16's from the same weights and batch.

    Per parameter: rel(emu, te) = |g_emu - g_te| / |g_te|; rel(te, bf16) and rel(emu, bf16), how far
    each backend's quantized gradient is from the unquantized one; |g_emu| / |g_te|. An operand that
    one backend quantizes and the other does not shows as rel(emu, bf16) far from rel(te, bf16)."""
    sd = emulated_start(recipe)[1]
    em = step0_grads([f"recipe={recipe}", "backend=emulated"], sd)
    te = step0_grads([f"recipe={recipe}", "backend=te"], sd)
    ref = step0_grads(["recipe=bf16", "backend=te"], sd)
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


def sensitivity(recipe: str, steps: int) -> dict:
    """How far TE's own curve moves when 0.1% of the weights move one bf16 ulp: the floor below which
    no emulator can hold TE's curve, since its GEMMs' rounding already differs by about that much.
    Also the step-0 gradient difference that perturbation makes, to set beside compare_grads'."""
    sd = emulated_start(recipe)[1]
    bumped = bump_ulps(sd)
    ov = [f"recipe={recipe}", "backend=te"]
    a, b = curve(ov, steps, sd), curve(ov, steps, bumped)
    ga, gb = step0_grads(ov, sd)["grads"], step0_grads(ov, bumped)["grads"]
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


def guard(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # one failing run never stops the others
        print(f"FAILED: {e!r}", flush=True)
        return {"error": repr(e), "trace": traceback.format_exc(limit=8)}


def criterion(a: dict, b: dict, seeds: list[dict], key: str) -> dict:
    """Per logged step |a - b| against how much BF16 seeds differ: |seed0 - seed1| (the literal
    two-seed test; it is near 0 wherever two curves cross) and the mean |seed_i - seed_j| over all
    pairs of the N seeds (the expected two-seed difference, a steadier estimate)."""
    curves = [a[key], b[key], *(s[key] for s in seeds)]
    rows = []
    for points in zip(*curves, strict=True):
        step, va, vb, *vs = points[0][0], *(v for _, v in points)
        pairs = [abs(x - y) for i, x in enumerate(vs) for y in vs[i + 1 :]]
        rows.append([step, abs(va - vb), abs(vs[0] - vs[1]), sum(pairs) / len(pairs)])
    bad = [r[0] for r in rows if not r[1] < r[2]]
    bad_mean = [r[0] for r in rows if not r[1] < r[3]]
    return {
        "holds": bool(rows) and not bad,
        "violating_steps": bad,
        "holds_vs_mean_pairwise": bool(rows) and not bad_mean,
        "violating_steps_vs_mean_pairwise": bad_mean,
        "bf16_seeds": len(seeds),
        "max_pair_diff": max((r[1] for r in rows), default=None),
        "min_seed_diff": min((r[2] for r in rows), default=None),
        "rows": rows,  # [step, |emulated - te|, |seed0 - seed1|, mean |seed_i - seed_j|]
    }


def criterion_free(pair: dict, key: str) -> dict:
    """|emulated - te| per logged step and the signed mean (emulated - te), without a BF16 band."""
    rows = [[s, va - vb] for (s, va), (_, vb) in zip(pair["emulated"][key], pair["te"][key], strict=True)]
    mean = sum(d for _, d in rows) / len(rows)
    return {"max_pair_diff": max(abs(d) for _, d in rows), "mean_signed": mean, "rows": rows}


def print_summary(res: dict, recipes: list[str], pairs: list[str]) -> None:
    print("\n==== te_vs_emulated summary ====")
    for key, v in res.get("mapping", {}).items():
        print(f"mapping {key:<24} {json.dumps(v)}")
    for r in (r for r in recipes if f"operands/{r}" in res):
        o = res[f"operands/{r}"]
        rows = [("", "ERROR", o["error"])] if "error" in o else [("", "ln", o.get("ln"))]
        rows += [(role, k, v) for role in ("input", "weight") for k, v in o.get(role, {}).items()]
        for role, k, v in rows:
            print(f"operands {r:<10} {role:<6} {k:<48} {json.dumps(v)}")
    for key in (k for k in res if k.startswith("grads/")):
        g = res[key]
        if "error" in g:
            print(f"{key}: {g['error']}")
            continue
        print(
            f"{key:<18} loss emu/te/bf16 {g['loss']['emulated']:.5f}/{g['loss']['te']:.5f}/"
            f"{g['loss']['te_bf16']:.5f}  median rel(emu,te)={g['median_rel_emu_te']:.3g}  "
            f"rel(te,bf16)={g['median_rel_te_bf16']:.3g}  rel(emu,bf16)={g['median_rel_emu_bf16']:.3g}  "
            f"|emu|/|te|={g['median_norm_ratio_emu_te']:.4f}  "
            f"params rel(emu,te)>rel(te,bf16)/2: "
            f"{g['params_with_rel_emu_te_over_half_rel_te_bf16']}/{g['params']}"
        )
        for w in g["worst"][:4]:
            print(f"    {w[0]:<58} rel(emu,te)={w[1]:.3g} rel(te,bf16)={w[2]:.3g} rel(emu,bf16)={w[3]:.3g}")
    for key in (k for k in res if k.startswith("sensitivity/")):
        v = res[key]
        keep = ("max_abs_diff", "median_rel_grad_bumped_vs_te")
        print(f"{key:<24} {json.dumps({k: v[k] for k in keep} if 'error' not in v else v['error'])}")
    for key in (k for k in res if k.startswith("criterion/")):
        c, r = res[key], key.split("/", 1)[1]
        for k in ("train", "eval") if "error" not in c else ():
            x = c[k]
            if "holds" not in x:
                m, d = x["max_pair_diff"], x["mean_signed"]
                print(f"criterion {r:<16} {k:<5} max|emu-te|={m:.4g}  mean(emu-te)={d:+.4g}")
                continue
            print(
                f"criterion {r:<16} {k:<5} holds={x['holds']}  max|emu-te|={x['max_pair_diff']:.4g}  "
                f"min|s0-s1|={x['min_seed_diff']:.4g}  violating steps={x['violating_steps']}  "
                f"vs mean of {x['bf16_seeds']} seeds' pairs: holds={x['holds_vs_mean_pairwise']} "
                f"violating={x['violating_steps_vs_mean_pairwise']}"
            )
        if "error" in c:
            print(f"criterion {r}: {c['error']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recipes", default="tensorwise,delayed,blockwise")
    p.add_argument("--parts", default="mapping,operands,curves")
    p.add_argument("--bf16-seeds", type=int, default=4, help="TE BF16 seeds for the band (>= 2; 0: none)")
    p.add_argument("--pair-seeds", default="", help="seeds for the emulated/te pairs' weights, data")
    p.add_argument("--no-bf16-pair", action="store_true", help="skip the emulated-vs-te BF16 control pair")
    p.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. log_interval=25")
    args = p.parse_args()
    EXTRA[:] = args.overrides
    recipes, parts = args.recipes.split(","), args.parts.split(",")
    pairs = ([] if args.no_bf16_pair else ["bf16"]) + recipes  # bf16: the backends' own difference
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "te_vs_emulated.json"
    res: dict = {"torch": torch.__version__, "steps": args.steps, "recipes": recipes, "seconds": {}}

    def part(key: str, fn, *a) -> None:
        t0 = time.perf_counter()
        res[key] = guard(fn, *a)
        gc.collect()  # drop the last part's trainers (optimizer hooks hold reference cycles)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        res["seconds"][key] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(res, indent=1, default=str))
        print(f"[{key}] {res['seconds'][key]} s", flush=True)

    te_version = lambda: __import__("transformer_engine").__version__  # noqa: E731
    env = {"gpu": torch.cuda.get_device_name, "te": te_version, "fp8_cast_saturates": cast_saturation}
    part("env", lambda: {**{k: guard(f) for k, f in env.items()}, "overrides": EXTRA})
    if "mapping" in parts:
        part("mapping", check_mapping)
    if "operands" in parts:
        for r in recipes:
            part(f"operands/{r}", compare_operands, r)
    if "grads" in parts:
        for r in pairs:
            part(f"grads/{r}", compare_grads, r)
    if "curves" in parts:
        for seed in range(args.bf16_seeds):
            part(f"curves/bf16_te_s{seed}", curve, ["recipe=bf16", "backend=te", f"seed={seed}"], args.steps)
        pair_seeds = [int(x) for x in args.pair_seeds.split(",")] if args.pair_seeds else [None]
        for r, ps in ((r, ps) for ps in pair_seeds for r in pairs):
            seeded = () if ps is None else (f"seed={ps}",)
            key = r if ps is None else f"{r}_seed{ps}"

            def pair(r=r, seeded=seeded) -> dict:  # the same weights and, from one seed, the same batches
                sd = emulated_start(r, extra=seeded)[1]
                return {
                    b: guard(curve, [f"recipe={r}", f"backend={b}", *seeded], args.steps, sd)
                    for b in ("emulated", "te")
                }

            part(f"curves/{key}", pair)
            seeds = [res.get(f"curves/bf16_te_s{i}", {}) for i in range(args.bf16_seeds)]
            pr = res.get(f"curves/{key}", {})
            if len(seeds) >= 2:
                part(
                    f"criterion/{key}",
                    lambda: {k: criterion(pr["emulated"], pr["te"], seeds, k) for k in ("train", "eval")},  # noqa: B023
                )
            else:  # no BF16 band asked for (--bf16-seeds 0): the pair's own gaps
                part(f"criterion/{key}", lambda: {k: criterion_free(pr, k) for k in ("train", "eval")})  # noqa: B023
    if "sensitivity" in parts:  # after the curves: TE vs TE-bumped is judged by the same BF16 band
        seeds = [res.get(f"curves/bf16_te_s{i}", {}) for i in range(args.bf16_seeds)]
        for r in pairs:
            part(f"sensitivity/{r}", sensitivity, r, args.steps)
            sv = res[f"sensitivity/{r}"]
            if len(seeds) >= 2 and "error" not in sv:
                part(
                    f"criterion/{r}_te_vs_te_bumped",
                    lambda: {k: criterion(sv["te"], sv["te_bumped"], seeds, k) for k in ("train", "eval")},  # noqa: B023
                )
    guard(print_summary, res, recipes, pairs)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
