"""W&B settings: an explicit override, then WANDB_* variables, then the preset, recorded in run.json; a
run under a W&B sweep agent, with the command and environment the agent gives it (docs/wandb.md),
offline. The resolution is tested in process; runs that open W&B start its service (slow)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from harness.config.errors import ConfigError
from harness.config.schema import WandbConfig
from harness.lifecycle.loggers import resolve_settings
from tests.helpers import REPO, run_main

TINY = ["model=gpt_tiny", "backend=emulated", "hardware=cpu", "steps=2", "log_interval=1", "eval_interval=0",
        "eval_tokens=512", "micro_batch_size=4", "global_batch_size=4", "data.num_tokens=20000"]  # fmt: skip


def test_each_setting_is_the_override_else_its_variable_else_the_preset():
    w = WandbConfig(project="mine", group="g")
    env = {"WANDB_PROJECT": "envproj", "WANDB_ENTITY": "team", "WANDB_RUN_GROUP": "envgroup"}
    values, sources = resolve_settings(w, {"project"}, env, sweep_group="s/1")
    assert values == {"project": "mine", "entity": "team", "group": "envgroup", "mode": "offline"}
    assert sources == {
        "project": "override",
        "entity": "WANDB_ENTITY",
        "group": "WANDB_RUN_GROUP",
        "mode": "preset",
    }
    values, sources = resolve_settings(WandbConfig(), set(), {"WANDB_MODE": "dryrun"}, sweep_group="s/1")
    assert values == {"project": "lowp", "entity": None, "group": "s/1", "mode": "offline"}
    assert sources == {"project": "preset", "entity": "preset", "group": "sweep", "mode": "WANDB_MODE"}


def test_under_a_sweep_agent_project_entity_are_the_agents_and_the_mode_online():
    env = {"WANDB_SWEEP_ID": "sw1", "WANDB_PROJECT": "p", "WANDB_ENTITY": "e"}
    values, sources = resolve_settings(WandbConfig(project="mine"), {"project"}, env)
    assert values == {"project": None, "entity": None, "group": None, "mode": "online"}
    assert sources == {
        "project": "sweep agent",
        "entity": "sweep agent",
        "group": "preset",
        "mode": "sweep agent",
    }
    values, _ = resolve_settings(WandbConfig(), set(), {**env, "WANDB_MODE": "offline"})
    assert values["mode"] == "offline"


def test_an_unknown_wandb_mode_is_one_line_naming_the_variable():
    with pytest.raises(
        ConfigError, match=r"^WANDB_MODE=cloud: not a W&B mode; use online, offline or disabled$"
    ):
        resolve_settings(WandbConfig(), set(), {"WANDB_MODE": "cloud"})


@pytest.mark.slow
def test_a_run_records_which_setting_won(capsys, monkeypatch, tmp_path):
    from harness.train import main

    monkeypatch.setenv("WANDB_PROJECT", "envproj")
    monkeypatch.setenv("WANDB_RUN_GROUP", "envgroup")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    run_dir = tmp_path / "run"
    code, err = run_main(capsys, main, "harness.train", *TINY, "logger=wandb", "logger.wandb.group=mine",
                         f"hydra.run.dir={run_dir}")  # fmt: skip
    assert code == 0, err
    logged = json.loads((run_dir / "run.json").read_text())["wandb"]
    assert (logged["project"], logged["group"], logged["mode"]) == ("envproj", "mine", "offline")
    assert logged["sources"] == {"project": "WANDB_PROJECT", "entity": "preset", "group": "override",
                                 "mode": "WANDB_MODE"}  # fmt: skip


def agent_command(sweep: dict, point: dict) -> list[str]:
    """The command `wandb agent` runs for one point of `sweep`, built by wandb's own code as its agent
    does (wandb_agent.Agent._command_run), with this interpreter as `${interpreter}`."""
    from wandb.sdk.launch.sweeps import utils

    command = utils.create_sweep_command(sweep["command"])
    values = utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})
    values.update(interpreter=[sys.executable], program=[sweep["program"]], env=["/usr/bin/env"])
    out = []
    for c in map(str, command):
        out += values.get(c[2:-1]) or [] if c.startswith("${") and c.endswith("}") else [c]
    return out


@pytest.mark.slow
def test_the_documented_agent_command_runs_with_the_agents_environment(tmp_path):
    doc = (REPO / "docs" / "wandb.md").read_text()
    sweep = yaml.safe_load(re.search(r"```yaml\n(# lowp_lr.yaml.*?)```", doc, re.S).group(1))
    # the doc's own fixed overrides (a CPU demo) replaced by the tiny run's
    sweep["command"] = [c for c in sweep["command"] if not re.match(r"(model|steps)=", c)]
    at = sweep["command"].index("${args_no_hyphens}")
    sweep["command"][at:at] = TINY
    point = {k: v["values"][-1] for k, v in sweep["parameters"].items()}  # recipe=tensorwise, lr=0.001
    from wandb.sdk.lib import config_util

    params = tmp_path / "wandb" / "sweep-sw1" / "config-agentrun1.yaml"
    config_util.save_config_file_from_dict(str(params), {k: {"value": v} for k, v in point.items()})
    env = {"WANDB_SWEEP_ID": "sw1", "WANDB_RUN_ID": "agentrun1", "WANDB_PROJECT": "agentproj",
           "WANDB_ENTITY": "agentteam", "WANDB_SWEEP_PARAM_PATH": str(params), "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(REPO)}  # this checkout's lowp, whatever is installed  # fmt: skip
    cmd = agent_command(sweep, point)
    assert cmd[-2:] == ["recipe=tensorwise", "optimizer.lr=0.001"]
    for _ in range(2):  # the agent starting the same run again: it resumes, same W&B run
        res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "wandb" / "agentrun1"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["config"]["recipe"]["name"] == "tensorwise" and run["config"]["optimizer"]["lr"] == 0.001
    logged = run["wandb"]
    assert (logged["run_id"], logged["sweep_id"], logged["project"]) == ("agentrun1", "sw1", "agentproj")
    assert logged["sources"] == {"project": "sweep agent", "entity": "sweep agent", "group": "preset",
                                 "mode": "WANDB_MODE"}  # fmt: skip
    assert len(run["attempts"]) == 2 and "already complete" in res.stdout + res.stderr
    assert {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")} == {"agentrun1"}


def test_a_sweep_leaves_its_group_to_wandb_run_group_where_that_is_set(monkeypatch, tmp_path):
    from harness.multirun import launch as L

    args = L.parse_args(["tiny_matrix", f"hydra.sweep.dir={tmp_path / 's'}"])
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    assert all(
        any(o.startswith("logger.wandb.group=tiny_matrix/") for o in j.overrides) for j in L.plan(args).jobs
    )
    monkeypatch.setenv("WANDB_RUN_GROUP", "mine")
    assert not any(o.startswith("logger.wandb.group=") for j in L.plan(args).jobs for o in j.overrides)
