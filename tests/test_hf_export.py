"""HF -> lowp (trained under tensorwise / nvfp4, emulated) -> HF (bf16, fp8, int4) -> transformers.

The BF16 export is checked against lowp's own logits with test_hf_weights' tolerance (lowp within
2x transformers' own bf16 error against its fp32 evaluation). The FP8 and INT4 exports are checked
bit for bit: their dequantized weights equal lowp's blockwise quantizer's / INT4 fake-quant's
output; then transformers over those dequantized weights is checked against lowp's BF16 forward over
the same weights (the reference the issue names), with the same tolerance."""

from __future__ import annotations

import json

import pytest
import torch

from harness.interop.export import export, fp8_dequantize, int4_dequantize, main, unpack_int4
from harness.interop.hf_weights import hf_to_lowp, load_into, read_safetensors
from harness.numerics.blockwise import quantize_blockwise
from harness.numerics.formats import E4M3
from harness.numerics.int4 import fake_int4, quantize_int4
from tests.test_hf_weights import CASES, SHAPE, T, logits, lowp_model, save_hf

transformers = pytest.importorskip("transformers")

TRAINED = {"llama": "tensorwise", "qwen3": "nvfp4"}
STEPS = 50
GROUP = 32


@pytest.fixture(scope="module", params=list(TRAINED))
def trained(request, tmp_path_factory):
    """A random HF model, fine-tuned STEPS steps in lowp under a quantized recipe."""
    from harness.train import run
    from tests.helpers import compose_cfg

    case, d = request.param, tmp_path_factory.mktemp(request.param)
    save_hf(d / "hf", case)
    over = ["model=hf", f"model.hf_config={d / 'hf'}", f"init_from={d / 'hf'}", f"model.seq_length={T}"]
    over += [
        f"recipe={TRAINED[case]}",
        "backend=emulated",
        "logger=none",
        f"steps={STEPS}",
        "log_interval=25",
    ]
    over += ["eval_tokens=256", "micro_batch_size=2", "global_batch_size=2", "data=synthetic"]
    over += ["data.vocab_size=256", "optimizer.lr=1e-3"]
    summary = run(compose_cfg(*over), d / "run")
    assert summary.status == "completed" and summary.steps == STEPS
    return case, d


def tokens():
    return torch.randint(0, SHAPE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(3))


