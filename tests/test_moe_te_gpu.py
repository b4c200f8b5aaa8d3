"""MoE on the TE backend against the emulated backend, on an H200 with TE 2.20.2.

The quantized operands TE's grouped GEMMs multiply in lowp's TE expert group equal lowp's codes and
scales at atol=0, expert by expert (docs/numerics_grouped.md): one expert group (qwen3_moe_tiny's
block 0 fc1, or fc2 with router padding's signed zeros) runs two steps in the TE backend's
`TEGroupedExperts` (TE's `GroupedLinear`) under its `te.autocast` and in lowp's
`EmulatedGroupedLinear` on the CPU reference path, from the same bf16 weights and rows
(tests/moe_paths.py: unaligned counts padded to the recipe's alignment, an empty and a one-token
expert, per-expert magnitudes 2^e). TE's operands are snapshotted at each `general_grouped_gemm`
call: fprop reads the weights' and inputs' rowwise copies, dgrad the weights' columnwise and the
grads' rowwise copies, wgrad the inputs' and grads' columnwise copies. Delayed scaling's second step
uses scales from the first step's amaxes on both.

The TE MoE model computes the emulated model's function on the same weights (as the dense
tests/test_hf_te_gpu.py checks, with its bound), and the MoE presets train 50 steps on TE under each
Hopper recipe, with per-expert telemetry rows from TE's own quantizers.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.fidelity.operands import te_parts
from benchmarks.fidelity.quantizers import mismatches, valid_region
from tests import moe_paths as P
from tests.helpers import compose_cfg, needs_cuda, needs_te

pytestmark = [pytest.mark.gpu, needs_cuda, needs_te]

HOPPER = ["delayed", "tensorwise", "blockwise"]
# (GEMM, operand list): which copy of which lowp role each list holds
GEMMS = {
    "fprop": (("weight", "row"), ("input", "row")),
    "dgrad": (("weight", "col"), ("grad", "row")),
    "wgrad": (("input", "col"), ("grad", "col")),
}


def te_group(recipe: str, fc: str, weight: torch.Tensor):
    """(backend, group): lowp's TE backend for qwen3_moe_tiny under `recipe` and its block 0 expert
    group `fc` (harness.backends.te_moe.TEGroupedExperts) holding `weight`, with an fp32 main grad
    for TE's fused wgrad accumulation (the optimizer's MainGrads gives it one in a run)."""
    from harness.backends import build_backend
    from harness.train import backend_spec

    over = [*P.RUN, "backend=te", "hardware=auto", f"recipe={recipe}", *P.RECIPES[recipe]]
    backend = build_backend(backend_spec(compose_cfg(*over)), torch.device("cuda"))
    group = getattr(backend.build_model().blocks[0].layer.layernorm_mlp.moe.experts, fc)
    with torch.no_grad():
        group.weight.copy_(weight.to(torch.bfloat16))
    group.weight.main_grad = torch.zeros(group.weight.shape, dtype=torch.float32, device="cuda")
    return backend, group


def run_te(recipe: str, fc: str, splits, steps, weight: torch.Tensor):
    """lowp's TE expert group over the group's bf16 weights: per step the snapshots of every grouped
    GEMM's operand lists, in call order (fprop, dgrad, wgrad)."""
    import transformer_engine.pytorch.module.grouped_linear as gl

    backend, mod = te_group(recipe, fc, weight)
    orig, calls = gl.general_grouped_gemm, []

    def spy(A, B, *rest, **kw):
        calls.append(([_snapshot(a) for a in A], [_snapshot(b) for b in B]))
        return orig(A, B, *rest, **kw)

    gl.general_grouped_gemm = spy
    per_step = []
    try:
        for x, dy in steps:
            calls.clear()
            x = x.cuda().requires_grad_(True)
            with backend.autocast():
                y = mod(x, splits)
            y.backward(dy.cuda())
            per_step.append(list(calls))
    finally:
        gl.general_grouped_gemm = orig
    return per_step


