"""optimizer.step_in_backward: each parameter's AdamW update runs as soon as autograd has
accumulated its gradient (a post-accumulate-grad hook), on a side CUDA stream, so the memory-bound
update overlaps the rest of backward's compute-bound GEMMs and the gradient is freed early
(torchtitan's early_step_in_backward, with the update kept off the compute stream).

The update is torch's AdamW on that one parameter, through the inner optimizer's own state and
group settings (its `_init_group` and the functional `adam` that `AdamW.step` calls), so every
element equals the step after backward and the optimizer's state_dict (the checkpoint) is unchanged.
It is legal only where the step needs nothing global (validate.py): one micro-batch a step, no
gradient clipping, one process. A logged step's grad norm is gathered per parameter in the hook and
reduced in `torch.nn.utils.get_total_norm`'s order, so the logged value is the same too.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.adam import adam


class StepInBackward:
    """Post-accumulate-grad hooks that step `inner` (a torch AdamW) one parameter at a time."""

    def __init__(self, inner: torch.optim.Optimizer, params: list[nn.Parameter], device: torch.device):
        self.inner = inner
        # by index: load_state_dict replaces the group dicts (and set_lr writes the new ones)
        self.group_of = {p: i for i, g in enumerate(inner.param_groups) for p in g["params"]}
        self.order = _norm_order(params)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.norms: dict[nn.Parameter, torch.Tensor] | None = None
        self.updated = 0
        # the hook holds the stepper weakly: a tensor's hooks live in C++, where the garbage
        # collector cannot see a param -> hook -> stepper -> param cycle (the model would leak)
        me = weakref.ref(self)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: (s := me()) is not None and s._hook(p))

    def begin(self, want_norm: bool) -> None:
        """Before the step's backward: whether this step's grad norm is wanted (a log step)."""
        self.norms = {} if want_norm else None
        self.updated = 0

    def finish(self) -> torch.Tensor | None:
        """After backward: the compute stream waits for the updates; the grad norm (or None)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        if self.norms is None:
            return None
        norms = [self.norms[p] for p in self.order if p in self.norms]
        self.norms = None
        return torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else None

    def _hook(self, p: nn.Parameter) -> None:
        grad = p.grad
        if self.stream is None:
            self._update(p, grad)
        else:
            # the grad (and every use of p in backward so far) is ready on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                self._update(p, grad)
            grad.record_stream(self.stream)  # its memory is not reused before the update has read it
        p.grad = None
        self.updated += 1

    @torch.no_grad()
    def _update(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        if self.norms is not None:
            # get_total_norm's per-tensor norm: _foreach_norm where foreach is supported (CUDA)
            self.norms[p] = (
                torch._foreach_norm([grad], 2.0)[0] if grad.is_cuda else torch.linalg.vector_norm(grad, 2.0)
            )
        group = self.inner.param_groups[self.group_of[p]]
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self.inner._init_group(
            {**group, "params": [p]}, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        )
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=None,
            found_inf=None,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )


def _norm_order(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """get_total_norm's stacking order: grouped by (device, dtype) in order of first appearance."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    return [p for g in groups.values() for p in g]
