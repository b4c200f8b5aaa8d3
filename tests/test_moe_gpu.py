"""The experts on the emulator's CUDA fast path against the CPU reference path (docs/numerics_grouped.md).

Every expert's quantized copies (codes, scales, GEMM operands) made by CUDA's fused casts equal the
CPU reference's at atol=0, for every recipe, with an empty expert, a one-token expert, unaligned
counts padded both ways (zero rows; real tokens at probability 0, whose signed zeros reach fc2), and
delayed scaling's per-expert histories; the GEMMs' results within the accumulation-order bound, as
for dense linears (tests/numerics/test_fast_path_gpu.py). A tiny MoE trains on CUDA under each
recipe from the CPU's first loss.
"""

from __future__ import annotations

import json

import pytest

from harness.lifecycle import metrics as M
from harness.train import run
from tests import moe_paths as P
from tests.helpers import compose_cfg, needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.mark.parametrize("routed", [False, True], ids=["zero_rows", "router_padding"])
@pytest.mark.parametrize("recipe", list(P.RECIPES))
def test_cuda_fast_grouped_codes_are_the_cpu_reference_codes(recipe, routed):
    fc = "fc2" if routed else "fc1"
    runs = []
    for device, fast in (("cpu", False), ("cuda", None)):  # None: the default, fast on CUDA
        backend, model = P.build(recipe, device, fast)
        group = getattr(model.blocks[0].mlp.experts, fc)
        splits, steps = P.case_inputs(recipe, group, routed)
        runs.append((backend, *P.run_group(backend, group, splits, steps, device)))
    (ref_b, want, want_codes), (cuda_b, got, got_codes) = runs
    assert all(q.fast_gemm is None for q in cuda_b.modules.values())
    bad = P.code_mismatches(want_codes, got_codes) + P.state_mismatches(ref_b, cuda_b)
    assert not bad, f"{len(bad)} mismatches: " + "; ".join(bad[:8])
    for step, ((y, dx, dw), (y2, dx2, dw2)) in enumerate(zip(want, got)):
        beyond = {
            "y": P.beyond_gemm_bound(y, y2, group.in_features),
            "dx": P.beyond_gemm_bound(dx, dx2, group.out_features),
            "dW": P.beyond_gemm_bound(dw, dw2, sum(splits)),
        }
        assert not any(beyond.values()), (step, beyond)
        assert not dw2[1].any() and not dw2[5].any()  # the empty experts' weight grads are zeros


@pytest.mark.parametrize("recipe", ["bf16", *P.RECIPES, "int4_qat"])
def test_tiny_moe_trains_on_cuda_from_the_cpu_first_loss(recipe, tmp_path):
    """qwen3_moe_tiny, 20 steps on the CUDA fast path: the first loss is the CPU reference run's
    (same weights and batch; bf16 attention and router GEMMs in another order), and it falls."""
    name = recipe.removesuffix("_pow2")
    extra = P.RECIPES.get(recipe, [])
    losses = {}
    for hardware in ("cpu", "auto"):
        cfg = compose_cfg(
            "model=qwen3_moe_tiny", "backend=emulated", f"hardware={hardware}", "logger=none",
            f"recipe={name}", *extra, "steps=20", "log_interval=1", "eval_interval=0",
            "eval_tokens=512", "micro_batch_size=8", "global_batch_size=8", "data=markov",
            "checkpoint_interval=-1", "optimizer.lr=3e-3",
        )  # fmt: skip
        out = tmp_path / hardware
        assert run(cfg, out).status == "completed"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[hardware] = [r[M.LOSS_TRAIN] for r in rows if M.LOSS_TRAIN in r]
    cpu, cuda = losses["cpu"], losses["auto"]
    assert abs(cuda[0] - cpu[0]) < 1e-2 * cpu[0], (cpu[0], cuda[0])
    assert cuda[-1] < cuda[0] - 0.2, cuda
    assert abs(cuda[-1] - cpu[-1]) < 0.1 * cpu[-1], (cpu[-1], cuda[-1])
