"""Mixture-of-experts models (harness/model/moe.py, routing.py) against Megatron Core's formulas:
routing, capacity dropping, permutation, router losses and the expert bias, an MoE layer of
identical experts against the dense MLP, FLOPs from active parameters, training and resume of the
tiny presets, and the refusals of the MoE fields. In-process, BF16 on the emulated backend.

The `megatron_*` functions are Megatron-LM's unfused code (megatron/core/transformer/moe/moe_utils.py
at d98e8a6), kept as written there, so that lowp's vectorised code is checked against the reference
and not against itself."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from harness.backends import build_backend
from harness.backends.emulated import EmulatedGroupedLinear
from harness.config.errors import ConfigError
from harness.lifecycle import checkpoint as ckpt
from harness.lifecycle import metrics as M
from harness.lifecycle.artifacts import Summary
from harness.model import routing as R
from harness.model.gpt import count_params, flops_per_token
from harness.model.moe import MoE
from harness.train import Trainer, backend_spec, run
from harness.validation.load import compose_config, prepare
from tests.helpers import compose_cfg

BF16 = torch.bfloat16
RUN = ["backend=emulated", "hardware=cpu", "logger=none", "eval_interval=0", "eval_tokens=512"]
RUN += ["data.num_tokens=20000", "optimizer.warmup_steps=1", "checkpoint_interval=-1"]


# -- Megatron-LM's code (moe_utils.py), the reference --------------------------------------------------


def megatron_topk(logits, topk, use_pre_softmax=False, scaling_factor=None, score_function="softmax",
                  expert_bias=None):  # fmt: skip
    """topk_routing_with_score_function, unfused, without group-limited routing."""
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs, top_indices = torch.topk(scores, k=topk, dim=1)
        else:
            scores, top_indices = torch.topk(logits, k=topk, dim=1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            scores_for_routing = scores + expert_bias.float()
            _, top_indices = torch.topk(scores_for_routing, k=topk, dim=1)
            scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            scores, top_indices = torch.topk(scores, k=topk, dim=1)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def megatron_drop(routing_probs, routing_map, router_topk, capacity_factor):
    """apply_router_token_dropping, drop_policy='probs', pad_to_capacity=False."""
    num_tokens, num_experts = routing_probs.shape
    expert_capacity = math.ceil((num_tokens * router_topk / num_experts) * capacity_factor)
    if expert_capacity > num_tokens:
        capacity_mask = torch.ones_like(routing_probs).bool()
    else:
        _, capacity_indices = torch.topk(routing_probs, k=expert_capacity, dim=0, sorted=False)
        capacity_mask = torch.zeros_like(routing_probs).scatter(0, capacity_indices, 1).bool()
    final_map = torch.logical_and(routing_map, capacity_mask)
    return routing_probs * final_map, final_map


def megatron_permute(tokens, routing_map, num_out_tokens):
    """permute, unfused, dropless (the argsort of the transposed map)."""
    num_tokens, _ = tokens.shape
    routing_map = routing_map.bool().T.contiguous()
    flat_sorted = routing_map.reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    sorted_indices = flat_sorted % num_tokens
    return tokens.index_select(0, sorted_indices), sorted_indices


def megatron_unpermute(permuted_tokens, sorted_indices, restore_shape):
    """unpermute without probs (scatter_add_ into zeros of the tokens' dtype)."""
    _, hidden = restore_shape
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype)
    out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return out


# -- routing ------------------------------------------------------------------------------------------


def logits_of(dtype, tokens=48, experts=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=g, dtype=torch.float64) * 2).to(dtype)


ROUTINGS = {
    "softmax after top-k": dict(topk=2),
    "softmax before top-k": dict(topk=2, pre_softmax=True),
    "softmax top-1": dict(topk=1, pre_softmax=True),
    "topk scaling": dict(topk=4, scaling_factor=2.5),
    "sigmoid": dict(topk=2, score_function="sigmoid"),
    "sigmoid top-1": dict(topk=1, score_function="sigmoid"),
    "sigmoid + expert bias": dict(topk=3, score_function="sigmoid", expert_bias=True),
}


