"""The hybrid factories by the names users type: a run, a per-module stability override, a sweep over
them, and a wrong name (all in this process: `harness.train`'s main, the sweep's own job builder)."""

from __future__ import annotations

import json

import pytest

from harness import recipes
from harness import train as T
from harness.multirun.spec import build_jobs
from harness.numerics import hybrid as H
from harness.numerics.quantizers import make_quantizer
from harness.validation.load import load
from tests.helpers import TINY, run_main
from tests.numerics.test_hybrid import HAS_ROW_SCALED

RUN = [*TINY, "backend=emulated", "hardware=cpu", "steps=1", "eval_interval=0", "log_interval=1"]
RUN += ["eval_tokens=256", "checkpoint_interval=-1", "data.num_tokens=20000", "micro_batch_size=2"]
RUN += ["global_batch_size=2"]


def _train(capsys, run_dir, *args):
    return run_main(capsys, T.main, "harness.train", *RUN, f"hydra.run.dir={run_dir}", *args)


def _numerics(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())["provenance"]["numerics"]


def test_a_run_selects_a_factory_by_its_te_name(capsys, tmp_path):
    code, err = _train(
        capsys, tmp_path, "recipe=custom", "recipe.quantizer_factory=mxfp8_fwd_nvfp4_bwd_factory"
    )
    assert code == 0, err
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    fc1 = _numerics(tmp_path)["blocks.0.mlp.fc1"]
    assert fc1.startswith(
        "custom(input=Hybrid(rowwise=MXFP8(E4M3, 1x32, E8M0), columnwise=NVFP4(1x16, rht=True"
    )
    assert "grad=NVFP4(1x16, rht=True, sr=True)" in fc1


def test_a_stability_override_gives_one_module_a_factory(capsys, tmp_path):
    override = (
        "+stability.overrides=[{pattern:'*.fc2',recipe:custom,"
        "fields:{quantizer_factory:mxfp8_fwd_high_precision_bwd_factory}}]"
    )
    code, err = _train(capsys, tmp_path, "recipe=mxfp8", override)
    assert code == 0, err
    numerics = _numerics(tmp_path)
    assert numerics["blocks.0.mlp.fc2"].startswith(
        "custom(input=Hybrid(rowwise=MXFP8(E4M3, 1x32, E8M0), columnwise=Identity(high precision), "
        "from=rowwise_dequantized)"
    )
    assert "grad=Identity(high precision)" in numerics["blocks.1.mlp.fc2"]
    assert numerics["blocks.0.mlp.fc1"].startswith("mxfp8(input=MXFP8(")


SWEEP = """overrides: [model=gpt_tiny, backend=emulated, hardware=cpu, data.num_tokens=20000, steps=2,
            eval_tokens=512, micro_batch_size=4, global_batch_size=4, logger=none]
seeds: [0]
arms:
  zoo: [recipe=custom]
grid:
  recipe.quantizer_factory: [{names}]
"""


def test_a_sweep_over_the_factories_composes_validates_and_builds_every_job(tmp_path):
    spec = tmp_path / "zoo.yaml"
    spec.write_text(SWEEP.format(names=", ".join(H.FACTORIES)))
    jobs, _ = build_jobs(str(spec), [])
    arms = [j for j in jobs if "recipe=custom" in j.overrides]
    assert len(arms) == len(H.FACTORIES) and len(jobs) == len(arms) + 1  # and the BF16 baseline
    labels = set()
    for job in arms:  # each job's config as its run validates it, and what its emulated Linear builds
        recipe = load(job.overrides).recipe
        labels.add(recipes.label(recipe))
        name = H.short_name(recipe.quantizer_factory)
        assert name in H.FACTORIES
        if not HAS_ROW_SCALED and "row_scaled" in name:
            continue
        built = {r: make_quantizer(recipe, r) for r in ("input", "weight", "grad")}
        assert {r: repr(q) for r, q in built.items()} == {
            r: repr(H.FACTORIES[name](r, recipe)) for r in ("input", "weight", "grad")
        }
    assert len(labels) == len(arms), f"analysis would merge arms: {labels}"  # arms split by label


def test_a_wrong_name_is_one_line_naming_the_shipped_ones(capsys, tmp_path):
    run_dir = tmp_path / "run"
    code, err = _train(capsys, run_dir, "recipe=custom", "recipe.quantizer_factory=mxfp8_fwd_nvfp4_bwd")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "recipe.quantizer_factory='mxfp8_fwd_nvfp4_bwd'" in lines[0]
    assert all(name in lines[0] for name in H.FACTORIES)
    assert not run_dir.exists()


@pytest.mark.skipif(not HAS_ROW_SCALED, reason="row-scaled NVFP4 is not on this branch")
def test_a_row_scaled_factory_trains(capsys, tmp_path):
    factory = "recipe.quantizer_factory=nvfp4_row_scaled_fwd_high_precision_bwd_factory"
    code, err = _train(capsys, tmp_path, "recipe=custom", factory)
    assert code == 0, err
    assert "row_scaled=True" in _numerics(tmp_path)["blocks.0.attn.qkv"]


def by_module_factory(role, recipe, module_type="linear"):
    """A factory that tells TE's module types apart: MXFP8 for dense linears, BF16 for experts."""
    return H.IdentityQuantizer() if module_type == "grouped_linear" else H.mxfp8()


def test_an_moe_layers_experts_are_asked_as_te_asks_a_grouped_linear(capsys, tmp_path):
    factory = "recipe.quantizer_factory=tests.test_hybrid_runs:by_module_factory"
    code, err = _train(capsys, tmp_path, "model=qwen3_moe_tiny", "recipe=custom", factory)
    assert code == 0, err
    numerics = _numerics(tmp_path)
    experts = {k: v for k, v in numerics.items() if ".experts." in k}
    assert experts and all(v.startswith("custom(input=Identity(high precision)") for v in experts.values())
    dense = {k: v for k, v in numerics.items() if ".experts." not in k}
    assert dense and all(v.startswith("custom(input=MXFP8(") for v in dense.values())
