"""Two W&B offline runs logged by the real wandb client, as a training job logs them.

    python -m tests.analysis.wandb_runs DIR     # writes DIR/wandb/offline-run-*/, prints the run ids

BF16 (seed 0, with the harness's summary fields) and tensorwise (seed 0, loss +0.02, no summary: its
status comes from the exit code), 100 steps of 512 tokens. `data/wandb_offline/` holds the .wandb
files of one such call (wandb 0.31.0), read by the fast tests; the slow tests log fresh ones, so a
wandb release that changes the format fails there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOKENS_PER_STEP = 512


def log_run(root: Path, recipe: str, seed: int, offset: float, with_summary: bool) -> str:
    import wandb

    config = {
        "recipe": {"name": recipe}, "stability": {"name": "none"}, "optimizer": {"name": "adamw_fp32"},
        "hardware": {"name": "cpu"}, "model": {"name": "gpt_tiny", "seq_length": 64},
        "data": {"name": "markov"}, "backend": {"name": "emulated"}, "seed": seed, "steps": 100,
        "global_batch_size": 8,
        "provenance": {"backend": "emulated", "hardware": "cpu", "seed": seed},
    }  # fmt: skip
    with wandb.init(
        mode="offline", dir=root, project="lowp", group="sweep-1", job_type=recipe, config=config
    ) as run:
        for step in range(10, 101, 10):
            loss = 5.0 - 0.01 * step + offset
            row = {"step": step, "tokens": step * TOKENS_PER_STEP, "loss/train": loss, "time/step_ms": 50.0}
            if step % 50 == 0:
                row["loss/eval"] = loss + 0.1
            run.log(row, step=step)
        if with_summary:
            run.summary.update({"status": "completed", "recipe": recipe, "seed": seed, "tokens": 100 * 512})
        return run.id


def main(root: Path) -> dict[str, str]:
    return {
        "bf16": log_run(root, "bf16", 0, 0.0, with_summary=True),
        "tensorwise": log_run(root, "tensorwise", 0, 0.02, with_summary=False),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
