"""Step-0 operands of block 0's QKV GEMM, TE against the emulator from the same weights, bit for bit;
and the weight mapping itself (BF16 logits of both models, with a scrambled-QKV control).

TE's operands are captured in a training forward (general_gemm's A = weight, B = the quantized
LayerNorm output) and compared with TE's quantizers on TE's bf16 LN output and weight, with lowp's
quantize() on the same tensors, and with lowp's own model's operand (its embeddings, residual,
TE-order LayerNorm and cast).
"""

from __future__ import annotations

import torch

from benchmarks.fidelity.common import Setup, emulated_start
from benchmarks.fidelity.quantizers import mismatches, valid_region
from harness.backends.te_weights import load_into_te
from tests.numerics.references.te_quantize import KINDS, te_quantize

FIELDS = ("data_row", "data_col", "sinv_row", "sinv_col")  # the quantizer benchmark's names


def check_mapping(setup: Setup) -> dict:
    """BF16 logits of both models on one batch (close, not bitwise), norms perturbed off (1, 0), and a
    control with a non-interleaved QKV (far off)."""
    from harness.model.loss import loss_fn

    em, sd = emulated_start(setup, "bf16", perturb_norms=True)
    te = setup.trainer("recipe=bf16", "backend=te")
    x, y = (t.cuda() for t in next(em.batches))
    out = {}
    with torch.no_grad(), em.backend.autocast():
        ref = em.model(x).float()
    for scramble in (False, True):  # lowp's QKV rows already have TE's per-head layout: copied as is
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
    parts = {k: clone(v) for k, v in te_parts(t).items()}
    return {"parts": parts, "deq": t.dequantize(dtype=torch.float32).clone(), "type": type(t).__name__}


def capture_qkv_gemm(te, x) -> tuple:
    """Snapshots of (weight, input), the operands of the first fprop GEMM (block 0's QKV)."""
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
    """lowp's own input operand of block 0's QKV GEMM in a training forward of the emulated GPT."""
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


TE_KIND = {"amax_history": "delayed"}  # the registry's scheme -> the TE quantizer kind (Float8Quantizer)


def te_kind(recipe, role: str) -> tuple[str, dict]:
    """The TE quantizer (kind, kwargs) of this recipe config and role (forward roles: E4M3). The
    registry's quantizer scheme names TE's quantizer: delayed (Float8Quantizer), current, block."""
    from harness import recipes

    scheme = recipes.get(recipe.name).scheme
    kind = TE_KIND.get(scheme, scheme)
    if kind not in KINDS:
        raise ValueError(f"recipe={recipe.name}: operands compares the TE quantizers {KINDS} only")
    if kind == "delayed":
        return kind, {"fp8": "e4m3"}
    if kind == "current":
        return kind, {"fp8": "e4m3", "pow2": recipe.power_2_scales, "eps": recipe.amax_epsilon}
    dim = recipe.x_block_dim if role == "input" else recipe.w_block_dim
    return kind, {"fp8": "e4m3", "dim": dim, "pow2": recipe.power_2_scales}


def te_layernorm(mod, h: torch.Tensor) -> torch.Tensor:
    """The LayerNormLinear's norm as its forward runs it, unquantized (bf16 out)."""
    from transformer_engine.pytorch.module._common import apply_normalization

    w, b, margin = mod.layer_norm_weight, mod.layer_norm_bias, getattr(mod, "fwd_ln_sm_margin", 0)
    args = (mod.eps, None, torch.bfloat16, mod.normalization, margin, mod.zero_centered_gamma)
    return apply_normalization(h, None, w, b, *args)[0]


