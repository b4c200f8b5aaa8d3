"""model=hf and harness.export for mixture-of-experts models: tiny random Qwen3-MoE, Qwen2-MoE
(gated shared expert, every second layer sparse) and Mixtral built and saved by transformers.

The logits are checked as test_hf_weights checks dense ones (lowp within 2x transformers' own bf16
error against its fp32 evaluation), on tokens whose routing is not a near-tie: top-k routing is
discontinuous, so where the k-th and (k+1)-th router logits are closer than bf16's rounding noise
the two models may send a token to different experts, and that token's logits then differ by far
more than rounding (both are right). The tokens are chosen by the fp32 model's routing margins,
before lowp runs; lowp's routing is then required to be transformers' on every token and layer."""

from __future__ import annotations

import json

import pytest
import torch

from harness.interop.export import export, fp8_dequantize, int4_dequantize, main
from harness.interop.hf_config import model_fields
from harness.interop.hf_weights import hf_to_lowp, load_into, lowp_to_hf, read_safetensors
from harness.numerics.blockwise import quantize_blockwise
from harness.numerics.formats import E4M3
from harness.numerics.int4 import fake_int4
from harness.validation.rules import ConfigError
from tests.helpers import compose_cfg
from tests.test_hf_weights import logits, lowp_model

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    initializer_range=0.08,
)
CASES = {  # config class, model class, MoE fields
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
        )
        | dict(decoder_sparse_step=2, norm_topk_prob=False),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}
T = 16
GROUP = 32