@pytest.mark.parametrize("dtype", [BF16, torch.float32, torch.float64], ids=["bf16", "fp32", "fp64"])
@pytest.mark.parametrize("case", list(ROUTINGS))
def test_topk_routing_is_megatrons(case, dtype):
    kw = dict(ROUTINGS[case])
    bias = torch.linspace(-0.3, 0.3, 8) if kw.pop("expert_bias", False) else None
    logits = logits_of(dtype)
    probs, routing_map = R.topk_routing(logits, expert_bias=bias, **kw)
    want_probs, want_map = megatron_topk(
        logits, kw["topk"], kw.get("pre_softmax", False), kw.get("scaling_factor"),
        kw.get("score_function", "softmax"), bias,
    )  # fmt: skip
    assert probs.dtype == dtype
    assert torch.equal(routing_map, want_map) and torch.equal(probs, want_probs)
    assert (routing_map.sum(1) == kw["topk"]).all()
    if bias is not None:  # the bias moved the choice, not the weights: those are the plain sigmoid's
        chosen = torch.sigmoid(logits.float()).masked_fill(~routing_map, 0)
        want = (chosen / chosen.sum(1, keepdim=True)).to(dtype)
        torch.testing.assert_close(probs, want, rtol=1e-2 if dtype == BF16 else 1e-6, atol=0)
        assert not torch.equal(routing_map, megatron_topk(logits, 3, score_function="sigmoid")[1])


def test_softmax_after_topk_is_the_renormalised_softmax():
    """Megatron's post-top-k softmax is Mixtral's (and Qwen3-MoE's norm_topk_prob) renormalisation."""
    logits = logits_of(torch.float64)
    probs, routing_map = R.topk_routing(logits, 2)
    full = torch.softmax(logits, -1).masked_fill(~routing_map, 0)
    torch.testing.assert_close(probs, full / full.sum(1, keepdim=True), rtol=1e-6, atol=0)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
def test_capacity_dropping_is_megatrons(factor):
    logits = logits_of(torch.float32, tokens=40, experts=4)
    probs, routing_map = R.topk_routing(logits, 2)
    got = R.drop_tokens(probs, routing_map, 2, factor)
    want = megatron_drop(probs, routing_map, 2, factor)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cap = math.ceil(40 * 2 / 4 * factor)
    assert (got[1].sum(0) <= cap).all()
    if cap < routing_map.sum(0).max():  # some dropped: each expert kept its most probable tokens
        e = int(routing_map.sum(0).argmax())
        kept, dropped = probs[got[1][:, e], e], probs[routing_map[:, e] & ~got[1][:, e], e]
        assert kept.min() >= dropped.max()


def test_permute_is_megatrons_and_unpermute_sums_each_tokens_copies():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(-8, 8, (24, 16), generator=g).double()
    _, routing_map = R.topk_routing(logits_of(torch.float32, tokens=24, experts=6), 3)
    permuted, order = R.permute(tokens, routing_map)
    want, want_order = megatron_permute(tokens, routing_map, int(routing_map.sum()))
    assert torch.equal(permuted, want) and torch.equal(order, want_order)
    # contiguous per-expert rows: expert e's rows are its tokens, in token order
    splits = routing_map.sum(0).tolist()
    for e, rows in enumerate(permuted.split(splits)):
        assert torch.equal(rows, tokens[routing_map[:, e]])
    back = R.unpermute(permuted, order, 24)
    assert torch.equal(back, tokens * 3)  # each token's three copies added back (exact in fp64)
    assert torch.equal(back, megatron_unpermute(permuted, order, (24, 16)))
    probs = torch.rand(24, 6, generator=g) * routing_map
    per_row = R.permute_probs(probs, routing_map)
    assert torch.equal(per_row, torch.cat([probs[routing_map[:, e], e] for e in range(6)]))


# -- router losses and the expert bias -----------------------------------------------------------------


def hand_aux_loss(scores, routing_map, topk, coeff):
    """coeff * E * sum_i f_i P_i in float64 loops: f_i the share of the T*k slots, P_i the mean score."""
    T, E = scores.shape
    total = 0.0
    for i in range(E):
        f = sum(bool(routing_map[t, i]) for t in range(T)) / (T * topk)
        p = sum(float(scores[t, i]) for t in range(T)) / T
        total += f * p
    return coeff * E * total


