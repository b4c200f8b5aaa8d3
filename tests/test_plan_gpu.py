"""Counterfactual telemetry and the precision plan on the TE backend (CUDA and TE; skipped elsewhere):
TE's operands quantized by lowp's emulator under each candidate, in quantized and BF16 blocks and in
MoE expert groups, with training unchanged; the plan's Megatron file through Megatron's TE-side
payload parser (a Megatron-LM tree named by LOWP_MEGATRON); the TE CustomRecipe factory in a TE
autocast.

    LOWP_MEGATRON=/path/to/Megatron-LM python -m pytest -q -m gpu tests/test_plan_gpu.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from harness.interop.megatron_precision import precision_config
from harness.model.plan import PLAN_FORMAT
from harness.train import run
from tests.helpers import GPU_TINY, compose_cfg, needs_cuda, needs_te

pytestmark = [pytest.mark.gpu, needs_cuda, needs_te]

CANDIDATES = "telemetry.candidates=[blockwise,mxfp8,nvfp4]"
LINEARS = [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _unchanged_with_rows_for(base: list[str], modules: list[str], tmp_path: Path) -> None:
    """`base` trains to the same loss curve with and without the candidates, and the candidate run has
    a row per module, role (operands and GEMMs) and candidate, each GEMM's error below 50%."""
    curves = {}
    for tag, extra in (("plain", []), ("cf", [CANDIDATES])):
        assert run(compose_cfg(*base, *extra), tmp_path / tag).status == "completed"
        curves[tag] = [r["loss/train"] for r in _jsonl(tmp_path / tag / "metrics.jsonl") if "loss/train" in r]
    assert curves["plain"] == curves["cf"]
    rows = [r for r in _jsonl(tmp_path / "cf" / "numerics.jsonl") if "candidate" in r]
    got = {(r["layer"], r["tensor"], r["candidate"]) for r in rows}
    for module in modules:
        for c in ("blockwise", "mxfp8", "nvfp4"):
            for t in ("input", "weight", "grad", "fprop", "dgrad", "wgrad"):
                assert (module, t, c) in got, (module, t, c)
    assert all(0 <= r["rel_err"] < 0.5 for r in rows if "rel_err" in r)


@pytest.mark.parametrize("recipe", ["tensorwise", "bf16"])
def test_te_counterfactual_rows_leave_training_unchanged(recipe, tmp_path):
    base = [*GPU_TINY, "backend=te", f"recipe={recipe}", "steps=2", "log_interval=1", "eval_interval=0",
            "checkpoint_interval=0", "telemetry_interval=1"]  # fmt: skip
    # BF16 blocks (recipe=bf16) too: the fused-away operands recomputed
    _unchanged_with_rows_for(base, LINEARS, tmp_path)


@pytest.mark.parametrize("recipe", ["tensorwise", "bf16"])
def test_te_expert_groups_feed_the_candidates(recipe, tmp_path):
    """lowp's TE MoE blocks (te.GroupedLinear experts) hand each expert's operands to the candidates:
    one row per group, role and candidate; training unchanged."""
    base = ["model=mixtral_tiny", "hardware=auto", "logger=none", "data=markov", "micro_batch_size=8",
            "global_batch_size=8", "eval_interval=0", "checkpoint_interval=-1", "backend=te",
            f"recipe={recipe}", "steps=2", "log_interval=1", "telemetry_interval=1"]  # fmt: skip
    _unchanged_with_rows_for(
        base, [f"blocks.{i}.mlp.experts.fc{k}" for i in range(2) for k in (1, 2)], tmp_path
    )


def _plan_file(tmp_path: Path, modules: dict[str, str]) -> Path:
    path = tmp_path / "plan.yaml"
    plan = {"format": PLAN_FORMAT, "goal": "test", "inputs": {}, "modules": modules,
            "overrides": [{"pattern": m, "recipe": r} for m, r in modules.items()]}  # fmt: skip
    path.write_text(yaml.safe_dump(plan))
    return path