def check_logits(case: str, hf_dir, state_hf: dict):
    """transformers (bf16 and fp32) over `state_hf` vs lowp's BF16 forward over the same tensors."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    config.quantization_config = None
    model_cls = getattr(transformers, CASES[case][1])
    idx = tokens()
    with torch.no_grad():
        outs = []
        for dtype in (torch.bfloat16, torch.float32):
            m = model_cls(config).to(dtype).eval()
            missing, unexpected = m.load_state_dict(
                {k: v.to(dtype) for k, v in state_hf.items()}, strict=False
            )
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
            if not config.tie_word_embeddings:
                assert "lm_head.weight" not in missing
            outs.append(m(idx).logits.float())
    hf16, ref = outs
    cfg, backend, model = lowp_model(hf_dir if not config_has_quant(hf_dir) else write_plain(hf_dir))
    load_into(model, hf_to_lowp(state_hf, cfg.model))
    lo = logits(backend, model, idx)
    e_hf = (hf16 - ref).abs().max().item()
    assert (lo - ref).abs().max().item() <= 2 * e_hf and (lo - hf16).abs().max().item() <= 3 * e_hf


def config_has_quant(d) -> bool:
    return "quantization_config" in json.loads((d / "config.json").read_text())


def write_plain(d):
    """The exported config without its quantization_config: what model=hf reads for the BF16 forward."""
    raw = json.loads((d / "config.json").read_text())
    raw.pop("quantization_config")
    plain = d.parent / (d.name + "_plain")
    plain.mkdir(exist_ok=True)
    (plain / "config.json").write_text(json.dumps(raw))
    return plain


def test_bf16_export_loads_in_transformers_with_lowps_logits(trained):
    case, d = trained
    assert main([str(d / "run"), "--format", "hf", "--out", str(d / "bf16")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(d / "bf16")  # loads as a released model would
    assert type(model).__name__ == CASES[case][1] and model.dtype == torch.bfloat16
    sd = read_safetensors(str(d / "bf16"))
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    # it is the trained model, not the one it started from
    start = read_safetensors(str(d / "hf"))
    assert not torch.equal(
        sd["model.layers.0.self_attn.q_proj.weight"], start["model.layers.0.self_attn.q_proj.weight"]
    )
    check_logits(case, d / "bf16", sd)
    idx = tokens()
    with torch.no_grad():
        direct = model(idx).logits.float()
    cfg, backend, lowp = lowp_model(d / "bf16", f"init_from={d / 'bf16'}")  # and back into lowp: exact
    load_into(lowp, hf_to_lowp(sd, cfg.model))
    again = {k: v.to(torch.bfloat16) for k, v in lowp.state_dict().items()}
    from harness.interop.hf_weights import lowp_to_hf

    assert all(torch.equal(lowp_to_hf(again, cfg.model)[k], sd[k]) for k in sd)
    assert direct.shape == (2, T, SHAPE["vocab_size"])


def test_fp8_export_is_lowps_blockwise_quantizer_bit_for_bit(trained):
    case, d = trained
    export(str(d / "run"), "hf-fp8", str(d / "fp8"))
    bf16 = export(str(d / "run"), "hf", str(d / "ref")) and read_safetensors(str(d / "ref"))
    sd = read_safetensors(str(d / "fp8"))
    qc = json.loads((d / "fp8" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3"
    deq, n = {}, 0
    for name, t in bf16.items():
        if name + "_scale_inv" not in sd and not name.endswith("_proj.weight"):
            assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], t)  # embeddings, norms, head
            deq[name] = t
            continue
        codes, sinv = sd[name], sd[name[: -len(".weight")] + ".weight_scale_inv"]
        assert codes.dtype == torch.float8_e4m3fn and sinv.dtype == torch.float32
        assert sinv.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        want = quantize_blockwise(t, E4M3, tile_2d=True, power_2=True).dequantize()
        got = fp8_dequantize(codes, sinv)
        assert torch.equal(got, want), name  # bit for bit
        assert (got - t.float()).abs().max() > 0  # it really is quantized
        deq[name], n = got.to(torch.bfloat16), n + 1
    assert n == 7 * SHAPE["num_hidden_layers"]
    check_logits(case, d / "fp8", deq)


def test_int4_export_is_lowps_fake_quant_bit_for_bit(trained):
    case, d = trained
    assert (
        main([str(d / "run"), "--format", "hf-int4", "--out", str(d / "int4"), "--group-size", str(GROUP)])
        == 0
    )
    export(str(d / "run"), "hf", str(d / "ref"))
    bf16, sd = read_safetensors(str(d / "ref")), read_safetensors(str(d / "int4"))
    qc = json.loads((d / "int4" / "config.json").read_text())["quantization_config"]
    assert (
        qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == GROUP
    )
    deq, n = {}, 0
    for name, t in bf16.items():
        base = name[: -len(".weight")]
        if base + ".weight_packed" not in sd:
            assert torch.equal(sd[name], t)
            deq[name] = t
            continue
        packed, scale, shape = (
            sd[base + ".weight_packed"],
            sd[base + ".weight_scale"],
            sd[base + ".weight_shape"],
        )
        assert packed.dtype == torch.int32 and packed.shape == (t.shape[0], t.shape[1] // 8)
        assert scale.shape == (t.shape[0], t.shape[1] // GROUP) and shape.tolist() == list(t.shape)
        assert torch.equal(unpack_int4(packed, t.shape[1]), quantize_int4(t, GROUP).data)
        got = int4_dequantize(packed, scale, shape, GROUP)
        assert torch.equal(got, fake_int4(t, GROUP)), name  # bit for bit
        deq[name], n = got, n + 1
    assert n == 7 * SHAPE["num_hidden_layers"]
    check_logits(case, d / "int4", deq)


def test_errors(tmp_path, trained):
    _, d = trained
    assert main([str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert main([str(d / "run"), "--format", "gguf", "--out", str(tmp_path / "o")]) == 2


# ---- transformers' own loaders of the quantized exports -------------------------------------------


def native_check(case: str, d, fmt: str, deq: dict, load) -> None:
    """`load(dtype)` is transformers' loader of the export at `d`; its dequantized linears must be
    `deq` (lowp's quantizer output, BF16) bit for bit, and its logits lowp's BF16 forward over `deq`
    with check_logits' tolerance (e_hf: the loaded model's bf16 logits against its fp32 ones)."""
    m32, n = load(torch.float32), 0
    with torch.no_grad():  # fp32 loads keep the scales exact; the reader's product rounded to bf16
        for name, p in m32.named_parameters():
            if name.endswith("_proj.weight"):
                assert torch.equal(p.bfloat16(), deq[name]), name
                n += 1
            p.copy_(p.bfloat16().float())
    assert n == 7 * SHAPE["num_hidden_layers"]  # every quantized linear came through the loader
    m16 = load(torch.bfloat16)
    if fmt == "hf-fp8":  # E4M3 codes times power-of-two scales: bf16 values, so bf16 loads are exact too
        assert all(torch.equal(p, deq[n]) for n, p in m16.named_parameters() if n.endswith("_proj.weight"))
    else:  # compressed-tensors gives the scales the model's dtype: the bf16 model is m32 rounded
        m16 = m32.to(torch.bfloat16)
        m32 = load(torch.float32)
        with torch.no_grad():
            for p in m32.parameters():
                p.copy_(p.bfloat16().float())
    idx = tokens()
    with torch.no_grad():
        hf16, ref = m16(idx).logits.float(), m32(idx).logits.float()
    cfg, backend, model = lowp_model(write_plain(d))
    load_into(model, hf_to_lowp(deq, cfg.model))
    lo = logits(backend, model, idx)
    e_hf = (hf16 - ref).abs().max().item()
    assert 0 < e_hf and (lo - ref).abs().max().item() <= 2 * e_hf, ((lo - ref).abs().max().item(), e_hf)
    assert (lo - hf16).abs().max().item() <= 3 * e_hf


def dequantized_reference(d, fmt: str) -> dict:
    """The export's tensors as BF16 weights, through lowp's own reader (checked bit for bit above)."""
    sd, out = read_safetensors(str(d)), {}
    for name, t in sd.items():
        if name.endswith(("_scale_inv", "weight_scale", "weight_shape")):
            continue
        if fmt == "hf-fp8" and t.dtype == torch.float8_e4m3fn:
            out[name] = fp8_dequantize(t, sd[name + "_scale_inv"]).to(torch.bfloat16)
        elif name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            w = int4_dequantize(t, sd[base + ".weight_scale"], sd[base + ".weight_shape"], GROUP)
            out[base + ".weight"] = w
        else:
            out[name] = t
    return out


def test_fp8_export_loads_through_transformers_finegrained_fp8(trained):
    """FineGrainedFP8 on a CPU: no FP8 GEMMs there, so transformers dequantizes at load
    (dequantize=True, what it also falls back to without a GPU), with its own reader."""
    pytest.importorskip("accelerate")  # transformers' FP8 quantizer refuses to load without it
    case, d = trained
    export(str(d / "run"), "hf-fp8", str(d / "fp8n"))
    config = transformers.FineGrainedFP8Config(dequantize=True)

    def load(dtype):
        m = transformers.AutoModelForCausalLM.from_pretrained(
            d / "fp8n", dtype=dtype, quantization_config=config
        )
        assert type(m).__name__ == CASES[case][1]
        return m.eval()

    native_check(case, d / "fp8n", "hf-fp8", dequantized_reference(d / "fp8n", "hf-fp8"), load)


def test_int4_export_loads_through_transformers_compressed_tensors(trained):
    """compressed-tensors' pack-quantized reader (transformers' CompressedTensors integration, as
    stored: the linears decompress at the first forward), on a CPU."""
    pytest.importorskip("compressed_tensors")
    case, d = trained
    export(str(d / "run"), "hf-int4", str(d / "int4n"), group_size=GROUP)

    def load(dtype):
        m = transformers.AutoModelForCausalLM.from_pretrained(d / "int4n", dtype=dtype).eval()
        q = m.model.layers[0].self_attn.q_proj
        assert "weight_packed" in dict(q.named_parameters()) or "weight_packed" in dict(q.named_buffers())
        with torch.no_grad():  # compressed-tensors decompresses on the first forward
            m(tokens()[:, :4])
        assert type(m).__name__ == CASES[case][1]
        return m

    native_check(case, d / "int4n", "hf-int4", dequantized_reference(d / "int4n", "hf-int4"), load)