def test_router_losses_have_their_formulas_values():
    S, B, E, k = 12, 3, 8, 2
    logits = logits_of(torch.float32, tokens=S * B, experts=E, seed=3)
    for score in ("softmax", "sigmoid"):
        aux_map, scores = R.aux_loss_scores(logits, k, score)
        want = hand_aux_loss(scores.double(), aux_map, k, 0.01)
        assert R.aux_loss(scores, aux_map, k, 0.01).item() == pytest.approx(want, rel=1e-6)
        # per sequence (rows in Megatron's [s, b] order): the mean over sequences of each one's loss
        seqs = [hand_aux_loss(scores[b::B].double(), aux_map[b::B], k, 0.01) for b in range(B)]
        got = R.seq_aux_loss(scores, aux_map, S, k, 0.01).item()
        assert got == pytest.approx(sum(seqs) / B, rel=1e-6)
    lse = [math.log(sum(math.exp(float(v)) for v in row)) for row in logits]
    want_z = 1e-3 * sum(v * v for v in lse) / len(lse)
    assert R.z_loss(logits, 1e-3).item() == pytest.approx(want_z, rel=1e-6)
    # a perfectly balanced router's switch loss is coeff (E * E * (1/E) * (1/E))
    flat, flat_map = torch.full((S * B, E), 1.0 / E), torch.zeros(S * B, E, dtype=torch.bool)
    flat_map[torch.arange(S * B), torch.arange(S * B) % E] = True
    assert R.aux_loss(flat, flat_map, 1, 0.01).item() == pytest.approx(0.01)


def test_expert_bias_update_is_megatrons_sign_step():
    counts = torch.tensor([[10.0, 2.0, 6.0, 6.0], [0.0, 0.0, 0.0, 24.0]])
    bias = torch.tensor([[0.1, 0.0, -0.1, 0.0], [0.0, 0.0, 0.0, 0.0]])
    got = R.updated_expert_bias(counts, bias, 1e-3)
    want = torch.tensor([[0.1 - 1e-3, 1e-3, -0.1, 0.0], [1e-3, 1e-3, 1e-3, -1e-3]])
    assert torch.equal(got, want)


def moe_cfg(*extra: str):
    return compose_cfg("model=qwen3_moe_tiny", *RUN, *extra)


def build(cfg):
    torch.manual_seed(0)
    return build_backend(backend_spec(cfg), torch.device("cpu")).build_model()


def test_router_module_routes_its_gemms_logits_as_megatron_and_counts_for_the_bias():
    cfg = moe_cfg(
        "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
        "model.moe_router_dtype=null", "model.moe_router_topk_scaling_factor=2.5",
        "model.moe_z_loss_coeff=1e-3", "model.moe_router_load_balancing_type=seq_aux_loss",
    )  # fmt: skip
    router = build(cfg).blocks[0].mlp.router
    router.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6 * 4, 64, generator=g)
    probs, routing_map, losses = router(x, 6)
    logits = (x.to(BF16).float() @ router.weight.to(BF16).float().t()).to(BF16)  # bf16 GEMM, fp32 sums
    want = megatron_topk(
        logits, 2, scaling_factor=2.5, score_function="sigmoid", expert_bias=router.expert_bias
    )
    assert torch.equal(probs, want[0]) and torch.equal(routing_map, want[1]) and probs.dtype == BF16
    assert torch.equal(router.local_tokens_per_expert, routing_map.sum(0).float())
    assert set(losses) == {"z_loss", "seq_load_balancing_loss"}
    term, logged = losses["z_loss"]
    assert term.item() == pytest.approx(1e-3 * logged.item()) and term.requires_grad
    with torch.no_grad():  # evaluation: no losses, no counts
        router(x, 6)
    assert torch.equal(router.local_tokens_per_expert, routing_map.sum(0).float())


# -- the MoE layer and the model -----------------------------------------------------------------------


def test_moe_of_identical_experts_is_the_dense_mlp():
    """Every expert the dense MLP, the router's logits all 0: each token's two experts weigh 1/2
    each, exactly, so the MoE model's logits are the dense model's bit for bit."""
    shape = ["model.num_moe_experts=null", "model.moe_ffn_hidden_size=null", "model.ffn_hidden_size=32"]
    dense, moe = build(moe_cfg(*shape)), build(moe_cfg("model.ffn_hidden_size=32"))
    state = dense.state_dict()
    for i in range(2):
        for fc in ("fc1", "fc2"):
            state[f"blocks.{i}.mlp.experts.{fc}.weight"] = state.pop(f"blocks.{i}.mlp.{fc}.weight").expand(
                8, -1, -1
            )
        state[f"blocks.{i}.mlp.router.weight"] = torch.zeros(8, 64)
    moe.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(moe(idx), dense(idx))
    assert isinstance(moe.blocks[1].mlp, MoE) and not isinstance(dense.blocks[1].mlp, MoE)


