"""Divergence: when a run stops being worth its compute, with the cause in words.

Checked on every logged row (the rows are where the loss is synced anyway): a non-finite train loss or
gradient norm ends the run at once; a train loss above `loss_spike_factor` x the lowest logged loss so
far, on `patience` consecutive logged rows, ends it too (one noisy row does not).
"""

from __future__ import annotations

import math

from harness.config.schema import DivergenceConfig
from harness.lifecycle.metrics import GRAD_NORM, LOSS_TRAIN


class DivergenceMonitor:
    def __init__(self, cfg: DivergenceConfig):
        self.cfg = cfg
        self.running_min: float | None = None
        self.strikes = 0

    def check(self, row: dict) -> str | None:
        """The cause if the run diverged at this row, else None (and the running state moves on)."""
        loss, gn = row.get(LOSS_TRAIN), row.get(GRAD_NORM)
        if loss is None or not math.isfinite(loss):
            return f"non-finite train loss ({loss})"
        if gn is not None and not math.isfinite(gn):
            return f"non-finite gradient norm ({gn})"
        factor = self.cfg.loss_spike_factor
        if factor > 0 and self.running_min is not None and loss > factor * self.running_min:
            self.strikes += 1
            if self.strikes >= self.cfg.patience:
                return (
                    f"loss spike: {loss:.4g} > {factor:g} x the running minimum {self.running_min:.4g} "
                    f"for {self.strikes} logged steps"
                )
        else:
            self.strikes = 0
        self.running_min = loss if self.running_min is None else min(self.running_min, loss)
        return None

    def state_dict(self) -> dict:
        return {"running_min": self.running_min, "strikes": self.strikes}

    def load_state_dict(self, state: dict) -> None:
        self.running_min, self.strikes = state["running_min"], state["strikes"]
