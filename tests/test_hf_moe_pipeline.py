"""Hugging Face -> lowp -> Hugging Face for MoE models under every quantized recipe: a tiny random
Qwen3-MoE and Mixtral from transformers are trained 50 steps in lowp from their weights (tensorwise,
blockwise, MXFP8, NVFP4 emulated, INT4 QAT on the routed experts), exported as BF16 and as the
recipe's own format (FP8 128x128 blocks for the FP8 recipes, compressed-tensors INT4 for INT4 QAT),
and loaded by transformers' own loaders; transformers' logits over what it loaded match lowp's
forward over the same dequantized weights (tests/test_hf_moe.py's check: routing alike, lowp
within 2x transformers' own bf16 error)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.interop.export import export
from harness.interop.hf_weights import hf_to_lowp, load_into, read_safetensors
from harness.train import run
from tests.helpers import compose_cfg
from tests.test_hf_moe import (
    GROUP,
    T,
    assert_holds,
    check_bf16_export,
    check_quantized_export,
    config_only,
    hf_model,
    loaded,
    logits_agree,
)
from tests.test_hf_weights import lowp_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' FineGrainedFP8 loader
pytest.importorskip("compressed_tensors")

STEPS = 50
LAYERS = 1  # one MoE layer: 10 runs of 50 steps stay within the CI budget
RECIPES = {  # lowp recipe -> its overrides and the quantized export that matches it (None: BF16 only)
    "tensorwise": ([], "hf-fp8"),
    "blockwise": ([], "hf-fp8"),
    "mxfp8": ([], "hf-fp8"),
    "nvfp4": ([], None),
    "int4_qat": (["recipe.int4_scope=routed_experts", f"recipe.int4_group_size={GROUP}"], "hf-int4"),
}


def train(case: str, recipe: str, d):
    """The transformers checkpoint trained STEPS steps in lowp under `recipe`; its run directory."""
    hf_model(case, num_hidden_layers=LAYERS).save_pretrained(d / "hf")
    over = ["model=hf", f"model.hf_config={d / 'hf'}", f"init_from={d / 'hf'}", f"model.seq_length={T}"]
    over += ["backend=emulated", "logger=none", f"steps={STEPS}", "log_interval=1", "eval_interval=0"]
    over += ["eval_tokens=32", "micro_batch_size=2", "global_batch_size=2", "data=synthetic"]
    over += [
        "data.vocab_size=256",
        f"checkpoint_interval={STEPS}",
        "optimizer.lr=1e-3",
        "optimizer.warmup_steps=5",
    ]
    summary = run(compose_cfg(*over, f"recipe={recipe}", *RECIPES[recipe][0]), d / "run")
    assert summary.status == "completed" and summary.steps == STEPS, summary
    rows = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss/train"] for r in rows if "loss/train" in r]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    return d / "run"


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_hf_to_lowp_to_hf_under_each_recipe(case, recipe, tmp_path):
    run_dir = train(case, recipe, tmp_path)
    export(str(run_dir), "hf", str(tmp_path / "bf16"))
    bf16 = check_bf16_export(case, tmp_path / "bf16", read_safetensors(str(tmp_path / "hf")))
    exports = {"hf": (tmp_path / "bf16", bf16)}
    if (fmt := RECIPES[recipe][1]) is not None:
        export(str(run_dir), fmt, str(tmp_path / fmt), group_size=GROUP)
        exports[fmt] = (tmp_path / fmt, check_quantized_export(case, tmp_path / fmt, bf16, fmt, LAYERS))
    for fmt, (out, weights) in exports.items():
        cfg, backend, lowp = lowp_model(config_only(out, tmp_path / f"{fmt}_config"))
        load_into(lowp, hf_to_lowp(weights, cfg.model))
        model32, hf16 = loaded(case, out, fmt, torch.float32), loaded(case, out, fmt, torch.bfloat16)
        assert_holds(model32, cfg, weights)  # what transformers loaded is lowp's export
        logits_agree(model32, hf16, backend, lowp, drawn=16)