def _snapshot(t) -> dict | None:
    """A copy of a quantized operand's codes and scales at the GEMM (None for an expert without
    rows): the grouped path hands storage objects, which have no numel()."""
    if t is None:
        return None
    size = t.size() if callable(getattr(t, "size", None)) else t.shape
    if math.prod(size) == 0:
        return None
    clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {"parts": {k: clone(v) for k, v in te_parts(t).items()}}


def fields(data, sinv, which: str, kind: str, dim: int, shape) -> dict:
    """One orientation's codes and scale_inv under the quantizer benchmark's names, block scales cut
    to their valid region (TE leaves the padding uninitialised)."""
    other = "col" if which == "row" else "row"
    d = {f"data_{which}": data, f"sinv_{which}": sinv, f"data_{other}": None, f"sinv_{other}": None}
    d = valid_region(d, kind, {"dim": dim}, shape)
    return {k: v for k, v in d.items() if not k.endswith(other)}


@pytest.mark.parametrize("routed", [False, True], ids=["zero_rows", "router_padding"])
@pytest.mark.parametrize("recipe", HOPPER)
def test_te_grouped_operands_are_lowps_codes_and_scales(recipe, routed):
    fc = "fc2" if routed else "fc1"
    backend, model = P.build(recipe, "cpu", False)
    group = getattr(model.blocks[0].mlp.experts, fc)
    splits, steps = P.case_inputs(recipe, group, routed)
    _, codes = P.run_group(backend, group, splits, steps, "cpu")
    te_steps = run_te(recipe, fc, splits, steps, group.weight.detach())
    kind = "block" if recipe == "blockwise" else "tensor"
    bad, compared = [], 0
    for step, calls in enumerate(te_steps):
        assert len(calls) == 3, (step, len(calls))  # fprop, dgrad, wgrad
        for (gemm, roles), (A, B) in zip(GEMMS.items(), calls):
            for (role, which), snaps in zip(roles, (A, B)):
                for e, snap in enumerate(snaps):
                    name = f"{group.name}.{e}"
                    mine = codes.get((name, role), [])
                    # the weight is quantized once per step; inputs and grads once per non-empty step
                    index = step if role == "weight" else step if splits[e] else None
                    if snap is None or index is None:
                        assert snap is None or not splits[e], (gemm, role, e)
                        continue
                    row, col = mine[index]
                    q = row if which == "row" else col
                    shape = (splits[e], group.in_features if role != "grad" else group.out_features)
                    if role == "weight":
                        shape = tuple(group.weight.shape[1:])
                    dim = 2 if role == "weight" else 1
                    parts = snap["parts"]
                    a = fields(parts[f"data_{which}"], parts[f"sinv_{which}"], which, kind, dim, shape)
                    b = fields(q.data, q.scale_inv, which, kind, dim, shape)
                    diff = {k: v for k, v in mismatches(a, b).items() if v}
                    compared += 1
                    if diff:
                        bad.append(f"step {step} {gemm} expert {e} {role} {which}: {diff}")
    live = sum(1 for m in splits if m)
    assert compared == len(te_steps) * (2 * len(splits) + 4 * live)  # every weight, every live expert's rest
    assert not bad, f"{len(bad)} of {compared} operands differ: " + "; ".join(bad[:6])


# every expert takes every token (top-k = all): no routing decision for bf16 noise to flip, so the
# comparison sees the experts', the shared expert's and the norms' arithmetic and nothing else
FUNCTION_CASES = {
    "qwen3_moe_tiny": ["model=qwen3_moe_tiny", "model.moe_router_topk=8"],
    "mixtral_tiny": ["model=mixtral_tiny", "model.moe_router_topk=4"],
    "dense_then_moe_shared_expert": [
        "model=qwen3_moe_tiny",
        "model.moe_router_topk=8",
        "model.moe_layer_freq=[0,1]",
        "model.moe_shared_expert_intermediate_size=64",
        "model.moe_shared_expert_gate=true",
    ],
}


def _built(over: list[str], backend: str):
    from harness.backends import build_backend
    from harness.train import backend_spec

    cfg = compose_cfg(*over, f"backend={backend}", "hardware=auto", "logger=none", "model.seq_length=64")
    b = build_backend(backend_spec(cfg), torch.device("cuda"))
    return cfg, b, b.build_model()