def test_grouped_linear_runs_each_experts_gemm_on_its_rows_and_an_idle_expert_gets_a_zero_grad():
    g = torch.Generator().manual_seed(0)
    grouped = EmulatedGroupedLinear("blocks.0.mlp.experts.fc1", 4, 8, 6, wgrad_fp32=True)
    x = torch.randn(5, 8, generator=g, requires_grad=True)
    y = grouped(x, [2, 0, 3, 0])
    w16 = grouped.weight.detach().to(BF16).float()
    want = torch.cat(
        [x[:2].detach().to(BF16).float() @ w16[0].t(), x[2:].detach().to(BF16).float() @ w16[2].t()]
    )
    assert y.dtype == BF16 and torch.equal(y, want.to(BF16))
    dy = torch.randn(5, 6, generator=g)
    y.backward(dy)
    dw = grouped.weight.grad
    assert not dw[1].any() and not dw[3].any()
    assert torch.equal(dw[2], dy[2:].to(BF16).float().t() @ x[2:].detach().to(BF16).float())  # fp32 dW


def test_an_moe_forward_calls_every_experts_gemm_once(monkeypatch):
    cfg = moe_cfg("model.moe_layer_freq=[0,1]", "model.moe_shared_expert_intermediate_size=48",
                  "model.moe_shared_expert_gate=true")  # fmt: skip
    model = build(cfg)
    assert not isinstance(model.blocks[0].mlp, MoE) and isinstance(model.blocks[1].mlp, MoE)
    calls = []
    real = EmulatedGroupedLinear.expert_linear

    def counted(self, index, x, weight):
        calls.append((self.name, index, x.shape[0]))
        return real(self, index, x, weight)

    monkeypatch.setattr(EmulatedGroupedLinear, "expert_linear", counted)
    idx = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    model.loss(idx, idx).backward()
    for fc in ("fc1", "fc2"):
        rows = [(e, m) for name, e, m in calls if name == f"blocks.1.mlp.experts.{fc}"]
        assert [e for e, _ in rows] == list(range(8)) and sum(m for _, m in rows) == 2 * 64 * 2
    mlp = model.blocks[1].mlp
    for p in (mlp.shared_experts_gate, mlp.router.weight, mlp.shared_experts.fc1.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_flops_count_the_parameters_a_token_uses():
    """qwen3_moe_tiny by hand: per layer attention, norms, the router and 2 of the 8 experts."""
    cfg = moe_cfg()
    m = cfg.model
    n = count_params(build(cfg))
    h, f, E, k, D = m.hidden_size, m.moe_ffn_hidden_size, m.num_moe_experts, m.moe_router_topk, m.kv_channels
    attention = h * (4 + 2 * 2) * D + 4 * D * h + 2 * D  # qkv (4 heads, 2 groups), proj, q/k norms
    expert = h * 2 * f + f * h  # swiglu fc1 (gate and value) and fc2
    layer = attention + 2 * h + E * h + k * expert  # + ln1, ln2, router
    active = 2 * layer + h + m.vocab_size * h  # + ln_f and the untied LM head
    assert n["active_non_embedding"] == active
    assert n["non_embedding"] - active == 2 * (E - k) * expert
    assert flops_per_token(m, active) == 6 * active + 6 * 2 * 4 * D * m.seq_length
    # the routed experts' part is Megatron's num_floating_point_operations term: 6 h F k x 3 per layer
    assert 6 * 2 * k * expert == 2 * 6 * h * (f * k * 3)


# -- training, logging, memory and resume --------------------------------------------------------------


@pytest.mark.parametrize("preset", ["qwen3_moe_tiny", "mixtral_tiny"])
def test_tiny_moe_presets_train(preset, tmp_path):
    cfg = compose_cfg(f"model={preset}", *RUN, "steps=6", "log_interval=1", "micro_batch_size=4",
                      "global_batch_size=8", "optimizer.lr=1e-2")  # fmt: skip
    s = run(cfg, tmp_path)
    assert s.status == "completed"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if M.LOSS_TRAIN in r]
    assert train[-1][M.LOSS_TRAIN] < train[0][M.LOSS_TRAIN] - 0.05
    assert all(0.5 < r[M.MOE_LOAD_BALANCING_LOSS] < 2.5 for r in train)  # E * sum f P, 1 when balanced
    run_json = json.loads((tmp_path / "run.json").read_text())["provenance"]
    params = run_json["params"]
    assert params["active_non_embedding"] < params["non_embedding"]
    assert run_json["flops_per_token"] == flops_per_token(cfg.model, params["active_non_embedding"])
    mem = s.memory
    m = cfg.model
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    expert_bytes = 2 * m.num_moe_experts * 3 * m.hidden_size * f * 4  # 2 layers, fp32
    assert mem["expert_params_gib"] * 2**30 == expert_bytes
    assert 0 < mem["expert_activations_saved_gib"] < mem["saved_for_backward_gib"]


