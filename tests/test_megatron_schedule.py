"""A precision schedule's Megatron-LM export (harness/interop/megatron_schedule.py): one command per
phase, chained through one checkpoint directory, the second loading the first's checkpoint with its
optimizer, iteration and RNGs but without its FP8 extra state; each command held against Megatron-LM's
own rules as tests/test_megatron_parallel.py holds the plain export (read at d98e8a6). In-process, but
for one slow test that feeds every phase command of `benchmarks.megatron_lm check`'s schedules to
Megatron-LM's own parse_args + validate_args (a Megatron-LM tree named by LOWP_MEGATRON, run by the
Python >= 3.12 named by LOWP_MEGATRON_PYTHON, default this one; skipped without them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.interop.megatron import provider_fields
from harness.interop.megatron_schedule import phase_configs, schedule_args
from harness.megatron import main
from harness.validation.load import load
from tests.helpers import run_main
from tests.test_megatron import pairs
from tests.test_megatron_parallel import megatron_refusals

# the flags the schedule adds, each in Megatron-LM d98e8a6's parser: --save, --load, --ckpt-format
# (CheckpointConfig fields, megatron/training/config/training_config.py, made flags by
# ArgumentGroupFactory in arguments.py:3008), --exit-interval (TrainingConfig.exit_interval),
# --ckpt-drop-redundant-extra-state (arguments.py:3036); --save-interval (CheckpointConfig.save_interval)
SCHEDULE_FLAGS = {"--save", "--save-interval", "--load", "--ckpt-format", "--exit-interval"}
SCHEDULE_FLAGS |= {"--ckpt-drop-redundant-extra-state"}
BASE = ["model=gpt_tiny", "steps=100", "data=synthetic"]
SCHEDULES = {
    "nvfp4-bf16": ["recipe=nvfp4", "schedule=bf16_last10pct"],
    "tensorwise-hp_backward": ["recipe=tensorwise", "schedule=hp_backward_last10pct"],
    "nvfp4-hp_fwd_mxfp8_bwd": ["recipe=nvfp4", "schedule=hp_forward_last10pct"],
    "delayed-delayed-tensorwise": [
        "recipe=delayed",
        "schedule.phases=[{at_step: 30, fields: {fp8_amax_compute_algo: most_recent}}, "
        "{at_step: 60, recipe: tensorwise}]",
    ],
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_phase_is_a_command_megatron_accepts(name):
    cfg = load([*BASE, *SCHEDULES[name]], for_export=True)
    commands = schedule_args(cfg, "/ckpt")
    phases = phase_configs(cfg)
    assert len(commands) == len(cfg.schedule.phases) + 1 == len(phases)
    starts = [0, *(p.at_step or round(p.at_fraction * cfg.steps) for p in cfg.schedule.phases)]
    for i, ((argv, _), phase) in enumerate(zip(commands, phases)):
        refused = [
            r
            for r in megatron_refusals(argv, provider_fields(phase))
            if r.split(":")[0] not in SCHEDULE_FLAGS
        ]
        assert refused == [], (i, refused)
        f = pairs(argv)
        assert f["--train-iters"] == "100" and f["--save"] == "/ckpt" and f["--ckpt-format"] == "torch_dist"
        assert "--ckpt-drop-redundant-extra-state" in f  # the next phase loads no recipe-only FP8 state
        assert f.get("--load") == (None if i == 0 else "/ckpt")
        assert f.get("--exit-interval") == (str(starts[i + 1]) if i + 1 < len(starts) else None)
        end = starts[i + 1] if i + 1 < len(starts) else cfg.steps
        assert f["--save-interval"] == str(end)  # --save needs a save interval > 0 (arguments.py:1361-1363)
        # what a warm start keeps: optimizer state, iteration and LR schedule, RNGs
        assert not {"--finetune", "--no-load-optim", "--no-load-rng", "--phase-transition-iterations"} & set(
            f
        )
        assert ("--fp8-format" in f or "--fp4-format" in f) == (phase.recipe.name != "bf16"), i


def test_the_command_line_prints_a_block_per_phase(capsys):
    assert main([*BASE, *SCHEDULES["nvfp4-bf16"]]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("# phase ")]
    assert heads == ["# phase 0: steps 0..89 in nvfp4", "# phase 1: steps 90..99 in bf16"], heads
    first, second = out.split("\n\n# phase 1")
    assert "--exit-interval 90" in first and "--load" not in first and "--fp4-format e2m1" in first
    assert '--load "${CHECKPOINTS' in second and "--fp4-format" not in second


def test_a_schedule_megatron_cannot_express_is_refused_in_one_line(capsys):
    code, err = run_main(
        capsys, main, "harness.megatron", *BASE, "recipe=tensorwise", "schedule.phases=[{at_step: 100}]"
    )
    assert code == 2 and err.strip().startswith("error: schedule.phases.0 (phase 1) starts at step 100")


@pytest.mark.slow
def test_every_phase_command_passes_megatron_lm_argument_validation(tmp_path):
    tree = Path(os.environ.get("LOWP_MEGATRON", "/nonexistent"))
    if not (tree / "megatron/training/arguments.py").exists():
        pytest.skip("LOWP_MEGATRON: no Megatron-LM tree (git archive HEAD megatron | tar -x -C DIR)")
    python = os.environ.get("LOWP_MEGATRON_PYTHON")
    if python is None and sys.version_info < (3, 12):
        pytest.skip(
            "LOWP_MEGATRON_PYTHON: Megatron-LM d98e8a6 needs Python >= 3.12 with torch, numpy, triton"
        )
    cmd = [sys.executable, "-m", "benchmarks.megatron_lm", "check", "--schedules-only", "--jobs", "1"]
    cmd += ["--megatron", str(tree), "--python", python or sys.executable, "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads((tmp_path / "check.json").read_text())
    s = report["schedules"]
    assert s["lowp_refuses"] == [] and s["megatron_refuses"] == [] and s["unchecked_without_te"] == 0
    assert s["megatron_accepts"] == s["phase_commands"] > s["schedules"] >= 20
    by_case = {c["case"]: c["phases"] for c in report["all_schedules"]}
    for case, recipes in (
        ("nvfp4 -> bf16", ["nvfp4", "bf16"]),
        ("delayed -> delayed (most_recent)", ["delayed"] * 2),
    ):
        phases = by_case[f"model=gpt_1b {case}"]
        assert [p["recipe"] for p in phases] == recipes
        assert {"--load", "--ckpt-drop-redundant-extra-state"} <= set(phases[1]["argv"])
        assert "--exit-interval" in phases[0]["argv"] and all(p["megatron"]["ok"] for p in phases)