def test_megatron_te_side_parser_accepts_every_payload():
    """Megatron's TEQuantizationParams.parse_from_config and the TE recipe it builds for each module
    (transformer_engine.py:224-300) accept every payload lowp writes, custom (TE's zoo) included."""
    tree = Path(os.environ.get("LOWP_MEGATRON", "/nonexistent"))
    if not (tree / "megatron/core/extensions/transformer_engine.py").exists():
        pytest.skip("LOWP_MEGATRON: no Megatron-LM tree")
    import dataclasses
    import sys

    from harness import recipes

    sys.path.insert(0, str(tree))
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.quantization.quant_config import QuantizationConfig, RecipeConfig

    zoo = dataclasses.replace(
        recipes.default_fields("custom"), quantizer_factory="mxfp8_fwd_nvfp4_bwd_factory"
    )
    d = recipes.default_fields
    modules = {"blocks.0.attn.qkv": d("tensorwise"), "blocks.0.attn.proj": None,
               "blocks.0.mlp.fc1": d("blockwise"), "blocks.0.mlp.fc2": zoo, "blocks.1.attn.qkv": d("mxfp8"),
               "blocks.1.mlp.fc1": d("nvfp4")}  # fmt: skip
    recipe = RecipeConfig.from_config_dict(precision_config(modules))
    for key, cfg in recipe.configs.items():
        params = mte.TEQuantizationParams.parse_from_config(QuantizationConfig(cfg, None, key))
        with mte._get_fp8_model_init_for_quant_recipe(params.training_recipe):  # builds TE's recipe
            pass


def test_te_plan_qfactory_gives_each_named_linear_its_recipe(tmp_path):
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import CustomRecipe

    from harness.interop.te_plan import plan_qfactory

    path = _plan_file(tmp_path, {"blocks.0.attn.qkv": "tensorwise", "blocks.0.mlp.fc1": "blockwise",
                                 "blocks.0.mlp.fc2": "bf16"})  # fmt: skip
    names = ["blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"]
    layers = [te.Linear(128, 128, params_dtype=torch.bfloat16, name=n) for n in names]
    x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=CustomRecipe(qfactory=plan_qfactory(str(path)))):
        y = x
        for layer in layers:
            y = layer(y)
    y.float().sum().backward()
    kinds = [type(layer.quantizers["scaling_fwd"][0]).__name__ for layer in layers]
    assert kinds == ["Float8CurrentScalingQuantizer", "Float8BlockQuantizer", "IdentityQuantizer"], kinds


def test_a_plan_that_splits_a_block_runs_on_te_with_each_gemm_in_its_recipe(tmp_path):
    """A plan moving some of a block's linears to BF16 (the 8B-slice plan's shape) runs on lowp's TE
    blocks: the block's CustomRecipe gives each GEMM's slots its module's factory, by TE's role name."""
    path = _plan_file(tmp_path, {"blocks.0.attn.qkv": "tensorwise", "blocks.0.attn.proj": "bf16",
                                 "blocks.0.mlp.fc1": "tensorwise", "blocks.0.mlp.fc2": "bf16"})  # fmt: skip
    base = [*GPU_TINY, "backend=te", "recipe=tensorwise", "steps=2", "log_interval=1", "eval_interval=0",
            "checkpoint_interval=0", "stability=plan", f"stability.plan_file={path}"]  # fmt: skip
    from harness.train import Trainer
    from harness.validation.load import compose_config, prepare

    trainer = Trainer(prepare(compose_config(base)), tmp_path / "run")
    trainer.train_step(0)  # builds TE's quantizers in the block's autocast
    attn, mlp = trainer.model.blocks[0].layer.self_attention, trainer.model.blocks[0].layer.layernorm_mlp
    kind = lambda mod, slot: type(mod.quantizers["scaling_fwd"][slot]).__name__  # noqa: E731
    fp8, high = "Float8CurrentScalingQuantizer", "IdentityQuantizer"
    # forward slots: a linear's input 0 and weight 1; LayerNormMLP's fc1 input 0, weight 1, fc2 input 3,
    # weight 4 (TE 2.20.2 LayerNormMLP.get_quantizer_roles); outputs are boundary slots (high precision)
    assert [kind(attn.layernorm_qkv, s) for s in (0, 1)] == [fp8, fp8]
    assert [kind(attn.proj, s) for s in (0, 1)] == [high, high]
    assert [kind(mlp, s) for s in (0, 1, 3, 4)] == [fp8, fp8, high, high]
    assert run(compose_cfg(*base), tmp_path / "full").status == "completed"
    modules = json.loads((tmp_path / "full" / "run.json").read_text())["provenance"]["quantized_modules"]
    assert {k: v for k, v in modules.items() if k.startswith("blocks.0.")} == {
        "blocks.0.attn.qkv": "tensorwise", "blocks.0.attn.proj": "bf16",
        "blocks.0.mlp.fc1": "tensorwise", "blocks.0.mlp.fc2": "bf16",
    }  # fmt: skip
