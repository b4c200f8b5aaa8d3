"""Recipes on the routed experts (docs/numerics_grouped.md): each expert's GEMMs are a dense emulated
TE Linear on that expert's rows alone (its own amax, scale, delayed-scaling history and blocks), the
rows padded per expert to the recipe's alignment as Megatron pads them, an expert without tokens as
TE's kernels treat an empty input; stability overrides on whole expert groups only; INT4 QAT on the
routed experts alone. In-process, emulated backend, reference GEMMs."""

from __future__ import annotations

import json

import pytest
import torch

from harness.backends import build_backend
from harness.backends.emulated import FakeQuantLinear, bf16_linear
from harness.config.errors import ConfigError
from harness.lifecycle import metrics as M
from harness.model import routing as R
from harness.numerics import NumericsContext, QuantizedLinear
from harness.numerics import fast as fast_paths
from harness.numerics.int4 import fake_int4
from harness.train import backend_spec, run
from harness.validation.load import compose_config, prepare
from tests import moe_paths as P
from tests.helpers import compose_cfg

BF16 = torch.bfloat16
RUN = ["backend=emulated", "hardware=cpu", "logger=none", "eval_interval=0", "eval_tokens=512"]
RUN += ["data.num_tokens=20000", "optimizer.warmup_steps=1", "checkpoint_interval=-1"]
QUANTIZED = ["delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4", "int4_qat"]
ALIGN = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32, "nvfp4": 128}  # else 0
# NVFP4 gradients round stochastically from one generator in the order the experts' backwards run;
# TE draws differently anyway (docs/numerics_grouped.md §3.5: distributions only), so exactness is
# checked with round-to-nearest gradients
EXACT = {"nvfp4": ["recipe.disable_stochastic_rounding=true"]}
M_SPLITS = [3, 0, 17, 40, 1, 0, 37, 5]  # unaligned, two empty experts (8 experts in qwen3_moe_tiny)


def backend_and_model(recipe: str, *extra: str):
    cfg = compose_cfg("model=qwen3_moe_tiny", *RUN, f"recipe={recipe}", *EXACT.get(recipe, []), *extra)
    torch.manual_seed(0)
    backend = build_backend(backend_spec(cfg), torch.device("cpu"))
    return cfg, backend, backend.build_model()


def dense_linear(cfg, group, index: int, ctx: NumericsContext):
    """Expert `index` of `group` as a dense linear of the recipe, built on its own: (x, W) -> y."""
    recipe = cfg.recipe
    if recipe.name == "bf16":
        return lambda x, w: bf16_linear(x, w, None, group.wgrad_fp32)
    if recipe.name == "int4_qat":
        return lambda x, w: bf16_linear(x, fake_int4(w.to(BF16), recipe.int4_group_size), None)
    ql = QuantizedLinear(f"dense.{index}", recipe, ctx, wgrad_fp32=group.wgrad_fp32, fast_gemm=False)
    return lambda x, w: ql.linear(x, w, None)


def run_grouped(backend, group, xs, dys):
    """Each step: forward of the group on xs[i] (split by M_SPLITS) and backward of dys[i]."""
    outs = []
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_(True)
        group.weight.grad = None
        backend.numerics.weights_changed()  # an optimizer step: the weights are quantized again
        with backend.autocast():
            y = group(x, M_SPLITS)
        y.backward(dy)
        outs.append((y.detach(), x.grad, group.weight.grad.clone()))
    return outs


def run_dense(cfg, group, xs, dys):
    """The same steps with every expert a dense linear of its own, on its own rows only."""
    ctx = NumericsContext(seed=cfg.seed)
    linears = [dense_linear(cfg, group, e, ctx) for e in range(group.num_gemms) if M_SPLITS[e]]
    outs = []
    for x, dy in zip(xs, dys):
        ws = [w.detach().clone().requires_grad_(True) for w in group.weight.unbind(0)]
        xs_e = [xe.clone().requires_grad_(True) for xe in x.split(M_SPLITS)]
        live = [e for e in range(group.num_gemms) if M_SPLITS[e]]
        with ctx.autocast():
            ys = [lin(xs_e[e], ws[e]) for lin, e in zip(linears, live)]
        torch.autograd.backward(ys, [dy.split(M_SPLITS)[e] for e in live])
        dw = torch.stack([w.grad if w.grad is not None else torch.zeros_like(w) for w in ws])
        outs.append(
            (
                torch.cat(ys).detach(),
                torch.cat([xe.grad if xe.grad is not None else torch.zeros_like(xe) for xe in xs_e]),
                dw,
            )
        )
    return outs, ctx


