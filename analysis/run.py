"""What one run is: its artifacts as read from disk, and the fields analysis asks of it.

Every field is looked up in summary.json first, then provenance, then the resolved config, so a run
without a summary (incomplete) or with an unreadable run.json still says what it can.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis import keys as K


class RunWarning(UserWarning):
    """A run, or part of one, could not be read; the message names the run and what was skipped."""


@dataclass
class Run:
    """One run's artifacts. `train`/`eval` are columns (numpy arrays) sorted by step."""

    path: Path
    name: str
    config: dict[str, Any]
    provenance: dict[str, Any]
    wandb: dict[str, Any] | None
    summary: dict[str, Any] | None
    """None when summary.json is missing: the run is reported as incomplete."""
    train: dict[str, np.ndarray]
    """Columns of the training rows: `step`, `tokens` and every metric key present (NaN where absent)."""
    eval: dict[str, np.ndarray]
    """Columns of the eval rows: `step`, `tokens`, `loss/eval`."""
    issues: list[str] = field(default_factory=list)
    source: str = "run_dir"
    """`run_dir` or `wandb_offline`."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other top-level fields of run.json (e.g. `config_warnings`)."""

    def get(self, name: str) -> Any:
        """A summary field, falling back to provenance and then the resolved config."""
        for d in (self.summary or {}, self.provenance, self.config):
            v = d.get(name)
            if v is not None:
                return _name_of(v)
        return None

    @property
    def status(self) -> str:
        return (self.summary or {}).get("status") or K.INCOMPLETE

    @property
    def recipe(self) -> str | None:
        """The numerics family; a recipe name from before the families is read as its family."""
        return recipe_identity(self.get("recipe"), None)[0]

    @property
    def recipe_label(self) -> str | None:
        """The family and the recipe fields that differ from its preset, in words: summary.recipe_label,
        else the label of a name from before the families, else the family (a run at its preset)."""
        return recipe_identity(self.get("recipe"), self.get("recipe_label"))[1]

    @property
    def variant(self) -> str:
        v = (self.summary or {}).get("variant")
        if v:
            return str(v)
        stab, opt = _name_of(self.config.get("stability")), _name_of(self.config.get("optimizer"))
        return f"{stab or 'none'}+{opt or 'adamw_fp32'}"

    def _resolved(self, key: str) -> str | None:
        """summary, else provenance, else the config's preset name; `auto` (unresolved) counts as unknown."""
        v = (self.summary or {}).get(key) or self.provenance.get(key)
        if v is None:
            v = _name_of(self.config.get(key))
        return None if v in (None, "auto") else str(v)

    @property
    def backend(self) -> str | None:
        """The resolved backend (`te` or `emulated`); None when unknown (never counted as native)."""
        return self._resolved("backend")

    @property
    def hardware(self) -> str | None:
        return self._resolved("hardware")

    @property
    def model(self) -> str | None:
        return self.get("model")

    @property
    def data(self) -> str | None:
        """The data's name; a masked-diffusion run's task is another (`markov+masked_diffusion`), so
        it is never grouped with, or paired against, autoregressive runs of the same data."""
        data = self.get("data")
        objective = _name_of(self.config.get("objective")) or "autoregressive"
        return data if data is None or objective == "autoregressive" else f"{data}+{objective}"

    @property
    def seed(self) -> int | None:
        s = self.get("seed")
        return int(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else None

    @property
    def steps(self) -> int | None:
        s = (self.summary or {}).get("steps") or self.config.get("steps")
        return int(s) if isinstance(s, (int, float)) else None

    @property
    def planned_tokens(self) -> int | None:
        """steps * global_batch_size * seq_length from the resolved config."""
        c = self.config
        seq = (c.get("model") or {}).get("seq_length") if isinstance(c.get("model"), dict) else None
        vals = (c.get("steps"), c.get("global_batch_size"), seq)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            return int(vals[0] * vals[1] * vals[2])
        return None

    @property
    def token_budget(self) -> int | None:
        """The grouping budget: summary.tokens of a completed run, else the planned budget.

        A diverged, failed or preempted run stopped early, so its summary.tokens would put it in a
        group of its own; the planned budget keeps it beside the runs it was launched with.
        """
        st = (self.summary or {}).get("tokens")
        if self.status == K.COMPLETED and isinstance(st, (int, float)) and st > 0:
            return int(st)
        planned = self.planned_tokens
        if planned:
            return planned
        if isinstance(st, (int, float)) and st > 0:
            return int(st)
        return int(self.train[K.TOKENS][-1]) if len(self.train.get(K.TOKENS, ())) else None

    @property
    def is_baseline(self) -> bool:
        """A BF16 run at the family's preset (a BF16 run with a recipe field changed is an arm)."""
        return self.recipe == K.BASELINE_RECIPE and self.recipe_label == K.BASELINE_RECIPE

    @property
    def is_native(self) -> bool:
        return self.backend == K.NATIVE_BACKEND

    def summary_number(self, name: str) -> float | None:
        v = (self.summary or {}).get(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    @property
    def tokens_per_s(self) -> float | None:
        """summary.tokens_per_s (median of steady-state steps); else the median of logged values."""
        v = self.summary_number("tokens_per_s")
        return v if v is not None else _nanmedian(self.train.get(K.TOKENS_PER_S))

    @property
    def peak_mem_gib(self) -> float | None:
        v = self.summary_number("peak_mem_gib")
        if v is not None:
            return v
        col = self.train.get(K.PEAK_MEM_GIB)
        return float(np.nanmax(col)) if col is not None and np.isfinite(col).any() else None

    @property
    def final_eval_loss(self) -> float | None:
        v = self.summary_number("final_eval_loss")
        if v is not None:
            return v
        ev = self.eval.get(K.LOSS_EVAL)
        if ev is not None and len(ev) and np.isfinite(ev[-1]):
            return float(ev[-1])
        return None

    @property
    def loss_floor(self) -> float | None:
        """summary.loss_floor: the data's entropy rate in nats where it has one (markov)."""
        return self.summary_number("loss_floor")

    @property
    def config_warnings(self) -> list[str]:
        """Warnings the harness printed about this run's config (run.json `config_warnings`)."""
        w = self.provenance.get("config_warnings") or self.extra.get("config_warnings") or []
        return [str(x) for x in w] if isinstance(w, list) else [str(w)]

    @property
    def label(self) -> str:
        return f"{self.recipe_label} [{self.variant}] ({self.backend or 'backend?'})"


def recipe_identity(recipe: Any, label: Any = None) -> tuple[str | None, str | None]:
    """(family, recipe label) of a run whose recipe is `recipe` and whose summary.recipe_label is
    `label` (None where the run was written before labels): names from before the families go
    through `keys.LEGACY_RECIPES`; a run without a label is at its family's preset."""
    if recipe is None:
        return None, str(label) if label else None
    family, legacy_label = K.LEGACY_RECIPES.get(str(recipe), (str(recipe), None))
    return family, str(label or legacy_label or family)


def _name_of(v: Any) -> Any:
    return v.get("name") if isinstance(v, dict) else v


def _nanmedian(col: np.ndarray | None) -> float | None:
    if col is None or not np.isfinite(col).any():
        return None
    return float(np.nanmedian(col))
