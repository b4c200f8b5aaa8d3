"""TE's GroupedLinear against the emulator's experts: the quantized operands TE's grouped GEMMs
multiply, expert by expert, equal lowp's codes and scales at atol=0 (docs/numerics_grouped.md).

One expert group (qwen3_moe_tiny's block 0 fc1, or fc2 with router padding's signed zeros) runs two
steps in TE 2.20.2's `GroupedLinear` under `te.autocast` and in lowp's `EmulatedGroupedLinear` on the
CPU reference path, from the same bf16 weights and rows (tests/moe_paths.py: unaligned counts padded
to the recipe's alignment, an empty and a one-token expert, per-expert magnitudes 2^e). TE's operands
are snapshotted at each `general_grouped_gemm` call: fprop reads the weights' and inputs' rowwise
copies, dgrad the weights' columnwise and the grads' rowwise copies, wgrad the inputs' and grads'
columnwise copies. Delayed scaling's second step uses scales from the first step's amaxes on both.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.fidelity.operands import te_parts
from benchmarks.fidelity.quantizers import mismatches, valid_region
from harness.backends.te_recipe import build_te_recipe
from tests import moe_paths as P
from tests.helpers import needs_cuda, needs_te

pytestmark = [pytest.mark.gpu, needs_cuda, needs_te]

HOPPER = ["delayed", "tensorwise", "blockwise"]
# (GEMM, operand list): which copy of which lowp role each list holds
GEMMS = {
    "fprop": (("weight", "row"), ("input", "row")),
    "dgrad": (("weight", "col"), ("grad", "row")),
    "wgrad": (("input", "col"), ("grad", "col")),
}


def run_te(recipe: str, splits, steps, weight: torch.Tensor):
    """TE GroupedLinear over the group's bf16 weights: per step the snapshots of every grouped GEMM's
    operand lists, in call order (fprop, dgrad, wgrad)."""
    import transformer_engine.pytorch as te
    import transformer_engine.pytorch.module.grouped_linear as gl

    backend, _ = P.build(recipe, "cpu", False)
    te_recipe = build_te_recipe(backend.spec.recipe, backend.spec.stability)
    E, out_f, in_f = weight.shape
    mod = te.GroupedLinear(E, in_f, out_f, bias=False, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for i in range(E):
            getattr(mod, f"weight{i}").copy_(weight[i].to(torch.bfloat16))
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
            with te.autocast(enabled=True, recipe=te_recipe):
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
    te_steps = run_te(recipe, splits, steps, group.weight.detach())
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