@pytest.mark.parametrize("case", list(FUNCTION_CASES))
def test_te_moe_model_computes_the_emulated_models_function(case):
    from harness.interop.hf_weights import load_into
    from tests.test_hf_te_gpu import forward, forward_fp32

    cfg, emu_b, emu = _built(FUNCTION_CASES[case], "emulated")
    with torch.no_grad():  # bf16-valued weights, larger than init so every part shapes the logits
        for p in emu.parameters():
            p.copy_(p.to(torch.bfloat16).float() * 4)
    sd = {n: p.detach().clone() for n, p in emu.named_parameters()}
    _, te_b, te = _built(FUNCTION_CASES[case], "te")
    assert load_into(te, sd) == len(sd)
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 64), device="cuda")
    a, b = forward(emu_b, emu, idx), forward(te_b, te, idx)
    noise = (a - forward_fp32(emu, idx)).abs().max().item()  # the same weights, fp32 GEMMs
    assert 0 < noise and (a - b).abs().max().item() <= 3 * noise, ((a - b).abs().max().item(), noise)
    # control: fc1's gate and value halves swapped in every expert (a layout error) must be seen. Its
    # yardstick is the distance just accepted, not the noise: with x4 weights qwen3_moe_tiny's fp32
    # evaluation is 3.7 away in the logits (benchmarks/results/moe_te_function_h200_2026-12-02.json)
    for name in [n for n in sd if n.endswith(".mlp.experts.fc1.weight")]:
        sd[name] = torch.cat(sd[name].chunk(2, dim=1)[::-1], dim=1)
    load_into(te, sd)
    assert (forward(te_b, te, idx) - a).abs().max().item() > 5 * (a - b).abs().max().item()


@pytest.mark.parametrize("preset", ["qwen3_moe_tiny", "mixtral_tiny"])
def test_te_moe_layer_routes_and_computes_as_the_emulated_one(preset):
    """Block 0's MoE layer with the preset's own top-k, fed the same bf16 input on both backends: the
    same routing (lowp's router on both), so the outputs differ by the experts' GEMM and activation
    rounding only, a few bf16 ulps of the largest output (1 ulp measured with every expert taking
    every token, moe_same_input in benchmarks/results/moe_te_function_h200_2026-12-02.json)."""
    from harness.interop.hf_weights import load_into

    _, emu_b, emu = _built([f"model={preset}"], "emulated")
    with torch.no_grad():
        for p in emu.parameters():
            p.copy_(p.to(torch.bfloat16).float() * 4)
    _, te_b, te = _built([f"model={preset}"], "te")
    load_into(te, {n: p.detach().clone() for n, p in emu.named_parameters()})
    x = torch.randn(2, 64, emu.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16().cuda()
    with torch.no_grad(), emu_b.autocast():
        want = emu.blocks[0].mlp(x.float()).float()
    with torch.no_grad(), te_b.autocast():
        got = te.blocks[0].layer.layernorm_mlp.moe(x).float()
    ulp = 2.0 ** (math.floor(math.log2(want.abs().max().item())) - 7)
    assert (want - got).abs().max().item() <= 4 * ulp, ((want - got).abs().max().item(), ulp)


@pytest.mark.parametrize("preset", ["qwen3_moe_tiny", "mixtral_tiny"])
@pytest.mark.parametrize("recipe", ["bf16", *HOPPER])
def test_moe_presets_train_on_te(tmp_path, preset, recipe):
    """50 steps on TE, telemetry every 25: the loss falls, the load metrics are logged, and every
    quantized expert group gives rows per expert (the N worst kept whole, the rest summed up)."""
    import json

    from harness.train import run

    over = [f"model={preset}", "backend=te", "hardware=auto", f"recipe={recipe}", "logger=none", "steps=50"]
    over += ["log_interval=10", "eval_tokens=2048", "micro_batch_size=8", "global_batch_size=8"]
    over += ["telemetry_interval=25", "telemetry.moe_experts_per_layer=2"]
    if recipe == "blockwise":  # TE's block-scaled GEMMs want 128-multiples
        over += ["model.hidden_size=128", "model.kv_channels=32", "model.ffn_hidden_size=128"]
        over += ["model.moe_ffn_hidden_size=128"] if preset == "qwen3_moe_tiny" else []
    s = run(compose_cfg(*over), tmp_path)
    assert s.status == "completed" and s.backend == "te"
    assert math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "moe/tokens_per_expert_max_mean" in r]
    assert logged and all(r["moe/tokens_per_expert_max_mean"] >= 1 for r in logged)
    if recipe == "bf16":
        return  # no quantized operand: no telemetry row
    numerics = (tmp_path / "numerics.jsonl").read_text().splitlines()
    layers = {json.loads(line)["layer"] for line in numerics}
    experts = {x for x in layers if ".mlp.experts.fc1." in x and x.startswith("blocks.0.")}
    assert "blocks.0.attn.qkv" in layers and len(experts) >= 3, sorted(layers)  # 2 worst, max, median


