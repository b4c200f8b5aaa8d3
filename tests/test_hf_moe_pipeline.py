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
from tests.test_hf_moe import CASES, GROUP, T, check_quantized_export, held_weights, hf_model, logits_agree
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


def loaded(case: str, out, fmt: str, dtype):
    """transformers' own loader of an export: plain, FineGrainedFP8 (dequantized, as on a CPU), or
    compressed-tensors (decompressed at the first forward)."""
    extra = (
        {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)} if fmt == "hf-fp8" else {}
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype, **extra).eval()
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert type(model).__name__ == CASES[case][1]
    return model


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_hf_to_lowp_to_hf_under_each_recipe(case, recipe, tmp_path):
    run_dir = train(case, recipe, tmp_path)
    start = read_safetensors(str(tmp_path / "hf"))
    export(str(run_dir), "hf", str(tmp_path / "bf16"))
    bf16 = read_safetensors(str(tmp_path / "bf16"))
    assert sorted(bf16) == sorted(start) and all(t.dtype == torch.bfloat16 for t in bf16.values())
    expert = next(k for k in bf16 if ".experts.0." in k)
    assert not torch.equal(bf16[expert], start[expert])  # the trained experts, not the initial ones
    raw = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert raw["model_type"] == case and raw["architectures"] == [CASES[case][1]]
    exports = {"hf": (tmp_path / "bf16", bf16)}
    if (fmt := RECIPES[recipe][1]) is not None:
        export(str(run_dir), fmt, str(tmp_path / fmt), group_size=GROUP)
        exports[fmt] = (tmp_path / fmt, check_quantized_export(case, tmp_path / fmt, bf16, fmt, LAYERS))
    for fmt, (out, weights) in exports.items():
        plain = tmp_path / f"{fmt}_config"  # lowp reads the architecture, without the quantization
        plain.mkdir()
        raw = json.loads((out / "config.json").read_text())
        raw.pop("quantization_config", None)
        (plain / "config.json").write_text(json.dumps(raw))
        cfg, backend, lowp = lowp_model(plain)
        load_into(lowp, hf_to_lowp(weights, cfg.model))
        model32, hf16 = loaded(case, out, fmt, torch.float32), loaded(case, out, fmt, torch.bfloat16)
        got, want = held_weights(model32, cfg), hf_to_lowp(weights, cfg.model)
        assert sorted(got) == sorted(want)
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], fmt  # what it loaded is lowp's
        logits_agree(model32, hf16, backend, lowp, drawn=16)
