"""The precision plan from counterfactual telemetry: it finds a layer with LLM.int8()-style outlier
channels from telemetry alone, loads as `stability=plan`, and its Megatron file passes Megatron's
own loader (a Megatron-LM tree named by LOWP_MEGATRON, e.g. from `git archive HEAD megatron`)."""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
from pathlib import Path

import pytest
import yaml

from harness.interop.megatron_precision import NotExpressible, megatron_path, precision_config
from harness.plan import main
from harness.train import run
from tests.helpers import TINY, compose_cfg
from tests.outliers import outliers_in

OUTLIER_LAYER = "blocks.1.mlp.fc1"
CPU = [*TINY, "eval_interval=0", "checkpoint_interval=0", "backend=emulated", "hardware=cpu"]
RUN = [*CPU, "steps=2", "log_interval=1", "telemetry_interval=1", "recipe=bf16",
       "telemetry.candidates=[nvfp4,mxfp8]"]  # fmt: skip


@pytest.fixture(scope="module")
def outlier_run(tmp_path_factory):
    """A BF16 run of gpt_tiny whose blocks.1.mlp.fc1 input has 4 outlier channels (20-60x)."""
    d = tmp_path_factory.mktemp("outliers")
    with outliers_in(OUTLIER_LAYER, channels=4, seed=0):
        assert run(compose_cfg(*RUN), d).status == "completed"
    return d


STORED = Path(__file__).parent / "assets" / "plan" / "outlier_tiny"
"""outlier_run's run directory as stored (tests/assets/plan/README.md)."""


def _plan(run_dir: Path, out: Path, *args: str) -> dict:
    assert main([str(run_dir), *args, "--out", str(out)]) == 0
    return yaml.safe_load(out.read_text())


def test_the_plan_finds_the_outlier_layer_from_telemetry_alone(outlier_run, tmp_path):
    plan = _plan(outlier_run, tmp_path / "plan.yaml", "--goal", "max-bf16-modules", "--k", "1",
                 "--candidate", "nvfp4")  # fmt: skip
    assert [m for m, r in plan["modules"].items() if r == "bf16"] == [OUTLIER_LAYER]
    assert plan["goal"] == "max-bf16-modules" and plan["inputs"]["k"] == 1
    assert plan["inputs"]["runs"] == [str(outlier_run.resolve())]
    worst = plan["ranking"][0]
    assert worst["layer"] == OUTLIER_LAYER and worst["flushed_operand"] == "input"
    assert worst["underflow"] > 2 * plan["ranking"][1]["underflow"]  # NVFP4 flushes the outliers' blocks
    # the same telemetry under a floor: the outlier layer alone misses NVFP4 and takes MXFP8
    flops = _plan(outlier_run, tmp_path / "flops.yaml", "--goal", "max-lowp-flops", "--sqnr-floor-db",
                  str(round(worst["score_db"] + 1.0, 2)))  # fmt: skip
    assert {m: r for m, r in flops["modules"].items() if r != "nvfp4"} == {OUTLIER_LAYER: "mxfp8"}


def test_plan_from_stored_telemetry(tmp_path):
    """The plan's logic on stored telemetry rows alone (no training): the outlier layer stays BF16,
    and under a floor between its NVFP4 score and the next module's it alone takes MXFP8."""
    plan = _plan(
        STORED, tmp_path / "plan.yaml", "--goal", "max-bf16-modules", "--k", "1", "--candidate", "nvfp4"
    )
    assert [m for m, r in plan["modules"].items() if r == "bf16"] == [OUTLIER_LAYER]
    first, second = plan["ranking"][:2]
    assert first["layer"] == OUTLIER_LAYER and first["score_db"] < second["score_db"] - 2
    floor = (first["score_db"] + second["score_db"]) / 2
    flops = _plan(STORED, tmp_path / "flops.yaml", "--goal", "max-lowp-flops", "--sqnr-floor-db", str(floor))
    assert {m: r for m, r in flops["modules"].items() if r != "nvfp4"} == {OUTLIER_LAYER: "mxfp8"}
    assert flops["inputs"]["sqnr_floor_db"] == floor and flops["inputs"]["models"] == ["gpt_tiny"]