@pytest.mark.parametrize("recipe", ["bf16", *QUANTIZED])
def test_each_expert_is_the_dense_linear_of_the_recipe_on_its_own_rows(recipe):
    cfg, backend, model = backend_and_model(recipe)
    group = model.blocks[0].mlp.experts.fc1
    g = torch.Generator().manual_seed(1)
    m, k, n = sum(M_SPLITS), group.in_features, group.out_features
    # the experts' inputs and grads at different magnitudes: per-expert scales differ
    spread = torch.cat([torch.full((r, 1), 2.0**e) for e, r in enumerate(M_SPLITS)])
    xs = [torch.randn(m, k, generator=g).to(BF16) * spread for _ in range(2)]
    dys = [torch.randn(m, n, generator=g).to(BF16) * spread / 64 for _ in range(2)]
    got = run_grouped(backend, group, xs, dys)
    want, ctx = run_dense(cfg, group, xs, dys)
    for step, ((y, dx, dw), (y_ref, dx_ref, dw_ref)) in enumerate(zip(got, want)):
        assert torch.equal(y, y_ref), (recipe, step)
        assert torch.equal(dx, dx_ref), (recipe, step)
        assert torch.equal(dw, dw_ref), (recipe, step)
        assert not dw[1].any() and not dw[5].any()  # empty experts: dW zeros
    if recipe != "delayed":
        return
    live = [e for e in range(8) if M_SPLITS[e]]
    for e in live:  # each expert its own history and scale, as a dense module's
        for states, ref in ((backend.numerics.forward_states, ctx.forward_states),
                            (backend.numerics.backward_states, ctx.backward_states)):  # fmt: skip
            assert torch.equal(states[f"{group.name}.{e}"].amax_history, ref[f"dense.{e}"].amax_history)
            assert torch.equal(states[f"{group.name}.{e}"].scale, ref[f"dense.{e}"].scale)
    assert len({float(backend.numerics.forward_states[f"{group.name}.{e}"].scale[0]) for e in live}) == 6


def test_delayed_scaling_history_of_an_expert_without_tokens_keeps_its_input_and_grad_columns():
    cfg, backend, model = backend_and_model("delayed", "recipe.fp8_amax_history_len=4")
    group = model.blocks[0].mlp.experts.fc1
    fwd, bwd = backend.numerics.forward_states, backend.numerics.backward_states
    assert set(fwd) >= {f"blocks.{b}.mlp.experts.fc{f}.{e}" for b in (0, 1) for f in (1, 2) for e in range(8)}
    assert fwd[f"{group.name}.0"].amax_history.shape == (4, 2)  # [input, weight] per expert
    assert bwd[f"{group.name}.0"].amax_history.shape == (4, 1)  # [grad]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(M_SPLITS), group.in_features, generator=g).to(BF16)
    dy = torch.randn(sum(M_SPLITS), group.out_features, generator=g).to(BF16)
    run_grouped(backend, group, [x], [dy])
    e1 = f"{group.name}.1"  # empty in this step
    assert not fwd[e1].amax_history[:, 0].any() and float(fwd[e1].scale[0]) == 1.0  # input: nothing recorded
    assert fwd[e1].amax_history[-1, 1] > 0 and float(fwd[e1].scale[1]) != 1.0  # the weight is still quantized
    assert not bwd[e1].amax_history.any() and float(bwd[e1].scale[0]) == 1.0
    e3 = f"{group.name}.3"
    before = (fwd[e3].amax_history.clone(), bwd[e3].amax_history.clone(), fwd[e3].scale.clone())
    M_SPLITS[3], M_SPLITS[1] = 0, 40  # expert 3 gets no token in the next step
    try:
        run_grouped(backend, group, [x], [dy])
    finally:
        M_SPLITS[3], M_SPLITS[1] = 40, 0
    assert torch.equal(fwd[e3].amax_history[:, 0], before[0][:, 0])  # input column neither rolls ...
    assert float(fwd[e3].scale[0]) == float(before[2][0])  # ... nor changes its scale
    assert torch.equal(bwd[e3].amax_history, before[1])
    assert not torch.equal(fwd[e3].amax_history[:, 1], before[0][:, 1])  # the weight column rolls
    assert fwd[e1].amax_history[-1, 0] > 0  # expert 1 had tokens now
    # a checkpoint holds every expert's history and scale under its name, and restores them
    _, fresh, _ = backend_and_model("delayed", "recipe.fp8_amax_history_len=4")
    fresh.load_state_dict(backend.state_dict())
    for name, state in fwd.items():
        for mine, theirs in ((state, fresh.numerics.forward_states[name]),
                             (bwd[name], fresh.numerics.backward_states[name])):  # fmt: skip
            assert torch.equal(mine.amax_history, theirs.amax_history) and torch.equal(
                mine.scale, theirs.scale
            )


