"""optimizer.step_in_backward: the per-parameter update inside backward equals the step after it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY
from tests.test_validate import error_of

BASE = [*TINY, "backend=emulated", "hardware=cpu", "optimizer.clip_grad=0", "log_interval=2"]


def _trainer(tmp_path, *extra):
    from harness.train import Trainer
    from harness.validation import load

    return Trainer(load([*BASE, *extra]), tmp_path)


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_step_in_backward_equals_step_after_backward(tmp_path, recipe):
    after = _trainer(tmp_path / "a", f"recipe={recipe}")
    inside = _trainer(tmp_path / "b", f"recipe={recipe}", "optimizer.step_in_backward=true")
    assert after.optimizer.in_backward is None and inside.optimizer.in_backward is not None
    for step in range(5):  # steps 0, 2, 4 log: their grad norms are gathered in the hooks
        la, na, _ = after.train_step(step)
        lb, nb, _ = inside.train_step(step)
        assert torch.equal(la, lb), step
        assert (na is None) == (nb is None) and (na is None or torch.equal(na, nb)), (step, na, nb)
    assert inside.optimizer.in_backward.updated == len(list(inside.model.parameters()))
    for (n, p), (_, q) in zip(after.model.named_parameters(), inside.model.named_parameters()):
        assert torch.equal(p, q), n
        assert q.grad is None, n  # freed inside backward
    # the same states, so the checkpoint of either run resumes the other
    sa, sb = after.optimizer.state_dict(), inside.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        for key, value in st.items():
            assert torch.equal(value, sb["state"][i][key]), (i, key)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["optimizer.clip_grad=1.0"], "optimizer.clip_grad=0"),
        (["micro_batch_size=2", "global_batch_size=4"], "global_batch_size = micro_batch_size"),
        (["optimizer=bf16_states"], "optimizer.use_precision_aware_optimizer=false"),
    ],
)
def test_step_in_backward_rules(extra, needle):
    msg = error_of(*BASE, "optimizer.step_in_backward=true", *extra)
    assert msg.startswith("optimizer.step_in_backward=true") or "optimizer.step_in_backward=true" in msg
    assert needle in msg


def test_step_in_backward_on_te_needs_bf16_params():
    te = ["backend=te", "hardware=h200", "backend.te_version=2.20.2", "optimizer.clip_grad=0"]
    msg = error_of(*TINY, *te, "optimizer.step_in_backward=true")
    assert "optimizer.master_weights=false" in msg


def test_the_stepper_does_not_keep_the_model_alive(tmp_path):
    """Its hooks live on the params in C++, out of the garbage collector's sight: they hold it weakly."""
    import gc
    import weakref

    trainer = _trainer(tmp_path, "optimizer.step_in_backward=true")
    trainer.train_step(0)
    model, stepper = weakref.ref(trainer.model), weakref.ref(trainer.optimizer.in_backward)
    del trainer
    gc.collect()
    assert model() is None and stepper() is None


def test_step_in_backward_after_a_state_dict_round_trip(tmp_path):
    """A resume loads the optimizer's state_dict, which replaces its param groups: the hooks follow
    the new groups (where set_lr writes each step's warm-up learning rate), so the run goes on as the
    step-after-backward one does."""
    after = _trainer(tmp_path / "a")
    inside = _trainer(tmp_path / "b", "optimizer.step_in_backward=true")
    for step in range(2):
        after.train_step(step)
        inside.train_step(step)
    for t in (after, inside):
        t.optimizer.load_state_dict(t.optimizer.state_dict())
    for step in range(2, 5):
        after.train_step(step)
        inside.train_step(step)
    for (n, p), (_, q) in zip(after.model.named_parameters(), inside.model.named_parameters()):
        assert torch.equal(p, q), n