def test_the_plan_loads_as_stability_plan(outlier_run, tmp_path):
    path = tmp_path / "plan.yaml"
    plan = _plan(outlier_run, path, "--goal", "max-bf16-modules", "--k", "1", "--candidate", "nvfp4")
    d = tmp_path / "run"
    cfg = compose_cfg(*CPU, "steps=1", "recipe=nvfp4", "stability=plan", f"stability.plan_file={path}")
    assert run(cfg, d).status == "completed"
    resolved = json.loads((d / "run.json").read_text())
    modules = {
        k: v for k, v in resolved["provenance"]["quantized_modules"].items() if k.startswith("blocks.")
    }
    assert modules == plan["modules"]
    overrides = resolved["config"]["stability"]["overrides"]
    assert [o["pattern"] for o in overrides] == list(plan["modules"])
    assert all(o["resolved"]["name"] == o["recipe"] for o in overrides)  # resolved into run.json
    import analysis
    from analysis.precision_ranking import report_section

    both = analysis.load([str(d), str(outlier_run)])
    section = report_section(both)
    assert f"| {OUTLIER_LAYER} | bf16 |" in section and "### nvfp4" in section  # plan table, ranking
    from analysis.precision_report import html_section

    html = html_section(both)  # report.html's copy of the same tables
    plan_row = f'<td>{OUTLIER_LAYER}</td>\n<td style="font-weight:600">bf16</td>'
    assert plan_row in html and "<h3>nvfp4</h3>" in html and "stability=plan" in html


def test_plan_file_is_read_only_under_the_plan_preset(tmp_path):
    """plan_check hands every arm stability.plan_file; the BF16 and uniform arms leave it unread."""
    from harness.model.plan import plan_overrides
    from harness.validation import load

    bad = tmp_path / "nope.yaml"
    base = [*TINY, "backend=emulated", "hardware=cpu", "recipe=nvfp4", f"stability.plan_file={bad}"]
    assert load(base).stability.overrides == []
    from harness.config.errors import ConfigError

    with pytest.raises(ConfigError, match="stability.plan_file=.*cannot read it"):
        plan_overrides(load(base).stability.__class__(name="plan", plan_file=str(bad)))
    with pytest.raises(ConfigError, match="stability=plan needs stability.plan_file=PATH"):
        plan_overrides(load(base).stability.__class__(name="plan"))


def test_megatron_names_and_refusals():
    from harness import recipes

    assert megatron_path("blocks.11.mlp.fc2") == "decoder.layers.11.mlp.linear_fc2"
    assert megatron_path("blocks.0.attn.qkv") == "decoder.layers.0.self_attention.linear_qkv"
    one = {"blocks.0.attn.qkv": recipes.default_fields("delayed")}
    with pytest.raises(NotExpressible, match="blocks.0.attn.qkv: delayed: Megatron refuses delayed"):
        precision_config(one)
    import dataclasses

    blockwise_1d = dataclasses.replace(recipes.default_fields("blockwise"), w_block_dim=1)
    with pytest.raises(NotExpressible, match="sets w_block_dim; Megatron's per-module file") as e:
        precision_config({"blocks.0.mlp.fc1": blockwise_1d})
    assert "\n" not in str(e.value)
    zoo = dataclasses.replace(
        recipes.default_fields("custom"), quantizer_factory="mxfp8_fwd_nvfp4_bwd_factory"
    )
    payload = precision_config({"blocks.0.mlp.fc1": zoo})["configs"]
    (cfg,) = payload.values()
    assert cfg["training_recipe"]["custom_recipe_factory"].endswith(
        "quantizer_factory_zoo.mxfp8_fwd_nvfp4_bwd_factory"
    )


