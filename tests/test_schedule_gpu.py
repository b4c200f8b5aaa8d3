"""Precision schedules on the TE backend (H200, TE 2.20.2): the switch gives TE's modules fresh
quantizers where TE itself, handed a changed recipe of the same class, keeps the old ones
(transformer_engine/pytorch/module/base.py:1111-1135); delayed to delayed keeps TE's scale state; and
two schedules train a few steps on gpt_tiny and qwen3_moe_tiny: tensorwise then BF16, and blockwise
with its backward in high precision for the last steps (TE runs backward_override only without
LayerNormMLP: an MoE model).

    python -m benchmarks.gpu_tests --spec gpu_tests_schedule --out $OUT
"""

from __future__ import annotations

import json

import pytest
import torch

from harness.lifecycle import metrics as M
from harness.training.trainer import Trainer
from harness.validation.load import load
from tests.helpers import compose_cfg, needs_cuda, needs_te

pytestmark = [pytest.mark.gpu, needs_cuda, needs_te]

BASE = ["backend=te", "hardware=auto", "logger=none", "eval_interval=0", "eval_tokens=2048"]
BASE += ["micro_batch_size=4", "global_batch_size=4", "log_interval=1", "data.num_tokens=200000"]


def _quantizers(model: torch.nn.Module) -> dict[str, list]:
    """Each TE module's quantizer objects (forward and backward), by module name."""
    out = {}
    for name, m in model.named_modules():
        q = getattr(m, "quantizers", None)
        if isinstance(q, dict) and q.get("scaling_fwd"):
            out[name] = [*q["scaling_fwd"], *q.get("scaling_bwd", [])]
    return out


def test_the_switch_gives_te_modules_fresh_quantizers(tmp_path):
    import transformer_engine.pytorch as te

    # one TE recipe class (Float8CurrentScaling), one field changed: TE 2.20.2 would keep the quantizers
    phases = "schedule.phases=[{at_step: 1, fields: {fp8_fast_accumulation: all}}]"
    tr = Trainer(load([*BASE, "model=gpt_tiny", "steps=3", "recipe=tensorwise", phases]), tmp_path)
    tr.train_step(0)
    old_model, old_recipe = tr.model, tr.backend.recipe
    before = _quantizers(old_model)
    weights = {k: v.float().clone() for k, v in tr.backend.model_state_dict(old_model).items()}
    assert before and all(old_recipe.fp8_gemm_dgrad.use_split_accumulator is True for _ in before)
    tr.enter_phase(1)
    new_recipe = tr.backend.recipe
    assert new_recipe.fp8_gemm_dgrad.use_split_accumulator is False
    assert all(torch.equal(v.float(), weights[k]) for k, v in tr.backend.model_state_dict(tr.model).items())
    assert not any(getattr(m, "_fp8_workspaces", None) for m in tr.model.modules())  # no stale weight copy
    tr.train_step(1)
    after = _quantizers(tr.model)
    assert after.keys() == before.keys()
    old_ids = {id(q) for qs in before.values() for q in qs}
    assert not old_ids & {id(q) for qs in after.values() for q in qs}
    for name, m in tr.model.named_modules():
        if name in after:
            assert m.fp8_meta["recipe"] is new_recipe, name
    # what lowp avoids: TE handed the changed recipe on the old modules keeps their quantizers
    idx = torch.zeros((1, 64), dtype=torch.long, device=tr.device)
    with torch.no_grad(), te.autocast(enabled=True, recipe=new_recipe):
        old_model(idx)
    kept = _quantizers(old_model)
    assert all([id(q) for q in kept[n]] == [id(q) for q in before[n]] for n in before)


def _phases(run_dir) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[M.SCHEDULE_PHASE] for r in rows if M.LOSS_TRAIN in r]


def test_tensorwise_then_bf16_trains(tmp_path):
    from harness.train import run

    s = run(
        compose_cfg(*BASE, "model=gpt_tiny", "steps=10", "recipe=tensorwise", "schedule=bf16_last10pct"),
        tmp_path,
    )
    assert s.status == "completed" and s.backend == "te" and s.final_train_loss < 5.6, s
    assert _phases(tmp_path) == [0] * 9 + [1]


def test_blockwise_with_a_high_precision_backward_at_the_end_trains(tmp_path):
    from harness.train import run

    over = ["model=qwen3_moe_tiny", "model.moe_router_topk=8", "steps=10", "recipe=blockwise"]
    over += ["model.hidden_size=128", "model.kv_channels=32", "model.ffn_hidden_size=128"]
    over += ["model.moe_ffn_hidden_size=128", "schedule=hp_backward_last10pct"]
    s = run(compose_cfg(*BASE, *over), tmp_path)
    assert s.status == "completed" and s.backend == "te", s
    assert _phases(tmp_path) == [0] * 9 + [1]
    info = json.loads((tmp_path / "run.json").read_text())
    last = info["provenance"]["schedule"][1]
    assert last["recipe"]["backward_override"] == "high_precision" and last["start_step"] == 9


def test_delayed_to_delayed_keeps_te_scale_state(tmp_path):
    """Both phases delayed scaling: TE's amax histories and scales carry over into the new modules."""
    phases = "schedule.phases=[{at_step: 2, fields: {fp8: e4m3}}]"
    tr = Trainer(load([*BASE, "model=gpt_tiny", "steps=4", "recipe=delayed", phases]), tmp_path)
    tr.train_step(0)
    tr.train_step(1)
    before = {
        n: {k: {a: t.clone() for a, t in v.items()} for k, v in e.items()}
        for n, e in tr.backend.state_dict().items()
    }
    assert before and any(bool((e["scaling_fwd"]["scale"] != 1).any()) for e in before.values())
    tr.enter_phase(1)
    after = tr.backend.state_dict()
    assert after.keys() == before.keys()
    for name, entry in before.items():
        for key, tensors in entry.items():
            assert all(torch.equal(t, after[name][key][a]) for a, t in tensors.items()), (name, key)
    assert tr.train_step(2)[0].isfinite()
