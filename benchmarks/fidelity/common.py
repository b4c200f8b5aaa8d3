"""What the TE-vs-emulated parts share: one setup (base overrides, run folder), trainers built as
harness.train builds them, an emulated start with bf16-valued weights, a training curve, and a guard
so that one failing part does not stop the others."""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import specs
from harness.backends.te_weights import load_into_te, round_to_bf16_

BASE = ("model=gpt_small", "data=markov", "hardware=auto", "logger=none", "telemetry_interval=0")


@dataclass(frozen=True)
class Setup:
    """The overrides every run of one invocation shares (BASE, then the spec's and the command
    line's), and the folder its trainers write to."""

    overrides: tuple[str, ...]
    run_dir: Path

    def configs(self, *overrides: str) -> list[str]:
        return [*self.overrides, *overrides]

    def trainer(self, *overrides: str):
        """A Trainer for these overrides after the shared ones, from a validated config."""
        from harness.train import Trainer

        return Trainer(specs.load_config(self.configs(*overrides)), self.run_dir)


def emulated_start(setup: Setup, recipe: str, perturb_norms: bool = False, extra: tuple[str, ...] = ()):
    """An emulated trainer with bf16-valued weights, and a CPU copy of its state_dict: the weights both
    backends start from."""
    em = setup.trainer(f"recipe={recipe}", "backend=emulated", *extra)
    if perturb_norms:  # norms and biases off (1, 0), so a swapped or missed one shows
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in em.model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.device))
    round_to_bf16_(em.model)
    return em, {k: v.detach().cpu().clone() for k, v in em.model.state_dict().items()}


def load_weights(tr, weights: dict) -> None:
    """The emulated state_dict into either backend's model (TE's names and layout for TE)."""
    if tr.backend.name == "te":
        load_into_te(tr.model, weights, tr.cfg.model.num_attention_heads)
    else:
        tr.model.load_state_dict(weights)


def curve(setup: Setup, overrides: list[str], steps: int, weights: dict | None = None) -> dict:
    """Train `steps` steps as Trainer.fit does (logged train loss, eval loss), from `weights`."""
    from harness.lifecycle import metrics as M

    tr = setup.trainer(*overrides, f"steps={steps}")
    if weights is not None:
        load_weights(tr, weights)
    train, evals, errors, t0 = [], [], [], time.perf_counter()
    for step in range(steps):
        loss, grad_norm, lr = tr.train_step(step)
        tr.metrics.record(step, loss, grad_norm, lr)
        if step in (0, steps - 1):
            try:
                tr.backend.verify_active(tr.model, step)
            except Exception as e:  # recorded, not fatal: the curve still tells something
                errors.append(f"verify_active step {step}: {e!r}")
        if tr.metrics.should_log(step, steps - 1):
            train.append([step + 1, tr.metrics.row(step)[M.LOSS_TRAIN]])
        if (step + 1) % tr.cfg.eval_interval == 0 or step == steps - 1:
            evals.append([step + 1, tr.evaluate()])
    return {
        "train": train,
        "eval": evals,
        "wall_s": round(time.perf_counter() - t0, 1),
        "errors": errors,
        "backend": tr.backend.name,
        "recipe_repr": str(tr.backend.describe().get("recipe_repr")),
    }


def guard(fn, *a):
    """fn(*a), or the error as a result: one failing run never stops the others."""
    try:
        return fn(*a)
    except Exception as e:
        print(f"FAILED: {e!r}", flush=True)
        return {"error": repr(e), "trace": traceback.format_exc(limit=8)}


def free_memory() -> None:
    gc.collect()  # drop the last part's trainers (optimizer hooks hold reference cycles)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