def test_bad_plan_input_is_one_line(outlier_run, tmp_path, capsys):
    assert main([str(outlier_run), "--goal", "max-lowp-flops", "--out", str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --goal max-lowp-flops needs --sqnr-floor-db X (the lowest score_db a module may take)"
    )
    assert (
        main([str(outlier_run), "--goal", "max-bf16-modules", "--k", "1", "--out", str(tmp_path / "p.yaml")])
        == 2
    )
    assert "name one with --candidate (nvfp4, mxfp8)" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()


@pytest.fixture
def megatron_loader(monkeypatch):
    """Megatron-LM's own quantization-recipe loader (megatron/core/quantization), imported from the
    tree LOWP_MEGATRON names without running megatron/core/__init__.py (which needs triton and TE):
    `megatron` and `megatron.core` are bare packages over the tree's folders. NO_VCS_VERSION=1 is
    Megatron's own switch that keeps package_info from running git at import."""
    monkeypatch.setenv("NO_VCS_VERSION", "1")
    tree = Path(os.environ.get("LOWP_MEGATRON", "/nonexistent"))
    if not (tree / "megatron/core/quantization/quant_config.py").exists():
        pytest.skip("LOWP_MEGATRON: no Megatron-LM tree (git archive HEAD megatron | tar -x -C DIR)")
    saved = {k: v for k, v in sys.modules.items() if k == "megatron" or k.startswith("megatron.")}
    for name, sub in (("megatron", "megatron"), ("megatron.core", "megatron/core")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(tree / sub)]
        sys.modules[name] = pkg
    try:
        import megatron.core.parallel_state  # noqa: F401 - megatron.core.utils imports it back
        from megatron.core.quantization import utils

        yield utils
    finally:
        for k in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_megatron_loader_accepts_the_plan(outlier_run, tmp_path, megatron_loader):
    plan = _plan(outlier_run, tmp_path / "plan.yaml", "--goal", "max-lowp-flops", "--sqnr-floor-db", "9.5")
    mfile = tmp_path / "plan.megatron.yaml"
    recipe = megatron_loader.load_quantization_recipe(str(mfile))
    for name, want in plan["modules"].items():
        for prefix in ("", "module."):
            got = megatron_loader.get_quant_config_or_none(prefix + megatron_path(name), recipe)
            assert got is not None and got.config_key == want, (name, got)
            payload = got.config["training_recipe"]
            assert (
                payload == {}
                if want == "bf16"
                else payload[f"fp{4 if want == 'nvfp4' else 8}_quantization_recipe"] == want
            )
    assert megatron_loader.get_quant_config_or_none("decoder.layers.1.mlp.linear_fc11", recipe) is None

    # the TE-side parser (transformer_engine.py, needs TE: run on the GPU by tests/test_plan_gpu.py)
    # takes exactly TEQuantizationRecipe's fields and the recipe enums' values: read from its source
    import ast

    tree = Path(os.environ["LOWP_MEGATRON"]) / "megatron/core"
    src = ast.parse((tree / "extensions/transformer_engine.py").read_text())
    (cls,) = [n for n in src.body if isinstance(n, ast.ClassDef) and n.name == "TEQuantizationRecipe"]
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    from megatron.core import enums

    values = {e.value for e in (*enums.Fp8Recipe, *enums.Fp4Recipe)} - {"delayed"}
    for key, cfg in recipe.configs.items():
        assert set(cfg) == {"transformer_engine_config_type", "training_recipe"}, key
        assert cfg["transformer_engine_config_type"] == "TEQuantizationParams"
        assert set(cfg["training_recipe"]) <= fields, (key, set(cfg["training_recipe"]) - fields)
        for k in ("fp8_quantization_recipe", "fp4_quantization_recipe"):
            assert cfg["training_recipe"].get(k, "custom") in values, (key, k)


def test_ablation_gains_put_the_group_that_saved_most_loss_first():
    """plan_ablation: the group whose move to BF16 saved the most loss outranks the telemetry ranking."""
    import types

    import pandas as pd

    from analysis.precision_ranking import ablation_gains
    from harness.plan import assign

    arms = ["uniform", "uniform", "bf16-block0", "bf16-block0", "bf16-fc2", "bf16-fc2"]
    block0, fc2 = [{"pattern": "blocks.0.*"}], [{"pattern": "*.mlp.fc2"}]
    runs = types.SimpleNamespace(runs=pd.DataFrame({
        "config.name": [f"{a}-s{i % 2}" for i, a in enumerate(arms)],
        "final_eval_loss": [3.0, 3.2, 3.05, 3.15, 2.9, 3.0],
        "config.stability.overrides": [[], [], block0, block0, fc2, fc2],
    }))  # fmt: skip
    gains = ablation_gains(runs)
    assert list(gains["group"]) == ["fc2", "block0"] and gains["gain"].iloc[0] == pytest.approx(0.15)
    assert gains["patterns"].iloc[0] == ["*.mlp.fc2"]
    layers = ["blocks.0.mlp.fc1", "blocks.1.mlp.fc2", "blocks.0.mlp.fc2"]
    scores = pd.DataFrame({"layer": layers, "candidate": ["nvfp4"] * 3, "score_db": [1.0, 5.0, 6.0],
                           "order": [0, 2, 1]})  # fmt: skip
    args = types.SimpleNamespace(candidate="nvfp4", k=2, sqnr_floor_db=None)
    chosen = assign("max-bf16-modules", scores, {"nvfp4": None}, args, gains)
    assert chosen == {"blocks.0.mlp.fc1": "nvfp4", "blocks.0.mlp.fc2": None, "blocks.1.mlp.fc2": None}


MOE_STORED = Path(__file__).parent / "assets" / "plan" / "moe_tiny"
"""A BF16 qwen3_moe_tiny run with candidates, as stored (tests/assets/plan/README.md)."""
EXPERT_GROUPS = [f"blocks.{i}.mlp.experts.fc{k}" for i in range(2) for k in (1, 2)]


def test_a_plan_moves_whole_expert_groups(tmp_path):
    """Routed experts are ranked, planned, loaded and exported as groups: the plan names each group
    once, `stability=plan` runs the whole group in the plan's recipe, Megatron's file matches the
    group's TEGroupedLinear path, TE's factory gives the group's name its recipe; one expert is refused."""
    from harness.config.errors import ConfigError
    from harness.interop.te_plan import HIGH_PRECISION, plan_qfactory
    from harness.validation import load

    path = tmp_path / "plan.yaml"
    plan = _plan(MOE_STORED, path, "--goal", "max-bf16-modules", "--k", "1", "--candidate", "nvfp4")
    assert [m for m in plan["modules"] if ".experts." in m] == EXPERT_GROUPS
    (kept,) = [m for m, r in plan["modules"].items() if r == "bf16"]
    assert kept in EXPERT_GROUPS and plan["ranking"][0]["layer"] == kept  # NVFP4 hurts a group most
    matchers = yaml.safe_load((tmp_path / "plan.megatron.yaml").read_text())["matchers"].values()
    by_pattern = {m["pattern"]: m["config"] for m in matchers}
    assert by_pattern[f"*{megatron_path(kept)}"] == "bf16"
    assert megatron_path(kept) == kept.replace("blocks.", "decoder.layers.").replace(".fc", ".linear_fc")
    base = [*CPU, "model=qwen3_moe_tiny", "recipe=nvfp4"]
    cfg = load([*base, "stability=plan", f"stability.plan_file={path}"])
    from harness.model.plan import PrecisionPlan

    plan_of = PrecisionPlan(cfg.recipe, cfg.stability, cfg.model)
    ran = {g: (r.name if (r := plan_of.recipe_for(g)) else "bf16") for g in EXPERT_GROUPS}
    assert ran == {g: plan["modules"][g] for g in EXPERT_GROUPS}
    qfactory = plan_qfactory(str(path))
    assert qfactory.factory_for(kept) == qfactory.factory_for(megatron_path(kept)) == HIGH_PRECISION
    assert pickle.loads(pickle.dumps(qfactory)).factories == qfactory.factories  # TE pickles the recipe
    one = yaml.safe_load(path.read_text())
    one["overrides"].append({"pattern": f"{kept}.3", "recipe": "nvfp4"})
    path.write_text(yaml.safe_dump(one))
    with pytest.raises(ConfigError, match="an expert group runs under one recipe"):
        load([*base, "stability=plan", f"stability.plan_file={path}"])
    with pytest.raises(NotExpressible, match=f"one expert of a group.*plan the whole group {kept}$"):
        megatron_path(f"{kept}.3")


def test_megatron_loader_matches_expert_groups(tmp_path, megatron_loader):
    """Megatron's loader gives each TEGroupedLinear (decoder.layers.N.mlp.experts.linear_fcK, the
    name TEGroupedMLP hands it) the plan's recipe of its group."""
    plan = _plan(MOE_STORED, tmp_path / "plan.yaml", "--goal", "max-bf16-modules", "--k", "1",
                 "--candidate", "nvfp4")  # fmt: skip
    recipe = megatron_loader.load_quantization_recipe(str(tmp_path / "plan.megatron.yaml"))
    for group in EXPERT_GROUPS:
        got = megatron_loader.get_quant_config_or_none("module." + megatron_path(group), recipe)
        assert got is not None and got.config_key == plan["modules"][group], group


def test_the_html_report_shows_the_ranking(tmp_path, capsys):
    """lowp-report puts the ranking of stored counterfactual rows in report.html, beside report.md."""
    from analysis.report import main as report

    assert report([str(MOE_STORED), "--out", str(tmp_path), "--no-plots"]) == 0
    html, md = (tmp_path / "report.html").read_text(), (tmp_path / "report.md").read_text()
    assert "### nvfp4" in md and "<h3>nvfp4</h3>" in html and "<h3>mxfp8</h3>" in html
    ranking = html[html.index("<h2 id=ranking>") : html.index("<h2>How every number was obtained</h2>")]
    assert all(f"<td>{g}</td>" in ranking for g in EXPERT_GROUPS)  # expert groups ranked as modules


def test_te_splits_a_block_only_through_tes_factories_at_their_defaults():
    """backend=te runs a block the plan splits under a CustomRecipe of TE's factories (te_recipe), which
    mirror the recipes' defaults: a module whose recipe differs from them, or delayed scaling, is refused
    in one line naming it; every dense block linear has its TE role name."""
    import dataclasses

    from harness import recipes
    from harness.backends.te import LINEARS
    from harness.backends.te_recipe import TE_GEMM_NAMES, factory_name

    assert set(TE_GEMM_NAMES) == set(LINEARS)
    assert factory_name(recipes.default_fields("tensorwise"), "m") == "current_scaling_factory"
    assert factory_name(recipes.default_fields("nvfp4"), "m") == "nvfp4_factory"
    assert factory_name(None, "m") == "high_precision_factory"
    pow2 = dataclasses.replace(recipes.default_fields("tensorwise"), power_2_scales=True)
    for bad in (pow2, recipes.default_fields("delayed")):
        with pytest.raises(ValueError, match="blocks.0.mlp.fc2: .* no TE factory at its defaults"):
            factory_name(bad, "blocks.0.mlp.fc2")


def test_te_checkpoint_state_skips_a_custom_recipes_empty_meta():
    """A block a plan splits runs under TE's CustomRecipe, whose fp8_meta holds scale and amax_history
    as None (seen on the H200: the run's final checkpoint failed on `.clone()` of None); the TE
    backend's checkpoint state keeps delayed scaling's tensors and nothing for such a meta."""
    import types

    import torch

    from harness.backends.te import TEBackend

    class Module(torch.nn.Module):
        def __init__(self, meta):
            super().__init__()
            self.fp8_meta = {"scaling_fwd": meta}

    delayed = types.SimpleNamespace(scale=torch.ones(3), amax_history=torch.zeros(4, 3))
    custom = types.SimpleNamespace(scale=None, amax_history=None)
    model = torch.nn.ModuleDict({"a": Module(delayed), "b": Module(custom)})
    state = TEBackend.state_dict(
        types.SimpleNamespace(
            _model=model, _fp8_metas=lambda: TEBackend._fp8_metas(types.SimpleNamespace(_model=model))
        )
    )
    assert set(state["a"]["scaling_fwd"]) == {"scale", "amax_history"} and state["b"] == {"scaling_fwd": {}}
