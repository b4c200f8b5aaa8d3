"""Delayed scaling state (TE DelayedScaling): per module and direction, a scale and an amax history.

docs/numerics.md section 2. Each cast uses `scale[i]` and max-accumulates its amax into
`amax_history[0, i]`. `update()` is TE's fused kernel_bulk: a zero amax leaves history and scale
alone; otherwise the history rolls (h'[0]=0, h'[i]=h[i+1], h'[-1]=amax) and
scale = (fp8max * 2^-margin) / amax ("max": fmaxf from 0 over the old history and amax, so a
NaN is skipped; or "most_recent"), kept when amax is not finite, FLT_MAX when the quotient is Inf.
When updates happen is the context's business (numerics/context.py).
"""

from __future__ import annotations

import torch

from harness.numerics.formats import FLT_MAX, FP8Format

ALGOS = ("max", "most_recent")


class DelayedScalingState:
    """scale (n,) and amax_history (len, n) for n tensors of one direction of one module."""

    def __init__(
        self,
        formats: list[FP8Format],
        history_len: int,
        algo: str,
        margin: float,
        device: torch.device | str = "cpu",
    ):
        if algo not in ALGOS:
            raise ValueError(f"fp8_amax_compute_algo={algo!r}: use one of {ALGOS}")
        if history_len < 1:
            raise ValueError(f"fp8_amax_history_len={history_len}: must be >= 1")
        n = len(formats)
        self.formats, self.algo = list(formats), algo
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(history_len, n, dtype=torch.float32, device=device)
        # fp8max * 2^-margin is exact in fp32 (a power-of-two factor)
        self.scaled_max = torch.tensor([f.max * 2.0**-margin for f in formats], device=device)

    def current_scale(self, i: int) -> torch.Tensor:
        """A snapshot of scale[i] (1,): later updates must not change quantized results."""
        return self.scale[i : i + 1].clone()

    def record(self, i: int, amax: torch.Tensor) -> None:
        """Atomic-max the cast's amax into amax_history[0, i] (several casts in one step)."""
        slot = self.amax_history[0, i : i + 1]
        torch.maximum(slot, amax.reshape(1).to(slot), out=slot)

    def update(self) -> None:
        """TE's kernel_bulk for every tensor of this state, in place."""
        h = self.amax_history  # (len, n)
        last = h[0].clone()  # (n,) the amaxes recorded since the last update
        rolled = torch.zeros_like(h)
        if h.shape[0] > 1:
            rolled[1:-1] = h[2:]
            rolled[-1] = last
        if self.algo == "max":
            # fmaxf folded from 0 over the rolled window, as kernel_bulk does: a NaN never wins
            window = torch.cat([h[1:], last[None]])  # (len, n)
            amax = torch.fmax(window, torch.zeros_like(window)).amax(dim=0)
        else:
            amax = last  # a NaN here keeps the old scale (the isfinite test below)
        active = last != 0  # zero amax: no roll, no new scale
        h.copy_(torch.where(active, rolled, h))
        amax = torch.where(active, amax, torch.zeros_like(amax))
        new = torch.div(self.scaled_max, amax)  # IEEE fp32, tensor / tensor
        new = torch.where(torch.isfinite(amax) & (amax > 0), new, self.scale)
        new = torch.where(torch.isinf(new), torch.full_like(new, FLT_MAX), new)
        self.scale.copy_(new)

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone(), "amax_history": self.amax_history.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["amax_history"].shape != self.amax_history.shape:
            raise ValueError(
                f"amax_history shape {tuple(state['amax_history'].shape)} in the checkpoint, "
                f"{tuple(self.amax_history.shape)} expected (fp8_amax_history_len changed?)"
            )
        self.scale.copy_(state["scale"])
        self.amax_history.copy_(state["amax_history"])
