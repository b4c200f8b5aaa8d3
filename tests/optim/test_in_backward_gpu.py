"""optimizer.step_in_backward on a GPU: the updates on the side stream give the step-after-backward
run's parameters, losses and grad norms bit for bit, on TE with bf16 params (skipped without CUDA/TE)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.helpers import GPU_TINY, compose_cfg, needs_cuda, needs_te

pytestmark = pytest.mark.gpu


@needs_cuda
@needs_te
@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_step_in_backward_equals_step_after_backward_on_te(recipe):
    from harness.train import Trainer

    common = (*GPU_TINY, "backend=te", f"recipe={recipe}", "optimizer=bf16_params", "log_interval=2")
    after = Trainer(compose_cfg(*common), tempfile.mkdtemp(prefix="lowp-sib-"))
    on = compose_cfg(*common, "optimizer.step_in_backward=true")
    inside = Trainer(on, tempfile.mkdtemp(prefix="lowp-sib-"))
    inside.model.load_state_dict(after.model.state_dict())
    for step in range(6):
        la, na, _ = after.train_step(step)
        lb, nb, _ = inside.train_step(step)
        assert torch.equal(la, lb), (step, la, lb)
        assert (na is None) == (nb is None) and (na is None or torch.equal(na, nb)), (step, na, nb)
    torch.cuda.synchronize()
    for (n, p), (_, q) in zip(after.model.named_parameters(), inside.model.named_parameters()):
        assert torch.equal(p, q), n
