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


def _te_pair(*extra):
    from harness.train import Trainer

    common = (*GPU_TINY, "backend=te", "recipe=tensorwise", "optimizer=bf16_params", "log_interval=2")
    common += ("optimizer.step_in_backward=true",)
    base = Trainer(compose_cfg(*common), tempfile.mkdtemp(prefix="lowp-sib-"))
    other = Trainer(compose_cfg(*common, *extra), tempfile.mkdtemp(prefix="lowp-sib-"))
    other.model.load_state_dict(base.model.state_dict())
    return base, other


@needs_cuda
@needs_te
def test_quantize_weights_in_backward_keeps_every_number():
    """The weight recast after each update (the next forward reuses TE's cached FP8 copy) gives the
    plain step-in-backward run's numbers bit for bit, across an eval between steps (its forward casts
    without the cache and leaves the quantizers rowwise only)."""
    base, other = _te_pair("optimizer.quantize_weights_in_backward=true")
    for step in range(6):
        la, na, _ = base.train_step(step)
        lb, nb, _ = other.train_step(step)
        assert torch.equal(la, lb), (step, la, lb)
        assert (na is None) == (nb is None) and (na is None or torch.equal(na, nb)), (step, na, nb)
        if step == 2:
            with torch.no_grad():
                assert base.evaluate() == other.evaluate()
    torch.cuda.synchronize()
    for (n, p), (_, q) in zip(base.model.named_parameters(), other.model.named_parameters()):
        assert torch.equal(p, q), n
    cache = other.backend.weight_cache
    weights = 4 * len(other.model.blocks)
    assert len(cache.workspaces()) == weights and cache.recasts == 6 * weights
    assert cache.current() and other.backend.first_microbatch is None


def _doubled_behind_the_update():
    """Two steps without and with the weight cache, then one weight doubled in place in both."""
    base, other = _te_pair("optimizer.quantize_weights_in_backward=true")
    for step in range(2):
        base.train_step(step)
        other.train_step(step)
    torch.cuda.synchronize()
    with torch.no_grad():
        for t in (base, other):
            t.model.blocks[0].layer.layernorm_mlp.fc1_weight.mul_(2.0)
    return base, other


@needs_cuda
@needs_te
def test_the_forward_reads_the_cached_copy_until_it_is_invalidated():
    """Proof that the cache is used: a weight changed behind the update's back (as a checkpoint load
    does) changes the loss only once the cache is invalidated, which TEBackend.load_state_dict does."""
    base, other = _doubled_behind_the_update()
    la, _, _ = base.train_step(2)  # casts the doubled weight
    lb, _, _ = other.train_step(2)  # reuses the copy recast from the weight before doubling
    assert not torch.equal(la, lb)
    base2, other2 = _doubled_behind_the_update()
    other2.backend.load_state_dict(other2.backend.state_dict())
    assert not other2.backend.weight_cache.current()
    la, _, _ = base2.train_step(2)
    lb, _, _ = other2.train_step(2)
    assert torch.equal(la, lb)
