"""End to end on a model with outlier channels in one layer (tests/outliers.py): counterfactual
telemetry, the plan, then sweeps/plan_check's jobs (BF16, uniform NVFP4, the plan) at the same seeds
and budget, compared by analysis. The jobs run in this process so the test-only transform reaches
them; `python -m harness.sweep plan_check stability.plan_file=PLAN` runs the same job list."""

from __future__ import annotations

import json

import pytest
import yaml

from harness.multirun.spec import build_jobs
from harness.plan import main as plan_main
from harness.train import run
from tests.helpers import compose_cfg
from tests.outliers import outliers_in
from tests.test_plan import CPU, OUTLIER_LAYER

BUDGET = ["model=gpt_tiny", "steps=30", "eval_interval=0", "eval_tokens=2048", "log_interval=5",
          "data.num_tokens=200000", "seed=0,1"]  # fmt: skip


@pytest.mark.slow
def test_plan_check_on_outlier_channels(tmp_path):
    import analysis

    tele = tmp_path / "telemetry"
    with outliers_in(OUTLIER_LAYER, channels=4, seed=0):
        cfg = compose_cfg(
            *CPU, "steps=2", "recipe=bf16", "telemetry_interval=1", "telemetry.candidates=[nvfp4]"
        )
        assert run(cfg, tele).status == "completed"
        plan_path = tmp_path / "plan.yaml"
        assert plan_main([str(tele), "--goal", "max-bf16-modules", "--k", "1", "--out", str(plan_path)]) == 0
        plan = yaml.safe_load(plan_path.read_text())
        assert [m for m, r in plan["modules"].items() if r == "bf16"] == [OUTLIER_LAYER]
        jobs, _ = build_jobs("plan_check", [f"stability.plan_file={plan_path}", *BUDGET])
        assert sorted({j.arm for j in jobs}) == ["bf16", "plan", "uniform"] and len(jobs) == 6
        sweep = tmp_path / "sweep"
        for job in jobs:  # as the sweep's launcher runs them, without Hydra's own keys
            overrides = [o for o in job.overrides if not o.startswith("hydra.")]
            assert run(compose_cfg(*overrides), sweep / job.name).status == "completed"
    from analysis.precision_ranking import plan_verdicts

    runs = analysis.load([str(sweep)])
    verdicts = plan_verdicts(analysis.compare(runs))
    assert (
        len(verdicts) == 1
        and verdicts[0].startswith("nvfp4 with the plan: ")
        and "; uniform nvfp4: " in verdicts[0]
    )
    plan_run = json.loads((sweep / "2_plan_s0" / "run.json").read_text())
    assert plan_run["provenance"]["quantized_modules"][OUTLIER_LAYER] == "bf16"
    losses = {
        arm: [
            json.loads((sweep / j.name / "summary.json").read_text())["final_train_loss"]
            for j in jobs
            if j.arm == arm
        ]
        for arm in ("bf16", "uniform", "plan")
    }
    print("plan_check final train losses:", json.dumps(losses), "verdicts:", verdicts)
    assert all(len(v) == 2 for v in losses.values())