def _kernels_group(kernels: str, weight: torch.Tensor):
    """A BF16 expert group of lowp's TE backend (block 0 fc1 of qwen3_moe_tiny) on `kernels`, holding
    `weight`, with an fp32 main grad."""
    from harness.backends import build_backend
    from harness.train import backend_spec

    over = [*P.RUN, "backend=te", "hardware=auto", "recipe=bf16", f"backend.moe_experts={kernels}"]
    backend = build_backend(backend_spec(compose_cfg(*over)), torch.device("cuda"))
    group = backend.build_model().blocks[0].layer.layernorm_mlp.moe.experts.fc1
    with torch.no_grad():
        group.weight.copy_(weight)
    group.weight.main_grad = torch.zeros(group.weight.shape, dtype=torch.float32, device="cuda")
    return backend, group


@pytest.mark.parametrize("splits", [[40, 0, 17, 1, 64, 3, 0, 11], [16] * 8])
def test_grouped_experts_compute_te_grouped_linears_gemms(splits):
    """backend.moe_experts=grouped against te: the same output and input gradient (within two bf16 ulps
    of the larger value: two GEMM libraries' accumulation orders), the main grad to fp32's accumulation
    order (both add an fp32 wgrad into it; none is rounded to bf16); experts without rows get zero."""
    torch.manual_seed(0)
    E, (out, inp) = 8, (64, 64)  # block 0's fc1 in P.RUN: 8 experts, 2 x 32 gate and value rows, hidden 64
    weight = (torch.randn(E, out, inp) * 0.05).to(torch.bfloat16).cuda()
    x = torch.randn(sum(splits), inp).to(torch.bfloat16).cuda()
    dy = torch.randn(sum(splits), out).to(torch.bfloat16).cuda()
    got = {}
    for kernels in ("te", "grouped"):
        backend, group = _kernels_group(kernels, weight)
        assert ("triton fp32 wgrad" in repr(group)) == (kernels == "grouped")
        xi = x.clone().requires_grad_(True)
        with backend.autocast():
            y = group(xi, splits)
        y.backward(dy)
        if kernels == "grouped":
            assert group.weight.grad is None  # added to main_grad instead, as TE's fused wgrad does
        got[kernels] = (y.float(), xi.grad.float(), group.weight.main_grad.clone())

    def ulps(a, b, n):
        return (a - b).abs().max().item() <= n * 2.0 ** (math.floor(math.log2(b.abs().max().item())) - 7)

    (y_te, dx_te, mg_te), (y_t, dx_t, mg_t) = got["te"], got["grouped"]
    assert ulps(y_t, y_te, 2) and ulps(dx_t, dx_te, 2)
    assert (mg_t - mg_te).abs().max().item() <= 1e-5 * mg_te.abs().max().item()
    for e, n in enumerate(splits):
        if n == 0:
            assert torch.count_nonzero(mg_t[e]) == 0 and torch.count_nonzero(mg_te[e]) == 0


