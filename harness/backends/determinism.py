"""backend.deterministic: a run that computes the same bits every time (Megatron-LM's --deterministic-mode).

On CUDA, kernels that add with atomics (TE's fused-attention backward by default, torch's index_add
and scatter kernels) make two runs of one seed part: on the Mixtral-like slice the gradient norm
differs from step 1. A loss check that pairs a recipe's run with the BF16 run of its seed
(analysis.seed_band) then cannot tell the recipe from that drift (benchmarks/RESULTS.md, "Loss checks
of MoE runs"). Megatron's rule (megatron/training/determinism.py), which lowp follows for the run's
lifetime:

- the environment NCCL (at communicator init), cuBLAS (at handle creation) and TE (at each attention
  module's construction) read: NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0,
  CUBLAS_WORKSPACE_CONFIG=:4096:8, each set only where the user has not set it, and a value set to
  something that is not deterministic refused (`env_errors`);
- `torch.use_deterministic_algorithms(True)`: torch's deterministic kernels where it has them, an
  error naming the op where it has none;
- options with no deterministic implementation refused (`option_errors`): the fused cross-entropy.

`enable()` applies it and returns the function that puts the process back as it was (a sweep's next
job, a benchmark's next run in the same process).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Megatron's DETERMINISM_ENV_VAR_DEFAULTS."""
NCCL_ALGOS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")
"""The NCCL_ALGO tokens Megatron accepts as deterministic (Tree is not: its reduction order varies)."""
ACCEPTED = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",), "CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}


def env_errors() -> list[str]:
    """One line per variable the user set to a value that is not deterministic."""
    env, errs = os.environ, []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or any(t not in NCCL_ALGOS for t in tokens):
            errs.append(
                f"backend.deterministic=true with environment NCCL_ALGO={algo}: not a deterministic "
                f"algorithm; unset it or use one of {', '.join(NCCL_ALGOS)}"
            )
    for var, accepted in ACCEPTED.items():
        value = env.get(var)
        if value is not None and value not in accepted:
            errs.append(
                f"backend.deterministic=true with environment {var}={value}: not deterministic; unset it "
                f"or set {var}={accepted[0]}"
            )
    return errs


def option_errors(cross_entropy_loss_fusion: bool) -> list[str]:
    """Megatron's ARG_VALUES_REQUIRED_FOR_DETERMINISM that lowp has (tp_comm_overlap it has not)."""
    if cross_entropy_loss_fusion:
        return [
            "backend.deterministic=true with model.cross_entropy_loss_fusion=true: the fused loss has no "
            "deterministic kernel (Megatron's --deterministic-mode refuses it too); set "
            "model.cross_entropy_loss_fusion=false"
        ]
    return []


def enable() -> Callable[[], None]:
    """Set what is unset of ENV and turn on torch's deterministic algorithms; returns the undo."""
    errs = env_errors()
    if errs:
        raise ValueError(errs[0])
    added = {var: value for var, value in ENV.items() if var not in os.environ}
    os.environ.update(added)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)

    def undo() -> None:
        for var, value in added.items():
            if os.environ.get(var) == value:
                del os.environ[var]
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])

    return undo


def applied() -> dict:
    """What run.json records: torch's switch and the ENV variables' values in this process."""
    return {"torch": torch.are_deterministic_algorithms_enabled(), "env": {v: os.environ.get(v) for v in ENV}}