def test_router_loss_keys_are_the_contracts():
    names = {f"{M.MOE}/{n}" for n in (*R.LOSS_NAMES.values(), "z_loss")}
    assert names <= set(M.ALL_KEYS)


def test_expert_bias_moves_each_step_and_a_checkpoint_resumes_it_exactly(tmp_path):
    overrides = [
        "model=qwen3_moe_tiny", *RUN, "steps=4", "micro_batch_size=2", "global_batch_size=4",
        "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
        "model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_aux_loss_coeff=1e-4",
        "model.moe_z_loss_coeff=1e-3", "model.moe_shared_expert_intermediate_size=32",
        "model.moe_shared_expert_gate=true",
    ]  # fmt: skip
    cfg = prepare(compose_config(overrides))
    a = Trainer(cfg, tmp_path / "a")
    routers = [layer.router for layer in a.moe.layers]
    a.train_step(0)
    steps = torch.tensor([-1e-3, 0.0, 1e-3])
    for r in routers:  # one sign step of the update rate from 0 for each expert, the counts zeroed
        assert torch.isin(r.expert_bias, steps).all() and r.expert_bias.any()
        assert not r.local_tokens_per_expert.any()
    a.train_step(1)
    assert set(a.moe.metrics) == {"z_loss", "seq_load_balancing_loss"}
    assert all(torch.isin(r.expert_bias, torch.cat([steps, 2 * steps])).all() for r in routers)
    tensors, skeleton = ckpt.split(a.state_dict(2, Summary()))
    tensors = {k: v.clone() for k, v in tensors.items()}  # as stored: nothing shared with `a`
    b = Trainer(prepare(compose_config(overrides)), tmp_path / "b")
    b.load_state_dict(ckpt.join(json.loads(json.dumps(skeleton)), tensors), Summary())
    assert all(torch.equal(r.expert_bias, s.router.expert_bias) for r, s in zip(routers, b.moe.layers))
    for step in (2, 3):
        assert torch.equal(a.train_step(step)[0], b.train_step(step)[0])
        assert {k: v.item() for k, v in a.moe.metrics.items()} == {
            k: v.item() for k, v in b.moe.metrics.items()
        }
    assert all(torch.equal(r.expert_bias, s.router.expert_bias) for r, s in zip(routers, b.moe.layers))


def test_a_step_without_router_losses_logs_none(tmp_path):
    cfg = prepare(compose_config(["model=mixtral_tiny", *RUN, "steps=1", "micro_batch_size=2",
                                  "global_batch_size=2", "model.moe_aux_loss_coeff=0"]))  # fmt: skip
    t = Trainer(cfg, tmp_path)
    t.train_step(0)
    assert t.moe.metrics == {}


# -- refusals ------------------------------------------------------------------------------------------

