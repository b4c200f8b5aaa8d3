"""A precision schedule as Megatron-LM commands: one pretrain_gpt.py command per phase, each the export
of the run's config in that phase's recipe (harness.interop.megatron), chained through one checkpoint
directory (Megatron-LM d98e8a6, read for these flags):

- every command: `--train-iters` of the whole run (so the LR schedule spans the run, as lowp's does),
  `--save DIR --save-interval END --ckpt-format torch_dist --ckpt-drop-redundant-extra-state`, END the
  phase's last step (the next phase's first, or the run's end: Megatron needs a save interval with
  `--save`, arguments.py:1361-1363, and the first multiple of END after the phase's start is END);
- every phase but the last: `--exit-interval K`, K the next phase's first step; Megatron saves a
  checkpoint at K and exits (training.py:4129-4148). Not `--phase-transition-iterations`: that flag
  also restarts the data stream at each transition (training.py:5445-5451, 5495-5498), where lowp's
  data position carries over;
- every phase but the first: `--load DIR`, without `--finetune`, `--no-load-optim` or `--no-load-rng`,
  so Megatron loads the weights, the optimizer state, the iteration and LR scheduler, the consumed
  samples (the data position) and the RNG states (checkpointing.py:2958-3071);
- without its FP8 state: `--ckpt-drop-redundant-extra-state` (arguments.py:3036) makes Megatron skip
  every TE `_extra_state` that holds no delayed-scaling amax history or scale, on save and on load
  (checkpointing.py:1636-1727). A freshly built TE module has an empty `_extra_state`, so the next
  phase requests none of the checkpoint's: its TE modules start with fresh quantizers and scale state,
  as lowp's switch does. Without the flag, TE 2.20.2's set_extra_state would restore the previous
  recipe object (module/base.py:1456-1463), and a module whose recipe class is unchanged would keep
  that recipe's quantizers (module/base.py:1111-1135).
"""

from __future__ import annotations

import dataclasses
import shlex

from harness import recipes
from harness.config.schema import Config, ScheduleConfig
from harness.interop.megatron import megatron_args, render
from harness.model import schedule as S

CHECKPOINT_DIR = "${CHECKPOINTS:?a directory for the phases' checkpoint}"
"""Where the phases save and load (a shell variable in the printed commands)."""


def phase_configs(cfg: Config) -> list[Config]:
    """The run's config in each phase's recipe, without the schedule."""
    return [
        dataclasses.replace(cfg, recipe=r, schedule=ScheduleConfig())
        for r in S.phase_recipes(cfg.recipe, cfg.schedule)
    ]


def checkpoint_flags(index: int, starts: list[int], steps: int, directory: str = CHECKPOINT_DIR) -> list[str]:
    """The flags that chain phase `index` to its neighbours through one checkpoint directory; its
    checkpoint is saved where it ends (`--save` needs `--save-interval`: arguments.py:1361-1363)."""
    end = starts[index + 1] if index + 1 < len(starts) else steps
    flags = ["--save", directory, "--save-interval", str(end), "--ckpt-format", "torch_dist"]
    flags += ["--ckpt-drop-redundant-extra-state"]
    if index > 0:
        flags += ["--load", directory]
    if index + 1 < len(starts):
        flags += ["--exit-interval", str(end)]
    return flags


def schedule_args(cfg: Config, directory: str = CHECKPOINT_DIR) -> list[tuple[list[str], list[str]]]:
    """(argv, comment lines) of each phase's command, in order."""
    starts = S.starts(cfg.schedule, cfg.steps)
    out = []
    for i, phase in enumerate(phase_configs(cfg)):
        argv, notes = megatron_args(phase)
        out.append((argv + checkpoint_flags(i, starts, cfg.steps, directory), notes))
    return out


def render_schedule(cfg: Config, fmt: str = "sh") -> str:
    """Each phase's export (`render`) with its checkpoint flags, under a line naming the phase."""
    starts = S.starts(cfg.schedule, cfg.steps)
    ends = [*starts[1:], cfg.steps]
    joiner = "\n" if fmt == "args" else " \\\n  "
    blocks = []
    for i, phase in enumerate(phase_configs(cfg)):
        head = f"# phase {i}: steps {starts[i]}..{ends[i] - 1} in {recipes.label(phase.recipe)}"
        text = render(phase, fmt) + joiner + joiner.join(_lines(checkpoint_flags(i, starts, cfg.steps)))
        blocks.append(f"{head}\n{text}")
    return "\n\n".join(blocks)


def _lines(flags: list[str]) -> list[str]:
    """`--flag value` a line (a value that is a shell variable stays expandable)."""
    out, i = [], 0
    while i < len(flags):
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        shown = None if value is None else (f'"{value}"' if value.startswith("${") else shlex.quote(value))
        out.append(flags[i] if shown is None else f"{flags[i]} {shown}")
        i += 1 if value is None else 2
    return out
