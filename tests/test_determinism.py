"""backend.deterministic (Megatron-LM's --deterministic-mode): the environment and torch's switch for the
run and back after it, the values and options it refuses, what run.json records, Megatron's flag."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harness.backends import determinism
from harness.interop.megatron import megatron_args
from harness.train import run
from harness.validation.legality import legality_errors
from tests.helpers import compose_cfg, tiny_cpu_run


@pytest.fixture
def clean_env(monkeypatch):
    for var in determinism.ENV:
        monkeypatch.delenv(var, raising=False)
    yield
    torch.use_deterministic_algorithms(False)


def test_enable_sets_what_is_unset_keeps_the_users_value_and_undo_puts_it_back(clean_env, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    undo = determinism.enable()
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # the user's, deterministic too
    assert determinism.applied()["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    undo()
    assert not torch.are_deterministic_algorithms_enabled()
    assert "NCCL_ALGO" not in os.environ and "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize(
    "var, value",
    [("NCCL_ALGO", "Tree"), ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"), ("CUBLAS_WORKSPACE_CONFIG", ":0:0")],
)
def test_a_nondeterministic_value_in_the_environment_is_refused_by_name(clean_env, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    errs = legality_errors(compose_cfg("backend.deterministic=true"))
    assert len(errs) == 1 and f"{var}={value}" in errs[0] and "unset it" in errs[0], errs
    with pytest.raises(ValueError, match=var):
        determinism.enable()
    assert not torch.are_deterministic_algorithms_enabled()
    assert legality_errors(compose_cfg()) == []  # only a deterministic run reads them


def test_the_fused_loss_is_refused_as_megatron_refuses_it(clean_env):
    errs = legality_errors(compose_cfg("backend.deterministic=true", "model.cross_entropy_loss_fusion=true"))
    assert any("model.cross_entropy_loss_fusion=false" in e for e in errs), errs


def test_megatron_export_carries_deterministic_mode():
    argv, _ = megatron_args(compose_cfg("backend.deterministic=true"))
    assert "--deterministic-mode" in argv
    assert "--deterministic-mode" not in megatron_args(compose_cfg())[0]


def test_a_deterministic_run_records_it_and_leaves_the_process_as_it_was(clean_env, tmp_path):
    summary = run(compose_cfg(*tiny_cpu_run(3, 2, 2), "backend.deterministic=true"), tmp_path)
    assert summary.status == "completed"
    recorded = json.loads((tmp_path / "run.json").read_text())["provenance"]["deterministic"]
    assert recorded == {"torch": True, "env": determinism.ENV}
    assert not torch.are_deterministic_algorithms_enabled()
    assert not any(var in os.environ for var in determinism.ENV)