REFUSED = {
    "model.moe_router_score_function=sqrtsoftplus": "function=sqrtsoftplus: Megatron's, not implemented",
    "model.moe_router_load_balancing_type=sinkhorn": "type=sinkhorn: Megatron's, not implemented",
    "model.moe_router_load_balancing_type=global_aux_loss": "=global_aux_loss: Megatron's, not implemented",
    "model.moe_router_load_balancing_type=quantile_balancing": "=quantile_balancing: Megatron's, not implem",
    "model.moe_router_score_function=relu": "moe_router_score_function=relu: unknown",
    "model.moe_router_dtype=fp16": "moe_router_dtype=fp16: unknown",
    "model.num_moe_experts=0": "num_moe_experts=0: must be >= 1",
    "model.moe_router_topk=9": "moe_router_topk=9: must be 1..model.num_moe_experts=8",
    "model.moe_router_topk=1": "moe_router_topk=1 with softmax needs model.moe_router_pre_softmax=true",
    "model.moe_router_enable_expert_bias=true": "needs model.moe_router_score_function=sigmoid",
    "model.moe_layer_freq=[1,0,1]": "a pattern needs one 0 (dense) or 1 (MoE) per layer",
    "model.moe_layer_freq=0": "moe_layer_freq=0: must be >= 1",
    "model.moe_expert_capacity_factor=-1.0": "moe_expert_capacity_factor=-1.0: must be > 0",
    "model.moe_aux_loss_coeff=-0.1": "moe_aux_loss_coeff=-0.1: must be >= 0",
    "model.moe_z_loss_coeff=0": "moe_z_loss_coeff=0: must be > 0 (null = no z-loss)",
    "model.moe_router_padding_for_quantization=true": "pads to an FP8/FP4 recipe's alignment",
    "model.add_bias_linear=true": "model.add_bias_linear=true with model.num_moe_experts",
}
REFUSED_RUNS = {  # whole groups: composed
    "stability.overrides=[{pattern:'*.experts.fc1.0',recipe:mxfp8}]": "selects experts of blocks.0",
    (
        "backend=te hardware=h100 recipe=tensorwise optimizer.fp8_param=true "
        "optimizer.use_distributed_optimizer=true"
    ): "TE experts keep bf16 weights",
}


@pytest.fixture(scope="module")
def moe_config():
    return compose_config(["model=qwen3_moe_tiny", "hardware=cpu"])


def _with(cfg, override: str):
    """`cfg` with one model field set as Hydra would parse `override` (no composition)."""
    key, text = override.split("=", 1)
    value = {"true": True, "false": False, "null": None}.get(text, text)
    if isinstance(value, str) and value[0] in "[-0123456789":
        value = json.loads(value)
    model = dataclasses.replace(cfg.model, **{key.removeprefix("model."): value})
    return dataclasses.replace(cfg, model=model)


def _one_line_error(cfg) -> str:
    with pytest.raises(ConfigError) as exc:
        prepare(cfg)
    assert "\n" not in str(exc.value)
    return str(exc.value)


@pytest.mark.parametrize("override", list(REFUSED))
def test_refused_moe_settings_name_the_value(moe_config, override):
    assert REFUSED[override] in _one_line_error(_with(moe_config, override))


@pytest.mark.parametrize("overrides", list(REFUSED_RUNS))
def test_moe_refuses_what_it_cannot_run_yet(overrides):
    cfg = compose_config(["model=qwen3_moe_tiny", "hardware=cpu", *overrides.split()])
    assert REFUSED_RUNS[overrides] in _one_line_error(cfg)


def test_moe_ffn_size_without_experts_and_the_megatron_export_are_refused(moe_config):
    dense = _with(moe_config, "model.num_moe_experts=null")
    assert "moe_ffn_hidden_size=32 without model.num_moe_experts" in _one_line_error(dense)
    with pytest.raises(ConfigError, match="lowp's MoE layers have no biases"):
        prepare(_with(moe_config, "model.add_bias_linear=true"), for_export=True)


def test_te_backend_knows_an_moe_blocks_linears_and_int4_weights():
    """Without TE: the TE backend asks the plan about an MoE block's own linears (its expert groups and
    shared expert, for the block's autocast) and fake-quantizes INT4 GEMM weights by canonical name,
    expert groups whole, never a norm, the router or the LM head."""
    from harness.backends.te import GEMM_WEIGHT, block_linears

    cfg = compose_config(["model=qwen3_moe_tiny", "model.moe_layer_freq=[0,1]", "hardware=cpu",
                          "model.moe_shared_expert_intermediate_size=32"])  # fmt: skip
    assert block_linears(cfg.model, 0) == ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    assert block_linears(cfg.model, 1) == ("attn.qkv", "attn.proj", "mlp.experts.fc1", "mlp.experts.fc2",
                                           "mlp.shared_experts.fc1", "mlp.shared_experts.fc2")  # fmt: skip
    names = ["blocks.0.attn.qkv.weight", "blocks.1.mlp.experts.fc1.weight",
             "blocks.1.mlp.shared_experts.fc2.weight", "blocks.0.mlp.fc2.weight", "blocks.0.ln1.weight",
             "blocks.1.mlp.router.weight", "blocks.0.attn.qkv.bias", "lm_head.weight"]  # fmt: skip
    assert [n for n in names if GEMM_WEIGHT.fullmatch(n)] == names[:4]