@pytest.mark.parametrize("recipe", ["bf16", *QUANTIZED])
def test_experts_pad_each_experts_rows_to_the_recipes_alignment_as_megatron(recipe):
    cfg, backend, model = backend_and_model(recipe)
    experts = model.blocks[0].mlp.experts
    seen = []
    experts.fc1.register_forward_pre_hook(lambda mod, args: seen.append(list(args[1])))
    g = torch.Generator().manual_seed(3)
    m = sum(M_SPLITS)
    x = torch.randn(m, experts.fc1.in_features, generator=g).to(BF16).requires_grad_(True)
    probs = torch.rand(m, generator=g).requires_grad_(True)
    dy = torch.randn(m, experts.fc2.out_features, generator=g).to(BF16)
    with backend.autocast():
        y = experts(x, M_SPLITS, probs)
    y.backward(dy)
    align = ALIGN.get(recipe, 0)
    padded = [-(-r // align) * align for r in M_SPLITS] if align else M_SPLITS
    assert seen == [padded]
    # the reference: each expert's rows with zero rows (probability 0) after them, through dense
    # linears of the recipe, the padding rows dropped from the output
    ctx = NumericsContext(seed=cfg.seed)
    ys, dxs, dps, dw1, dw2 = [], [], [], [], []
    for e, (r, rp) in enumerate(zip(M_SPLITS, padded)):
        xe = torch.cat([x.detach().split(M_SPLITS)[e], torch.zeros(rp - r, x.shape[1], dtype=BF16)])
        pe = torch.cat([probs.detach().split(M_SPLITS)[e], torch.zeros(rp - r)])
        xe.requires_grad_(True), pe.requires_grad_(True)
        w1 = experts.fc1.weight[e].detach().clone().requires_grad_(True)
        w2 = experts.fc2.weight[e].detach().clone().requires_grad_(True)
        if rp:
            lin1 = dense_linear(cfg, experts.fc1, 2 * e, ctx)
            lin2 = dense_linear(cfg, experts.fc2, 2 * e + 1, ctx)
            with ctx.autocast():
                h = experts.act(lin1(xe, w1))
                ye = lin2((h * pe.unsqueeze(-1)).to(h.dtype), w2)[:r]
            ye.backward(dy.split(M_SPLITS)[e])
        else:
            ye = torch.zeros(0, dy.shape[1], dtype=BF16)
        ys.append(ye.detach())
        dxs.append(xe.grad[:r] if xe.grad is not None else torch.zeros(0, x.shape[1]))
        dps.append(pe.grad[:r] if pe.grad is not None else torch.zeros(0))
        dw1.append(w1.grad if w1.grad is not None else torch.zeros_like(w1))
        dw2.append(w2.grad if w2.grad is not None else torch.zeros_like(w2))
    assert torch.equal(y, torch.cat(ys))
    assert torch.equal(x.grad, torch.cat(dxs).to(x.grad.dtype))
    assert torch.equal(probs.grad, torch.cat(dps))
    assert torch.equal(experts.fc1.weight.grad, torch.stack(dw1))
    assert torch.equal(experts.fc2.weight.grad, torch.stack(dw2))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_padding_rows_change_no_real_rows_output(recipe):
    """Zero rows raise no amax and sit after an expert's real rows: every real row's output and input
    gradient are those of the unpadded rows (fprop and dgrad read rowwise copies)."""
    cfg, backend, model = backend_and_model(recipe)
    experts = model.blocks[0].mlp.experts
    g = torch.Generator().manual_seed(4)
    m = sum(M_SPLITS)
    x = torch.randn(m, experts.fc1.in_features, generator=g).to(BF16)
    probs = torch.rand(m, generator=g)
    dy = torch.randn(m, experts.fc2.out_features, generator=g).to(BF16)
    results = []
    for align in (ALIGN[recipe], 0):
        experts.fc1.align_size = experts.fc2.align_size = align
        xi = x.clone().requires_grad_(True)
        with backend.autocast():
            y = experts(xi, M_SPLITS, probs)
        y.backward(dy)
        results.append((y.detach(), xi.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_tiny_moe_trains_under_each_recipe(recipe, tmp_path):
    cfg = compose_cfg("model=qwen3_moe_tiny", *RUN, f"recipe={recipe}", "steps=2", "log_interval=1",
                      "micro_batch_size=4", "global_batch_size=4", "optimizer.lr=1e-2")  # fmt: skip
    s = run(cfg, tmp_path)
    assert s.status == "completed"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r[M.LOSS_TRAIN] for r in rows if M.LOSS_TRAIN in r]
    assert len(losses) == 2 and losses[-1] < losses[0], losses
    quantized = json.loads((tmp_path / "run.json").read_text())["provenance"]["quantized_modules"]
    assert quantized["blocks.1.mlp.experts.fc2"] == recipe


def test_an_override_takes_a_whole_expert_group_and_refuses_part_of_one():
    whole = "stability.overrides=[{pattern:'blocks.1.mlp.experts.fc1',recipe:bf16}]"
    cfg, backend, model = backend_and_model("tensorwise", whole)
    experts = model.blocks[1].mlp.experts
    assert experts.fc1.quants is None and len(experts.fc2.quants) == 8
    assert experts.fc1.align_size == 0 and experts.fc2.align_size == 16
    assert model.blocks[0].mlp.experts.fc1.quants is not None
    for part in ("blocks.1.mlp.experts.fc1.3", "*.experts.fc2.[0-3]"):
        bad = compose_config(["model=qwen3_moe_tiny", "hardware=cpu", "recipe=tensorwise",
                              f"stability.overrides=[{{pattern:'{part}',recipe:bf16}}]"])  # fmt: skip
        with pytest.raises(ConfigError) as exc:
            prepare(bad)
        assert f"pattern={part} selects experts of blocks." in str(exc.value)
        assert "\n" not in str(exc.value) and "an expert group runs under one recipe" in str(exc.value)


def megatron_pad_routing_map(routing_map, pad_multiple):
    """Megatron-LM's moe_utils.py: pad_routing_map (d98e8a6), as written there."""
    routing_map = routing_map.clone().transpose(0, 1)
    num_ones = routing_map.sum(dim=1)
    num_to_pad = (-num_ones) % pad_multiple
    is_zero = routing_map == 0
    zero_ranks = torch.cumsum(is_zero.int(), dim=1)
    mask = zero_ranks <= num_to_pad.unsqueeze(1)
    routing_map[mask] = 1
    return routing_map.transpose(0, 1)


def test_pad_routing_map_is_megatrons():
    g = torch.Generator().manual_seed(5)
    routing_map = torch.rand(40, 6, generator=g) < 0.3
    routing_map[:, 2] = False  # an empty expert stays empty
    routing_map[:, 4] = True  # every token routed: 40 = 2 x 16 + 8 cannot be aligned
    padded = R.pad_routing_map(routing_map, 16)
    assert torch.equal(padded, megatron_pad_routing_map(routing_map, 16))
    counts = padded.sum(0)
    assert counts[2] == 0 and counts[4] == 40
    assert all(int(c) % 16 == 0 for i, c in enumerate(counts) if i != 4)
    assert (padded | ~routing_map).all() and (padded >= routing_map).all()


def moe_forward(moe, backend, x):
    """(fc1's input rows and m_splits, the layer's output, its router losses)."""
    seen = []
    hook = moe.experts.fc1.register_forward_pre_hook(lambda mod, args: seen.append((args[0], list(args[1]))))
    with backend.autocast():
        y = moe(x)
    hook.remove()
    return seen[0], y, {k: v[1] for k, v in moe.losses.items()}


def test_router_padding_routes_real_tokens_at_probability_zero_and_changes_the_expert_scales():
    """Both modes on one routing (docs/numerics_grouped.md §5): aligned counts either way; router
    padding puts real tokens where the default puts zero rows, so fc1's per-expert input amax (the
    tensorwise scale) differs; the router's losses are the unpadded map's in both."""
    results = {}
    for mode in ("false", "true"):
        cfg, backend, model = backend_and_model(
            "tensorwise", f"model.moe_router_padding_for_quantization={mode}"
        )
        moe = model.blocks[0].mlp
        x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(6)).to(BF16)
        x[0, 0] *= 16  # token 0, the first an expert that needs padding takes unless routed to it
        results[mode] = moe_forward(moe, backend, x)
    (x_zero, m_zero), _, losses_zero = results["false"]
    (x_routed, m_routed), _, losses_routed = results["true"]
    assert all(m % 16 == 0 for m in m_zero) and all(m % 16 == 0 for m in m_routed)
    assert losses_zero == losses_routed
    amax = {}
    for mode, (rows, splits) in (("false", (x_zero, m_zero)), ("true", (x_routed, m_routed))):
        amax[mode] = [float(r.float().abs().max()) if len(r) else 0.0 for r in rows.split(splits)]
    assert all(b >= a for a, b in zip(amax["false"], amax["true"]))
    assert any(b > a for a, b in zip(amax["false"], amax["true"]))
    # the same aligned counts; the default's padding rows are zeros after each expert's real rows
    tokens = x.transpose(0, 1).reshape(-1, 64)
    with torch.no_grad():
        counts = moe.router(tokens, 64)[1].sum(0).tolist()
    assert m_zero == m_routed == [-(-c // 16) * 16 for c in counts]
    for c, rows in zip(counts, x_zero.split(m_zero)):
        assert not rows[c:].any() and (rows[:c].abs().sum(1) > 0).all()


def test_router_padding_refuses_an_expert_it_cannot_align():
    cfg, backend, model = backend_and_model("nvfp4", "model.moe_router_padding_for_quantization=true")
    moe = model.blocks[0].mlp
    x = torch.randn(1, 64, 64, generator=torch.Generator().manual_seed(7)).to(BF16)  # 64 tokens < 128
    with pytest.raises(ValueError, match=r"padding_for_quantization=true: expert \d has 64 tokens"):
        with backend.autocast():
            moe(x)


def test_int4_scope_routed_experts_fake_quantizes_the_experts_only():
    _, _, model = backend_and_model("int4_qat", "recipe.int4_scope=routed_experts")
    block = model.blocks[0]
    assert all(isinstance(q, FakeQuantLinear) for q in block.mlp.experts.fc1.quants)
    assert all(isinstance(q, FakeQuantLinear) for q in block.mlp.experts.fc2.quants)
    assert block.attn.qkv.quant is None and block.attn.proj.quant is None
    _, _, everywhere = backend_and_model("int4_qat")
    assert isinstance(everywhere.blocks[0].attn.qkv.quant, FakeQuantLinear)
    dense = compose_config(
        ["model=qwen3_tiny", "hardware=cpu", "recipe=int4_qat", "recipe.int4_scope=routed_experts"]
    )
    with pytest.raises(ConfigError, match="int4_scope=routed_experts without model.num_moe_experts"):
        prepare(dense)
    bad = compose_config(
        ["model=qwen3_moe_tiny", "hardware=cpu", "recipe=int4_qat", "recipe.int4_scope=experts"]
    )
    with pytest.raises(ConfigError, match="recipe.int4_scope=experts"):
        prepare(bad)


@pytest.mark.parametrize("routed", [False, True], ids=["zero_rows", "router_padding"])
@pytest.mark.parametrize("recipe", list(P.RECIPES))
def test_fast_gemms_quantize_each_expert_as_the_reference_path(recipe, routed, monkeypatch):
    """The experts' fast path (the default on CUDA; here forced on the CPU, its fused casts eager:
    inductor's C++ build is test_fast_path.py's slow lane) makes every expert's
    codes, scales and GEMM operands of the reference path at atol=0, and its delayed-scaling
    histories; its GEMMs give the reference's results exactly where the operands carry their
    scales (power-of-two scales), and within the fold's rounding where tensorwise and NVFP4 fold
    theirs into the GEMM (harness.numerics.fast). fc1 takes zero padding rows; fc2 the router
    padding's signed zeros. tests/test_moe_gpu.py runs the same cases on CUDA against the CPU."""
    monkeypatch.setattr(fast_paths, "compile_available", lambda device: (False, "not compiled in this test"))
    fc = "fc2" if routed else "fc1"
    runs = []
    for fast in (False, True):
        backend, model = P.build(recipe, "cpu", fast)
        group = getattr(model.blocks[0].mlp.experts, fc)
        splits, steps = P.case_inputs(recipe, group, routed)
        runs.append((backend, *P.run_group(backend, group, splits, steps, "cpu")))
    (ref_b, want, want_codes), (fast_b, got, got_codes) = runs
    assert all(fast_b.modules[f"{group.name}.{e}"].fast_gemm for e in range(group.num_gemms))
    assert len(want_codes) == 3 * 6 + 2, sorted(want_codes)  # input, weight, grad; weight only if empty
    assert not P.code_mismatches(want_codes, got_codes)
    assert not P.state_mismatches(ref_b, fast_b)
    for (y, dx, dw), (y2, dx2, dw2) in zip(want, got):
        if recipe in ("tensorwise_pow2", "blockwise", "mxfp8"):
            assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)
        else:
            k = group.in_features
            assert P.beyond_gemm_bound(y, y2, k) == 0 and P.beyond_gemm_bound(dx, dx2, y.shape[1]) == 0
            assert P.beyond_gemm_bound(dw, dw2, sum(splits)) == 0


def test_nvfp4_one_token_expert_rht_chunk_is_its_row_over_four():
    """docs/numerics_grouped.md §7: under NVFP4 an expert with one token is padded to 128 rows; its
    grad's wgrad (columnwise) copy transforms the 16-row chunk of that token and 15 zero rows, where
    each output has one nonzero product: the token's gradient / 4, exactly, in all 16 rows (the
    first Hadamard row and sign are +1); the chunks of zero rows stay zero."""
    from harness.numerics.nvfp4 import rht_tokens

    backend, model = P.build("nvfp4", "cpu", False)
    group = model.blocks[0].mlp.experts.fc1
    codes = P.record_codes(backend)
    g = torch.Generator().manual_seed(8)
    x = torch.zeros(128, group.in_features, dtype=BF16)
    dy = torch.zeros(128, group.out_features, dtype=BF16)
    x[0] = torch.randn(group.in_features, generator=g).to(BF16)
    dy[0] = (torch.randn(group.out_features, generator=g) / 8).to(BF16)
    with backend.autocast():
        y = group(x.requires_grad_(True), [128] + [0] * (group.num_gemms - 1))
    y.backward(dy)
    transformed = rht_tokens(dy)
    assert torch.equal(transformed[:16], (dy[0].float() / 4).to(BF16).expand(16, -1))
    assert not transformed[16:].any()
    [(_, wgrad_copy)] = codes[(f"{group.name}.0", "grad")]
    assert wgrad_copy.rht
    deq = wgrad_copy.dequantize()  # (128, N): the transformed rows, quantized
    assert torch.equal(deq[:16], deq[:1].expand(16, -1)) and not deq[16:].any()
    assert deq[0].abs().max() > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8", "nvfp4"])
def test_router_padding_signed_zeros_keep_their_sign_in_fc2_input_codes(recipe):
    """docs/numerics_grouped.md §5: under router padding a token at probability 0 reaches fc2 as
    act(h) * 0, a signed zero; every cast keeps the sign (E4M3 code 0x80, E2M1 -0), as TE's
    per-tensor cast does; +0.0 stays 0x00. Both dequantize to zero."""
    backend, model = P.build(recipe, "cpu", False)
    group = model.blocks[0].mlp.experts.fc2
    splits, steps = P.case_inputs(recipe, group, routed=True, steps=1)
    _, codes = P.run_group(backend, group, splits, steps, "cpu")
    x = steps[0][0]
    for e, rows in enumerate(x.split(splits)):
        if not len(rows):
            continue
        [(row, _)] = codes[(f"{group.name}.{e}", "input")]
        zero = rows == 0
        negative = zero & torch.signbit(rows)
        assert negative.any() and (zero & ~negative).any(), e
        if recipe == "nvfp4":
            signs = torch.signbit(row.elems[: rows.shape[0], : rows.shape[1]])
        else:
            signs = row.data.view(torch.uint8)[: rows.shape[0], : rows.shape[1]] == 0x80
        assert torch.equal(signs[zero], negative[zero]), e
