"""A masked-diffusion model from a Llama checkpoint (the AR-to-DLM recipe: init_from) trains in lowp,
exports as LlamaForCausalLM with lowp_objective and mask_token_id in config.json, and transformers
under an all-ones 4D attention mask gives lowp's logits at the masked positions (test_hf_weights'
tolerance: lowp within 2x transformers' own bf16 error against its fp32 evaluation)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.interop.export import main
from harness.interop.hf_weights import hf_to_lowp, load_into, read_safetensors
from harness.model.objective import set_causal
from tests.test_hf_weights import SHAPE, T, logits, lowp_model, save_hf

transformers = pytest.importorskip("transformers")
MASK = 256  # the first id past the data's 256: objective.mask_token=null resolves to it


def test_masked_diffusion_from_llama_exports_and_matches_transformers_bidirectionally(tmp_path):
    from harness.train import run
    from tests.helpers import compose_cfg

    save_hf(tmp_path / "hf", "llama")
    over = ["model=hf", f"model.hf_config={tmp_path / 'hf'}", f"init_from={tmp_path / 'hf'}"]
    over += [f"model.seq_length={T}", "objective=masked_diffusion", "backend=emulated", "logger=none"]
    over += ["steps=3", "eval_tokens=128", "micro_batch_size=2", "global_batch_size=2", "data=synthetic"]
    over += ["data.vocab_size=256", "optimizer.lr=1e-3", "checkpoint_interval=0"]
    summary = run(compose_cfg(*over), tmp_path / "run")
    assert summary.status == "completed" and summary.final_eval_loss is not None
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (last,) = [r for r in rows if "loss/eval" in r]
    per_t = [last[f"loss/eval_at_t/{t}"] for t in ("0.1", "0.3", "0.5", "0.7", "0.9")]
    assert last["loss/eval"] == pytest.approx(sum(per_t) / 5)  # the bound: their mean

    assert main([str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert (raw["lowp_objective"], raw["mask_token_id"]) == ("masked_diffusion", MASK)

    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 256, (2, T), generator=gen)
    masked = torch.rand((2, T), generator=gen) < 0.5
    idx = torch.where(masked, MASK, idx)
    full = torch.ones(2, 1, T, T, dtype=torch.bool)  # every position attends to every other
    with torch.no_grad():
        outs = []
        for dtype in (torch.bfloat16, torch.float32):
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path / "out", dtype=dtype, attn_implementation="sdpa"
            ).eval()
            outs.append(hf(idx, attention_mask=full).logits.float())
        causal = hf(idx).logits.float()
    hf16, ref = outs
    cfg, backend, lowp = lowp_model(tmp_path / "out")
    load_into(lowp, hf_to_lowp(read_safetensors(str(tmp_path / "out")), cfg.model))
    set_causal(lowp, False)
    lo = logits(backend, lowp, idx)
    e_hf = (hf16 - ref)[masked].abs().max().item()
    assert (lo - ref)[masked].abs().max().item() <= 2 * e_hf
    assert (causal - ref)[masked].abs().max().item() > 10 * e_hf  # the mask matters: causal differs
    assert lo.shape == (2, T, SHAPE["vocab_size"])