def test_moe_preset_trains_on_grouped_experts(tmp_path):
    """qwen3_moe_tiny, 50 steps on TE with backend.moe_experts=grouped: the loss falls as on te and
    run.json records the kernels."""
    import json

    from harness.train import run

    over = ["model=qwen3_moe_tiny", "backend=te", "hardware=auto", "recipe=bf16", "logger=none", "steps=50"]
    over += ["log_interval=10", "eval_tokens=2048", "micro_batch_size=8", "global_batch_size=8"]
    s = run(compose_cfg(*over, "backend.moe_experts=grouped"), tmp_path)
    assert s.status == "completed" and s.backend == "te"
    assert math.isfinite(s.final_train_loss) and s.final_train_loss < 5.4
    kernels = json.loads((tmp_path / "run.json").read_text())["provenance"]["speed_options"]
    assert kernels["moe_experts"] == "grouped"
    assert set(kernels["moe_expert_kernels"].values()) == {"torch._grouped_mm + triton fp32 wgrad"}


def test_a_finished_run_leaves_no_device_memory_to_the_next(tmp_path):
    """Runs one after another in one process (a benchmark's arms, a sweep's jobs on the basic launcher)
    each start from the same device memory: the finished run's modules, held in reference cycles, are
    collected when it ends (harness.training.job.release_memory), not whenever the collector runs."""
    from harness.train import run

    over = ["model=mixtral_tiny", "backend=te", "hardware=auto", "recipe=tensorwise", "logger=none",
            "steps=3", "eval_interval=0", "checkpoint_interval=-1", "micro_batch_size=8",
            "global_batch_size=8"]  # fmt: skip
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    after = []
    for i in range(3):
        assert run(compose_cfg(*over), tmp_path / str(i)).status == "completed"
        after.append(torch.cuda.memory_allocated() - before)
    # what the first run leaves is process-wide (TE's GEMM workspaces, 224 MiB on the H200); no run adds
    assert after[2] - after[0] < 2**20, after


def test_auto_runs_128_experts_on_the_grouped_kernels_and_fewer_on_te(tmp_path):
    """The presets' backend.moe_experts=auto on the GPU: qwen3_moe_tiny widened to 128 experts runs its BF16
    groups on the grouped kernels, the 8-expert preset on TE's GroupedLinear; run.json says which and the
    variant names the grouped kernels."""
    import json

    from harness.train import run

    over = ["model=qwen3_moe_tiny", "backend=te", "hardware=auto", "recipe=bf16", "logger=none", "steps=3"]
    over += ["log_interval=1", "eval_tokens=2048", "micro_batch_size=8", "global_batch_size=8"]
    for experts, kernels in ((128, "grouped"), (8, "te")):
        d = tmp_path / str(experts)
        s = run(compose_cfg(*over, f"model.num_moe_experts={experts}"), d)
        assert s.status == "completed" and s.backend == "te"
        opts = json.loads((d / "run.json").read_text())["provenance"]["speed_options"]
        assert (opts["moe_experts"], opts["moe_experts_resolved"]) == ("auto", kernels)
        assert s.variant.endswith("+grouped_experts") == (kernels == "grouped")


@pytest.mark.parametrize("kernels", ["te", "grouped"])
def test_a_deterministic_moe_run_on_te_is_the_same_twice(tmp_path, kernels):
    """backend.deterministic=true (Megatron's --deterministic-mode) on TE's MoE path: two runs of one
    seed log the same train loss and gradient norm at every step, to the bit (by default they differed
    from step 1's gradient norm on the Mixtral-like slice: benchmarks/RESULTS.md, "Loss checks of MoE
    runs")."""
    from analysis.reader import parse_jsonl
    from benchmarks.rerun_check import compare
    from harness.train import run

    over = ["model=mixtral_tiny", "backend=te", "hardware=auto", "recipe=bf16", "logger=none", "steps=8"]
    over += ["log_interval=1", "eval_tokens=2048", "micro_batch_size=8", "global_batch_size=8"]
    over += ["backend.deterministic=true", f"backend.moe_experts={kernels}"]
    runs = []
    for i in range(2):
        assert run(compose_cfg(*over), tmp_path / str(i)).status == "completed"
        runs.append(parse_jsonl(tmp_path / str(i) / "metrics.jsonl", []))
    assert compare(*runs) == {"identical_steps": 8, "first_difference": None}
    assert not torch.are_deterministic_algorithms_enabled()  # the run's switch is undone after it