def hf_model(case: str, dtype=torch.bfloat16, **shape):
    """The tiny random model of `case` (SHAPE, with `shape`'s fields in place of its own)."""
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**(SHAPE | shape), **extra)
    return getattr(transformers, model_cls)(config).to(dtype).eval()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(case, per-expert checkpoint dir, transformers 5's fused-layout dir, the bf16 model)."""
    d = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    model.save_pretrained(d / "hf")  # the released layout: one tensor per expert and projection
    model.save_pretrained(d / "fused", save_original_format=False)
    return request.param, d, model


# ---- config ----------------------------------------------------------------------------------------


def test_moe_config_fields():
    def fields(case, **kw):
        cfg_cls, _, extra = CASES[case]
        raw = getattr(transformers, cfg_cls)(**{**SHAPE, **extra, **kw}).to_dict()
        return model_fields(raw, "x")

    q3 = fields("qwen3_moe")
    assert (q3["num_moe_experts"], q3["moe_router_topk"], q3["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert q3["ffn_hidden_size"] == 96 and q3["qk_layernorm"] and q3["moe_layer_freq"] == 1
    # norm_topk_prob: the top-k renormalised = the softmax over the k logits = Megatron's top-k first
    assert q3["moe_router_pre_softmax"] is False and q3["moe_aux_loss_coeff"] == 0.001
    assert q3["moe_shared_expert_intermediate_size"] is None and not q3["moe_shared_expert_gate"]
    assert fields("qwen3_moe", norm_topk_prob=False)["moe_router_pre_softmax"] is True
    # layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    four = fields("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2)["moe_layer_freq"]
    assert four == [0, 1, 0, 1]
    assert fields("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 2])["moe_layer_freq"] == [0, 1, 0, 1]
    q2 = fields("qwen2_moe", router_aux_loss_coef=0.01)
    assert (q2["moe_shared_expert_intermediate_size"], q2["moe_shared_expert_gate"]) == (64, True)
    assert q2["moe_layer_freq"] == [0, 1] and q2["moe_router_pre_softmax"] is True
    assert q2["add_qkv_bias"] and not q2["qk_layernorm"] and q2["moe_aux_loss_coeff"] == 0.01
    mx = fields("mixtral")
    assert (mx["num_moe_experts"], mx["moe_ffn_hidden_size"], mx["moe_router_pre_softmax"]) == (
        4,
        None,
        False,
    )
    assert mx["ffn_hidden_size"] == 96 and mx["moe_layer_freq"] == 1 and not mx["add_qkv_bias"]
    dense = model_fields(transformers.Qwen3Config(**SHAPE).to_dict(), "x")
    assert dense["num_moe_experts"] is None and dense["moe_layer_freq"] == 1


def test_moe_config_refusals():
    raw = transformers.Qwen3MoeConfig(**SHAPE).to_dict() | {"num_experts": 8, "num_local_experts": 4}
    with pytest.raises(ConfigError, match=r"^x: num_experts=8 but num_local_experts=4; give one$"):
        model_fields(raw, "x")
    ds = transformers.DeepseekV3Config(**SHAPE).to_dict()
    with pytest.raises(ConfigError, match=r"^x: kv_lora_rank \(DeepSeek's multi-head latent attention"):
        model_fields(ds, "x")


# ---- weights in ------------------------------------------------------------------------------------


def routed_tokens(model32, n: int = 2, drawn: int = 8) -> torch.Tensor:
    """n sequences of T tokens whose every routing decision has the widest margin in the fp32 model
    (the k-th minus the (k+1)-th router logit, the smallest over positions and layers), of `drawn`."""
    k = model32.config.num_experts_per_tok
    idx = torch.randint(0, SHAPE["vocab_size"], (drawn, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router = model32(idx, output_router_logits=True).router_logits
    margins = []
    for layer in router:
        top = layer.float().topk(k + 1, dim=-1).values
        margins.append((top[:, k - 1] - top[:, k]).view(drawn, T).amin(dim=1))
    best = torch.stack(margins).amin(dim=0).topk(n).indices
    return idx[best]


def routes(model32, backend, model, idx) -> None:
    """lowp sends every token of idx to the experts transformers' fp32 model sends it to."""
    maps = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: maps.append(out[1]))
        for name, m in model.named_modules()
        if name.endswith("mlp.router")
    ]
    logits(backend, model, idx)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        router = model32(idx, output_router_logits=True).router_logits
    k, (B, S) = model32.config.num_experts_per_tok, idx.shape
    assert len(maps) == len(router)
    for ours, theirs in zip(maps, router):
        want = torch.zeros_like(theirs, dtype=torch.bool).scatter(1, theirs.topk(k, dim=-1).indices, True)
        assert torch.equal(ours.view(S, B, -1).transpose(0, 1), want.view(B, S, -1))  # lowp: [s, b]


def check_logits(model_cls: str, state_dir, hf16, backend, model):
    """lowp's forward against transformers (fp32 over the same bf16 weights, and bf16)."""
    model32 = getattr(transformers, model_cls).from_pretrained(state_dir, dtype=torch.float32).eval()
    return logits_agree(model32, hf16, backend, model)


def logits_agree(model32, hf16, backend, model, drawn: int = 8):
    """lowp's forward against transformers' fp32 and bf16 models over the same weights: lowp's
    error against the fp32 model within 2x transformers' own bf16 error, on tokens routed alike
    (the 2 of `drawn` sequences with the widest routing margins)."""
    idx = routed_tokens(model32, drawn=drawn)
    routes(model32, backend, model, idx)
    with torch.no_grad():
        ref, hf = model32(idx).logits, hf16(idx).logits.float()
    lo = logits(backend, model, idx)
    e_hf = (hf - ref).abs().max().item()
    assert 0 < e_hf < 0.05 * ref.abs().max().item()
    assert (lo - ref).abs().max().item() <= 2 * e_hf, ((lo - ref).abs().max().item(), e_hf)
    assert (lo - hf).abs().max().item() <= 3 * e_hf
    return idx, ref, e_hf


def test_logits_match_transformers_and_both_expert_layouts_load(checkpoint):
    case, d, hf16 = checkpoint
    cfg, backend, model = lowp_model(d / "hf")
    files = read_safetensors(str(d / "hf"))
    assert any(".experts.3." in k for k in files)  # per expert in the file
    lowp_sd = hf_to_lowp(files, cfg.model)
    fused = hf_to_lowp(read_safetensors(str(d / "fused")), cfg.model)
    assert sorted(fused) == sorted(lowp_sd) and all(torch.equal(fused[k], lowp_sd[k]) for k in lowp_sd)
    # the file layout back, name for name and bit for bit
    back = lowp_to_hf(lowp_sd, cfg.model)
    assert sorted(back) == sorted(files) and all(torch.equal(back[k], files[k]) for k in files)
    load_into(model, lowp_sd)
    idx, ref, e_hf = check_logits(CASES[case][1], d / "hf", hf16, backend, model)

    # control: experts 0 and 1 of every sparse layer swapped (their router rows kept)
    for name, p in model.named_parameters():
        if name.endswith("experts.fc1.weight") or name.endswith("experts.fc2.weight"):
            with torch.no_grad():
                p[[0, 1]] = p[[1, 0]].clone()
    assert (logits(backend, model, idx) - ref).abs().max().item() > 5 * e_hf


# ---- export ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(checkpoint):
    """The checkpoint fine-tuned 3 steps in lowp (BF16): a run directory to export. Qwen2-MoE only:
    tests/test_hf_moe_pipeline.py trains Qwen3-MoE and Mixtral 50 steps under every quantized
    recipe and makes the same export checks on them."""
    from harness.train import run

    case, d, _ = checkpoint
    if case != "qwen2_moe":
        pytest.skip(f"{case}: its exports are checked after 50 quantized steps in test_hf_moe_pipeline.py")
    over = ["model=hf", f"model.hf_config={d / 'hf'}", f"init_from={d / 'hf'}", f"model.seq_length={T}"]
    over += ["backend=emulated", "logger=none", "steps=3", "log_interval=3", "eval_tokens=64"]
    over += ["micro_batch_size=2", "global_batch_size=2", "data=synthetic", "data.vocab_size=256"]
    summary = run(compose_cfg(*over, "optimizer.lr=1e-2"), d / "run")
    assert summary.status == "completed" and summary.steps == 3
    return case, d


def exported_model(case: str, out):
    """transformers' own loader of the export, the bf16 model it gives, and lowp over its tensors."""
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == CASES[case][1] and model.dtype == torch.bfloat16
    cfg, backend, lowp = lowp_model(out)
    return model, cfg, backend, lowp


def check_bf16_export(case: str, out, start: dict) -> dict:
    """The BF16 export `out` against the checkpoint training started from (`start`, its tensors):
    the same tensor names, all BF16, the experts trained, the family's architecture. Returns them."""
    sd = read_safetensors(str(out))
    assert sorted(sd) == sorted(start) and all(t.dtype == torch.bfloat16 for t in sd.values())
    expert = next(k for k in sd if ".experts.0." in k)
    assert not torch.equal(sd[expert], start[expert])  # the trained experts, not the initial ones
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == case and raw["architectures"] == [CASES[case][1]]
    return sd


def test_bf16_export_loads_in_transformers_with_lowps_logits(trained):
    case, d = trained
    assert main([str(d / "run"), "--format", "hf", "--out", str(d / "bf16")]) == 0
    sd = check_bf16_export(case, d / "bf16", read_safetensors(str(d / "hf")))
    hf16, cfg, backend, lowp = exported_model(case, d / "bf16")
    assert cfg.model.num_moe_experts == CASES[case][2].get("num_experts", 4)
    load_into(lowp, hf_to_lowp(sd, cfg.model))
    check_logits(CASES[case][1], d / "bf16", hf16, backend, lowp)


def _dequantized(d, fmt: str) -> tuple[dict, int]:
    """The export's tensors as BF16 weights through lowp's readers, and how many were quantized."""
    sd, out, n = read_safetensors(str(d)), {}, 0
    for name, t in sd.items():
        if name.endswith(("_scale_inv", "weight_scale", "weight_shape")):
            continue
        if fmt == "hf-fp8" and t.dtype == torch.float8_e4m3fn:
            out[name], n = fp8_dequantize(t, sd[name + "_scale_inv"]).to(torch.bfloat16), n + 1
        elif name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            out[base + ".weight"] = int4_dequantize(
                t, sd[base + ".weight_scale"], sd[base + ".weight_shape"], GROUP
            )
            n += 1
        else:
            out[name] = t
    return out, n


def check_quantized_export(case: str, out, bf16: dict, fmt: str, layers: int = 2) -> dict:
    """The quantized export `out` against the BF16 export's tensors `bf16`: each expert's matrices
    quantized on their own (FP8: 128x128 tiles, INT4: groups), routers, shared-expert gates,
    embeddings and norms BF16 as trained, those kept out of the quantization config. Returns the
    dequantized weights."""
    deq, n = _dequantized(out, fmt)
    assert sorted(deq) == sorted(bf16)
    for name, t in bf16.items():
        if ".experts." in name:
            want = (
                quantize_blockwise(t, E4M3, tile_2d=True, power_2=True).dequantize().to(torch.bfloat16)
                if fmt == "hf-fp8"
                else fake_int4(t, GROUP)
            )
            assert torch.equal(deq[name], want), name
        elif name.endswith(("gate.weight", "embed_tokens.weight", "norm.weight", "lm_head.weight")):
            assert torch.equal(deq[name], t), name  # routers, gates, embeddings, norms: BF16 as trained
    experts = len({k.split(".experts.")[1].split(".")[0] for k in bf16 if ".experts." in k})
    sparse = sum(any(f"layers.{i}." in k and ".experts." in k for k in bf16) for i in range(layers))
    shared = 3 if case == "qwen2_moe" else 0
    assert n == 4 * layers + (3 * experts + shared) * sparse + 3 * (layers - sparse)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    kept = qc.get("modules_to_not_convert") or qc.get("ignore")
    assert "lm_head" in kept and any("gate" in k for k in kept)
    return deq


def held_weights(model, cfg) -> dict:
    """What a transformers model holds, as lowp's state dict in bf16 (its tied head left out)."""
    held = {
        k: v.detach().to(torch.bfloat16)
        for k, v in model.state_dict().items()
        if k.endswith(("weight", "bias", "proj"))
    }
    if cfg.model.untie_embeddings_and_output_weights is False:
        held.pop("lm_head.weight", None)
    return hf_to_lowp(held, cfg.model)


def assert_holds(model, cfg, weights: dict) -> None:
    """The transformers `model` holds exactly `weights` (an export's tensors, dequantized), bit for bit."""
    got, want = held_weights(model, cfg), hf_to_lowp(weights, cfg.model)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def loaded(case: str, out, fmt: str, dtype=torch.float32):
    """transformers' own loader of an export: plain, FineGrainedFP8 (dequantized, as on a CPU), or
    compressed-tensors (decompressed at the first forward)."""
    extra = {}
    if fmt == "hf-fp8":
        pytest.importorskip("accelerate")  # transformers' FP8 quantizer refuses to load without it
        extra["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    elif fmt == "hf-int4":
        pytest.importorskip("compressed_tensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype, **extra).eval()
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert type(model).__name__ == CASES[case][1]
    return model


def config_only(out, dest):
    """`dest` with the export's config.json less its quantization_config: the architecture lowp reads."""
    raw = json.loads((out / "config.json").read_text())
    raw.pop("quantization_config", None)
    dest.mkdir(exist_ok=True)
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


@pytest.mark.parametrize("fmt", ["hf-fp8", "hf-int4"])
def test_quantized_exports_are_lowps_quantizers_per_expert(trained, fmt):
    """Each expert's matrices quantized on their own; transformers over the dequantized weights
    against lowp's forward over them. transformers' own loaders of these files are checked below:
    the weights they hold are these dequantized tensors bit for bit."""
    case, d = trained
    out = d / fmt
    export(str(d / "run"), fmt, str(out), group_size=GROUP)
    export(str(d / "run"), "hf", str(d / "ref"))
    deq = check_quantized_export(case, out, read_safetensors(str(d / "ref")), fmt)
    plain = config_only(out, d / (fmt + "_plain"))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in deq.items()}, str(plain / "model.safetensors"))
    hf16 = getattr(transformers, CASES[case][1]).from_pretrained(plain, dtype=torch.bfloat16).eval()
    cfg, backend, lowp = lowp_model(plain)
    load_into(lowp, hf_to_lowp(deq, cfg.model))
    check_logits(CASES[case][1], plain, hf16, backend, lowp)


def test_moe_routing_transformers_lacks_is_refused(tmp_path, capsys):
    import dataclasses

    cfg = compose_cfg("model=qwen3_moe_tiny", "model.moe_router_score_function=sigmoid")
    (tmp_path / "run.json").write_text(json.dumps({"config": {"model": dataclasses.asdict(cfg.model)}}))
    assert main([str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model.moe_router_score_function=sigmoid" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "hf").exists()


def test_fp8_export_loads_through_transformers_finegrained_fp8(trained):
    """transformers' FineGrainedFP8 loader (dequantize=True, as on a CPU) merges the per-expert
    codes and scales into its fused experts; every weight it holds is lowp's dequantized export."""
    case, d = trained
    out = d / "fp8n"
    export(str(d / "run"), "hf-fp8", str(out))
    cfg, _, _ = lowp_model(d / "hf")
    assert_holds(loaded(case, out, "hf-fp8"), cfg, _dequantized(out, "hf-fp8")[0])


def test_int4_export_loads_through_transformers_compressed_tensors(trained):
    """compressed-tensors' pack-quantized reader through transformers: every weight the loaded model
    holds (experts fused by transformers 5, the rest as linears, decompressed at the first forward)
    is lowp's dequantized export, bf16(code * scale) from fp32 scales."""
    case, d = trained
    out = d / "int4n"
    export(str(d / "run"), "hf-int4", str(out), group_size=GROUP)
    cfg, _, _ = lowp_model(d / "hf")
    assert_holds(loaded(case, out, "hf-int4"), cfg, _dequantized(out, "hf-int4")[0])


def test_int4_export_refuses_a_group_that_splits_a_width(trained, capsys):
    """Qwen2-MoE's dense first layer has 96 inputs to down_proj: a group of 64 leaves a partial
    group, which compressed-tensors' loader cannot decompress; refused before anything is written,
    with the group that fits every quantized width."""
    _, d = trained
    out = d / "int4_g64"
    assert main([str(d / "run"), "--format", "hf-int4", "--group-size", "64", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --format=hf-int4 with group size 64 (--group-size): ") and err.count("\n") == 1
    )
    assert "has 96 inputs, not a multiple of 64" in err and "use --group-size=32" in err, err
    assert not out.exists()