def layernorms(em, te, x) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Block 0's LN output in TE and in the emulated GPT from the same bf16 block input."""
    from harness.model.gpt import bf16_values

    mod = te.model.blocks[0].layer.self_attention.layernorm_qkv
    with torch.no_grad():
        h_te = (te.model.wte(x) + te.model.wpe.weight[: x.shape[1]]).reshape(-1, mod.in_features)  # bf16
        ln_te = te_layernorm(mod, h_te)
        wte, wpe = bf16_values(em.model.wte(x)), bf16_values(em.model.wpe.weight[: x.shape[1]])
        h_em = bf16_values(wte + wpe)  # the emulated GPT's block input (bf16 values, as TE's)
        ln_em = em.model.blocks[0].ln1(h_em).reshape(-1, mod.in_features).to(torch.bfloat16)
    return (
        ln_te,
        ln_em,
        {
            "elements": ln_te.numel(),
            "block_input_differ_after_bf16_rounding": bits_differ(h_em.to(torch.bfloat16), h_te),
            "ln_out_differ_bf16": bits_differ(ln_em, ln_te),
            "ln_out_max_abs_diff": float((ln_em.float() - ln_te.float()).abs().max()),
        },
    )


def compare_role(recipe, role: str, hp, captured: dict, own, scale) -> dict:
    """One operand (input or weight): lowp's quantizer and TE's on the same tensor, and both against
    the operand TE's training forward multiplied. `own`: lowp's model's operand (a tensor, or the
    captured dict of the input)."""
    kind, kw = te_kind(recipe, role)
    cut = lambda d: valid_region(d, kind, kw, tuple(hp.shape))  # noqa: E731
    te_q = cut(te_quantize(kind, kw, hp, scale))
    lowp, lowp_row = lowp_parts(recipe, role, hp, scale)
    te_deq = captured["deq"]  # what TE's GEMM multiplies, as values
    res = {
        "te_operand_type": captured["type"],
        "lowp_vs_te_quantizer_same_tensor": mismatches(cut(lowp), te_q),
        "te_training_operand_vs_te_quantizer": mismatches(cut(captured["parts"]), te_q),
        "dequant_lowp_vs_te_training_operand": bits_differ(lowp_row.dequantize(), te_deq),
    }
    if isinstance(own, dict):  # lowp's whole path: its own model's operand in a training forward
        res["lowp_model_operand_vs_te_training_operand"] = mismatches(
            cut(own["parts"]), cut(captured["parts"])
        )
        res["dequant_lowp_model_operand_vs_te_training_operand"] = bits_differ(own["deq"], te_deq)
    else:  # the weight quantized in lowp's own model (the same row layout as TE's)
        rows = lowp_parts(recipe, role, own, scale)[1].dequantize()
        res["dequant_lowp_model_layout_vs_te_training_operand"] = bits_differ(rows, te_deq)
    if kind == "delayed":  # also a saturating scale (the regime of the H200 CPU cast bug)
        s2 = (448.0 / hp.float().abs().max() * 1.3).reshape(1)
        res["lowp_vs_te_quantizer_scale_x1.3"] = mismatches(
            lowp_parts(recipe, role, hp, s2)[0], te_quantize(kind, kw, hp, s2)
        )
    return res


def compare_operands(setup: Setup, recipe_name: str) -> dict:
    em, sd = emulated_start(setup, recipe_name)
    te = setup.trainer(f"recipe={recipe_name}", "backend=te")
    recipe = em.cfg.recipe
    load_into_te(te.model, sd, em.cfg.model.num_attention_heads)
    x = next(em.batches)[0].cuda()
    w_te, in_te = capture_qkv_gemm(te, x)
    own_in = capture_lowp_qkv_input(em, x)
    ln_te, ln_em, ln = layernorms(em, te, x)
    scale = (
        torch.ones(1, device="cuda") if te_kind(recipe, "input")[0] == "delayed" else None
    )  # step 1: scale 1
    weight = te.model.blocks[0].layer.self_attention.layernorm_qkv.weight.detach()
    w_em = sd["blocks.0.attn.qkv.weight"].cuda().to(torch.bfloat16)  # lowp's layout: [q; k; v]
    out = {"ln": ln, "input": compare_role(recipe, "input", ln_te, in_te, own_in, scale)}
    own_deq = lowp_parts(recipe, "input", ln_em, scale)[1].dequantize()  # the bf16-rounded LN
    out["input"]["dequant_lowp_bf16_ln_vs_te_training_operand"] = bits_differ(own_deq, in_te["deq"])
    out["weight"] = compare_role(recipe, "weight", weight, w_te, w_em, scale)
    return out
