"""A run's weights as a Hugging Face checkpoint: BF16, FP8 block-scaled, or INT4 group-wise.

    python -m harness.export RUN_DIR --format hf|hf-fp8|hf-int4 --out DIR

The model config comes from RUN_DIR/run.json, the weights from its checkpoint (either backend's
parameter names). The architecture must be one transformers has: RMSNorm + SwiGLU + RoPE, written
as `LlamaForCausalLM`, `Qwen2ForCausalLM` (QKV-only bias) or `Qwen3ForCausalLM` (QK norm); a
mixture of experts as `Qwen3MoeForCausalLM` (QK norm), `Qwen2MoeForCausalLM` (a gated shared
expert) or `MixtralForCausalLM` (neither), experts per expert as released checkpoints hold them
(harness.interop.hf_weights). Routing transformers does not compute (sigmoid scores, an expert
bias, a top-k scaling factor, token dropping) is refused.

- `hf`: every tensor in BF16 (lowp's fp32 masters rounded, as TE's bf16 weights hold them).
- `hf-fp8`: each block linear's weight as E4M3 codes plus a float32 `weight_scale_inv` per 128x128
  tile (dequantized = code * scale_inv), with `quantization_config` {quant_method: fp8,
  weight_block_size: [128, 128]}: the layout of DeepSeek-V3 and Qwen3-FP8 releases. The codes and
  scales are lowp's blockwise quantizer's (harness.numerics.blockwise, 128x128 tiles, the recipe's
  power-of-two scales) applied to each HF weight matrix in BF16, so the dequantized weights equal
  that quantizer's output bit for bit.
- `hf-int4`: compressed-tensors' `pack-quantized` format: `weight_packed` (int32, eight 4-bit
  values offset by 8 per word, first value in the low bits), `weight_scale` (float32, one per group
  of `group_size` inputs) and `weight_shape`; symmetric, no zero point. Codes and scales are lowp's
  INT4 fake-quant (harness.numerics.int4, values in [-7, 7]); float32 scales keep the dequantized
  bf16(q * s) equal to lowp's W_hat bit for bit.
Embeddings, norms, the LM head, the MoE router and Qwen2-MoE's shared-expert gate stay BF16 in every
format (as in miles' converters); each routed expert's matrices are quantized on their own, like
any linear (FP8: 128x128 tiles of that expert's matrix; INT4: groups along its rows).

A masked-diffusion model (objective=masked_diffusion, docs/diffusion.md) exports as its base
architecture with `lowp_objective: masked_diffusion` and `mask_token_id` in config.json: the same
weights and layers, to be run with an all-ones attention mask (no causal mask) and the mask token in
the positions to predict, each predicted at its own position (no next-token shift).

Beside the weights, what a server needs to generate (a servable directory, not only a loadable one):
- from the config the run was imported from (`model=hf model.hf_config=DIR`), when it is still
  there: `bos/eos/pad_token_id`, `max_position_embeddings` (not the training sequence length) and
  the architecture (`model_type: mistral` is written back as `MistralForCausalLM`, not as Llama),
  and its `generation_config.json` (sampling defaults) as it was;
- the tokenizer the run's data names (`data.tokenizer`, the `prepare` manifest's, stdlib_text's
  BPE), as `tokenizer.json` + `tokenizer_config.json` (transformers' PreTrainedTokenizerFast, or
  the source model directory's own tokenizer files; a `.tiktoken` file converted by transformers'
  TikTokenConverter, a sentencepiece `.model` by its SpmConverter, the same ids); its end-of-text
  token is the eos id when the imported config names none;
- `generation_config.json` with those ids when the source had none.
INT4 group sizes other than -1 (per channel), 32, 64 and 128 load in transformers but not in the
common serving kernels (vLLM's Marlin and Machete, ExLlamaV2 take those): the export warns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

import torch

from harness import recipes
from harness.config.schema import ModelConfig
from harness.interop.hf_weights import lowp_to_hf

FORMATS = ("hf", "hf-fp8", "hf-int4")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# linears left in BF16 besides lm_head: the MoE routers and Qwen2-MoE's shared-expert gate
ROUTERS = ("mlp.gate", "block_sparse_moe.gate", "shared_expert_gate")
FP8_BLOCK = 128
SERVING_INT4_GROUPS = (-1, 32, 64, 128)
"""Group sizes vLLM's compressed-tensors WNA16 kernels (Marlin, Machete) and ExLlamaV2 accept."""


class ExportError(ValueError):
    """A run that cannot be exported as asked: one line, exit code 2."""


# ---- reading a run ---------------------------------------------------------------------------------


def run_json(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    if not path.is_file():
        raise ExportError(f"{run_dir}: no run.json; give a lowp run directory")
    return json.loads(path.read_text())


def run_config(run_dir: Path) -> dict:
    return run_json(run_dir)["config"]


def source_dir(cfg: dict) -> Path | None:
    """The Hugging Face directory the run's model config was read from, if it is still there."""
    spec = cfg["model"].get("hf_config")
    if not spec or str(spec) == "???":
        return None
    p = Path(os.path.expanduser(str(spec)))
    p = p.parent if p.is_file() else p
    return p if (p / "config.json").is_file() else None


def source_config(cfg: dict) -> dict:
    """The imported config.json as written (empty for a run that did not import one)."""
    from harness.interop.hf_config import read_hf_config

    src = source_dir(cfg)
    return read_hf_config(str(src)) if src is not None else {}


def run_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model tensors of the run's newest usable checkpoint (harness.lifecycle.checkpoint: DCP tensors and
    a JSON tree, nothing unpickled), under the emulated GPT's names, which both backends write."""
    from harness.lifecycle import checkpoint as ckpt

    found = ckpt.load_latest(run_dir)
    if found is None:
        raise ExportError(
            f"{run_dir}: no usable checkpoint under checkpoints/; train with checkpoint_interval>=0 "
            "(the default writes one every 10% of the steps and at the end)"
        )
    return {k: v for k, v in found[2]["model"].items() if isinstance(v, torch.Tensor)}


# ---- the HF config ---------------------------------------------------------------------------------


def hf_config(m: ModelConfig, run_dir: Path, source: dict | None = None):
    """The transformers config of the run's architecture (refused if transformers has none); the
    imported config `source`'s token ids, context length and Mistral family carried over."""
    import transformers

    if (m.normalization, m.activation, m.position_embedding) != ("RMSNorm", "swiglu", "rope"):
        raise ExportError(
            f"{run_dir}: model {m.name} is {m.normalization}/{m.activation}/{m.position_embedding}; "
            "Hugging Face export needs RMSNorm/swiglu/rope (a Llama or Qwen style model)"
        )
    source = source or {}
    heads = m.num_attention_heads
    kw = dict(
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=m.num_query_groups or heads,
        head_dim=m.kv_channels or m.hidden_size // heads,
        vocab_size=m.vocab_size,
        max_position_embeddings=max(m.seq_length, int(source.get("max_position_embeddings", 0) or 0)),
        rms_norm_eps=m.layernorm_epsilon,
        rope_theta=m.rotary_base,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        initializer_range=m.init_method_std,
        torch_dtype="bfloat16",
        **{k: source.get(k) for k in TOKEN_IDS},  # None where unknown: never transformers' defaults
    )
    if m.rope_scaling:  # Llama 3.1's, the one rope_type lowp implements besides the plain one
        kw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_position_embeddings,
        }
    if m.num_moe_experts:
        return moe_config(m, kw, run_dir)
    if m.add_qkv_bias and not m.add_bias_linear:
        if m.qk_layernorm:
            raise ExportError(f"{run_dir}: QKV-only bias with QK norm has no transformers architecture")
        return transformers.Qwen2Config(**kw), "Qwen2ForCausalLM"
    if m.qk_layernorm:
        return transformers.Qwen3Config(**kw, attention_bias=m.add_bias_linear), "Qwen3ForCausalLM"
    bias = m.add_bias_linear
    if source.get("model_type") == "mistral" and not bias and not m.rope_scaling:
        return transformers.MistralConfig(**kw, sliding_window=None), "MistralForCausalLM"
    return transformers.LlamaConfig(**kw, attention_bias=bias, mlp_bias=bias), "LlamaForCausalLM"


def moe_config(m: ModelConfig, kw: dict, run_dir: Path):
    """Qwen3-MoE (QK norm), Qwen2-MoE (gated shared expert) or Mixtral: the inverse of
    harness.interop.hf_config.moe_fields; refused where transformers would route otherwise."""
    import transformers

    from harness.model.moe import moe_layer_pattern

    def refuse(why: str):
        raise ExportError(f"{run_dir}: model {m.name}: {why}; transformers has no such mixture of experts")

    routing = {
        "moe_router_score_function": m.moe_router_score_function != "softmax",
        "moe_router_enable_expert_bias": m.moe_router_enable_expert_bias,
        "moe_router_topk_scaling_factor": m.moe_router_topk_scaling_factor not in (None, 1.0),
        "moe_expert_capacity_factor": m.moe_expert_capacity_factor is not None,
        "add_bias_linear": m.add_bias_linear,
    }
    for field, differs in routing.items():
        if differs:
            refuse(f"model.{field}={getattr(m, field)}")
    pattern = moe_layer_pattern(m)
    width = m.moe_ffn_hidden_size or m.ffn_hidden_size
    moe = dict(
        num_experts=m.num_moe_experts,
        num_experts_per_tok=m.moe_router_topk,
        router_aux_loss_coef=m.moe_aux_loss_coeff,
    )
    qwen = dict(
        moe_intermediate_size=width,
        norm_topk_prob=not m.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, sparse in enumerate(pattern) if not sparse],
    )
    shared = m.moe_shared_expert_intermediate_size
    if m.qk_layernorm:
        if shared or m.add_qkv_bias:
            refuse("QK norm with a shared expert or a QKV-only bias")
        return transformers.Qwen3MoeConfig(**kw, **moe, **qwen), "Qwen3MoeForCausalLM"
    if shared:
        if not m.moe_shared_expert_gate:
            refuse("a shared expert without model.moe_shared_expert_gate (Qwen2-MoE's is gated)")
        qwen |= dict(shared_expert_intermediate_size=shared, qkv_bias=m.add_qkv_bias)
        return transformers.Qwen2MoeConfig(**kw, **moe, **qwen), "Qwen2MoeForCausalLM"
    if m.add_qkv_bias or m.moe_router_pre_softmax or not all(pattern) or width != m.ffn_hidden_size:
        refuse(
            "without QK norm or a shared expert it is written as Mixtral, which has no QKV-only bias, "
            "renormalises the top-k probabilities (moe_router_pre_softmax=false), makes every layer sparse "
            "and sizes its experts by ffn_hidden_size"
        )
    return transformers.MixtralConfig(**kw, **moe), "MixtralForCausalLM"


# ---- quantized layouts -----------------------------------------------------------------------------


def fp8_block(w: torch.Tensor, power_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes in w's shape, float32 scale_inv per 128x128 tile) from lowp's quantizer."""
    from harness.numerics.blockwise import quantize_blockwise
    from harness.numerics.formats import E4M3

    q = quantize_blockwise(w.to(torch.bfloat16), E4M3, tile_2d=True, power_2=power_2)
    rows, cols = -(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK)
    codes = q.data if q.data.dtype == torch.float8_e4m3fn else q.data.view(torch.float8_e4m3fn)
    return codes.contiguous(), q.dec[:rows, :cols].float().contiguous()


def fp8_dequantize(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The reader's side (DeepSeek-V3's weight_dequant): fp32(code) * scale_inv of its tile."""
    s = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return codes.float() * s[: codes.shape[0], : codes.shape[1]]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] (out, in) -> int32 (out, ceil(in/8)): compressed-tensors' pack_to_int32."""
    rows, cols = q.shape
    pad = -cols % 8
    u = torch.nn.functional.pad(q.to(torch.int32) + 8, (0, pad)).view(rows, -1, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return (u << shifts).sum(dim=2, dtype=torch.int64).to(torch.int32)  # wraps to int32 bit patterns


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.int32) * 4
    u = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (u.reshape(packed.shape[0], -1)[:, :cols] - 8).to(torch.int8)


def int4_group(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes in [-7, 7], float32 scales (out, in/group)) from lowp's INT4 fake-quant."""
    from harness.numerics.int4 import quantize_int4

    q = quantize_int4(w.to(torch.bfloat16), group)
    return q.data, q.scale.float().contiguous()


def int4_dequantize(packed, scale, shape, group: int) -> torch.Tensor:
    """The reader's side: bf16(code * scale) per group (compressed-tensors' dequantize, fp32 scale)."""
    q = unpack_int4(packed, int(shape[1])).float()
    s = scale.repeat_interleave(group, 1)[:, : q.shape[1]]
    return (q * s).to(torch.bfloat16)


def check_int4_groups(hf_sd: dict, group: int, source: str) -> None:
    """compressed-tensors' group strategy reads whole groups only (a weight whose input width is not
    a multiple of the group fails to decompress in transformers): refused before anything is written,
    naming the largest group that divides every quantized width."""
    widths = {name: t.shape[-1] for name, t in hf_sd.items() if _quantizable(name)}
    bad = next((name for name, width in widths.items() if width % group), None)
    if bad is None:
        return
    width = math.gcd(*widths.values())
    fits = width & -width  # the largest power of two dividing every width; no larger than the group
    while fits > group:
        fits //= 2
    raise ExportError(
        f"--format=hf-int4 with group size {group} ({source}): {bad} has {widths[bad]} inputs, not a "
        f"multiple of {group}, which compressed-tensors cannot read; use --group-size={fits}"
    )


def _quantizable(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def quantize_state(hf_sd: dict, fmt: str, power_2: bool, group: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in hf_sd.items():
        if fmt == "hf" or not _quantizable(name):
            out[name] = t.to(torch.bfloat16).contiguous()
            continue
        base = name[: -len(".weight")]
        if fmt == "hf-fp8":
            out[name], out[base + ".weight_scale_inv"] = fp8_block(t, power_2)
        else:
            codes, scale = int4_group(t, group)
            out[base + ".weight_packed"] = pack_int4(codes)
            out[base + ".weight_scale"] = scale
            out[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
    return out


def quantization_config(fmt: str, group: int, moe: bool = False) -> dict | None:
    """transformers' quantization_config of the format; an MoE model's routers and shared-expert
    gates (linears in transformers 4, which its quantizers would otherwise convert) stay BF16."""
    keep = ROUTERS if moe else ()
    if fmt == "hf-fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": ["lm_head", *keep],
        }
    if fmt == "hf-int4":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        weights |= {"group_size": group, "dynamic": False, "observer": "minmax", "actorder": None}
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head", *(f"re:.*{re.escape(r)}$" for r in keep)],
        }
    return None


def check_serving_group(group: int) -> str | None:
    """The warning for an INT4 group size the common serving kernels do not take (None if they do)."""
    if group in SERVING_INT4_GROUPS:
        return None
    return (
        f"--format=hf-int4 with group size {group}: transformers loads it, but vLLM's INT4 kernels "
        f"(Marlin, Machete) and ExLlamaV2 accept group sizes {', '.join(map(str, SERVING_INT4_GROUPS))} "
        "only; export with --group-size=128 (or 32/64) to serve it"
    )


def tokenizer_spec(rj: dict) -> str | None:
    """The tokenizer the run's data was tokenized with: its provenance (a prepare manifest's or a
    text source's), else data.tokenizer."""
    return rj.get("provenance", {}).get("data", {}).get("tokenizer") or rj["config"]["data"].get("tokenizer")


def write_tokenizer(spec: str | None, src: Path | None, out: str) -> tuple[object | None, str | None]:
    """(the transformers tokenizer written to `out`, or None; a warning, or None). The run's data
    tokenizer first; without one, the imported model directory's own tokenizer files."""
    import transformers

    from harness.data.prepare import EOD_CANDIDATES

    path = Path(os.path.expanduser(spec)) if spec else None
    if path is None and src is not None and (src / "tokenizer.json").is_file():
        path = src
    if path is None:
        return None, None
    if path.is_dir() and (path / "tokenizer_config.json").is_file():
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
    else:
        file = path / "tokenizer.json" if path.is_dir() else path
        if file.suffix not in (".json", ".tiktoken", ".model") or not file.is_file():
            return None, (
                f"tokenizer {spec} not written: the export converts a tokenizers JSON, a .tiktoken file "
                "or a sentencepiece .model; write its tokenizer.json beside the weights"
            )
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizers_object(file))
        vocab = tok.get_vocab()
        eot = next((name for name in EOD_CANDIDATES if name in vocab), None)
        if eot is not None:
            tok.eos_token = eot
            tok.pad_token = tok.pad_token or eot
    tok.save_pretrained(out)
    return tok, None


def _tokenizers_object(file: Path):
    """A `tokenizers.Tokenizer` of a tokenizer.json, or of a .tiktoken file converted by transformers'
    TikTokenConverter with the split pattern and <|endoftext|> lowp reads it with (same ids)."""
    import tokenizers

    if file.suffix == ".model":
        return _sentencepiece_object(file)
    if file.suffix != ".tiktoken":
        return tokenizers.Tokenizer.from_file(str(file))
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from harness.data.tokenizer import CL100K_PATTERN, TIKTOKEN_EOT

    return TikTokenConverter(
        vocab_file=str(file), pattern=CL100K_PATTERN, extra_special_tokens=[TIKTOKEN_EOT]
    ).converted()


def _sentencepiece_object(file: Path):
    """A sentencepiece model as a `tokenizers.Tokenizer` with the same ids (tests/test_export_servable.py):
    transformers' SpmConverter (normalizer, Metaspace pre-tokenizer, decoder), whose BPE branch in
    transformers 5.24 calls its extractor with the wrong argument (an AttributeError), so BPE models
    take their vocabulary and merges from SentencePieceExtractor here; unigram models are its own."""
    import types

    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    class Converter(SpmConverter):
        def tokenizer(self, proto):
            if proto.trainer_spec.model_type != 2:  # unigram
                return super().tokenizer(proto)
            kw = SentencePieceExtractor(str(file)).extract(None)
            bpe = BPE(kw["vocab"], kw["merges"], unk_token=proto.trainer_spec.unk_piece, fuse_unk=True,
                      byte_fallback=self.handle_byte_fallback, dropout=None)  # fmt: skip
            return Tokenizer(bpe)

    original = types.SimpleNamespace(vocab_file=str(file), legacy=True, add_prefix_space=True)
    return Converter(original).converted()


def write_generation_config(hf_cfg, src: Path | None, out: str) -> None:
    """The imported model's generation_config.json as it was, else one holding the config's ids."""
    import transformers

    if src is not None and (src / "generation_config.json").is_file():
        gen = transformers.GenerationConfig.from_pretrained(str(src))
    else:
        gen = transformers.GenerationConfig(**{k: getattr(hf_cfg, k, None) for k in TOKEN_IDS})
    gen.save_pretrained(out)


def objective_fields(objective: dict, provenance: dict) -> dict:
    """config.json's keys of a masked-diffusion run: lowp_objective and its mask token's id, as the
    trainer resolved it (run.json's provenance; a run written before it recorded the id: the data's
    vocabulary size where objective.mask_token was null)."""
    from harness.model.objective import MASKED_DIFFUSION

    if objective.get("name") != MASKED_DIFFUSION:
        return {}
    token = (provenance.get("objective") or {}).get("mask_token", objective.get("mask_token"))
    return {
        "lowp_objective": MASKED_DIFFUSION,
        "mask_token_id": provenance["data"]["vocab_size"] if token is None else token,
    }


def export(
    run_dir: str, fmt: str, out: str, group_size: int | None = None, fp32_scales: bool | None = None
) -> dict:
    """Write the checkpoint; returns a summary (format, tensors, bytes, warnings)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format={fmt}: unknown; use one of {', '.join(FORMATS)}")
    rd = Path(run_dir)
    rj = run_json(rd)
    cfg = rj["config"]
    m = ModelConfig(**cfg["model"])
    src = source_dir(cfg)
    hf_cfg, arch = hf_config(m, rd, source_config(cfg))
    recipe = cfg.get("recipe", {})
    group = group_size or recipe.get("int4_group_size", 128)
    # the blockwise recipe's preset scales (power-of-two, TE's Float8BlockScaling default) unless asked
    power_2 = recipes.default_fields("blockwise").power_2_scales if fp32_scales is None else not fp32_scales
    sd = lowp_to_hf(run_weights(rd), m)
    warnings = []
    if fmt == "hf-int4":
        check_int4_groups(sd, group, "--group-size" if group_size else "the run's recipe.int4_group_size")
        warnings.append(check_serving_group(group))
    tensors = quantize_state(sd, fmt, power_2, group)
    hf_cfg.architectures = [arch]
    hf_cfg.update(objective_fields(cfg.get("objective") or {}, rj["provenance"]))
    qc = quantization_config(fmt, group, moe=bool(m.num_moe_experts))
    if qc is not None:
        hf_cfg.quantization_config = qc
    os.makedirs(out, exist_ok=True)
    from safetensors.torch import save_file

    tok, warning = write_tokenizer(tokenizer_spec(rj), src, out)
    warnings.append(warning)
    if tok is not None and hf_cfg.eos_token_id is None and tok.eos_token_id is not None:
        hf_cfg.eos_token_id = tok.eos_token_id
        hf_cfg.pad_token_id = hf_cfg.pad_token_id if hf_cfg.pad_token_id is not None else tok.pad_token_id
    tmp = Path(out) / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, Path(out) / "model.safetensors")
    hf_cfg.save_pretrained(out)
    write_generation_config(hf_cfg, src, out)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return {
        "format": fmt,
        "architecture": arch,
        "tensors": len(tensors),
        "bytes": size,
        "out": out,
        "tokenizer": tok is not None,
        "warnings": [w for w in warnings if w],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.export", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="a lowp run directory (run.json + checkpoints/)")
    p.add_argument("--format", default="hf", help="hf (BF16), hf-fp8 (128x128 E4M3) or hf-int4")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--group-size", type=int, default=None, help="hf-int4 group (default: the run's)")
    p.add_argument("--fp32-scales", action="store_true", default=None, help="hf-fp8: scales not powers of 2")
    a = p.parse_args(argv)
    try:
        res = export(a.run_dir, a.format, a.out, a.group_size, a.fp32_scales)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in res["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    mib = res["bytes"] / 2**20
    tok = ", tokenizer" if res["tokenizer"] else ""
    print(f"{res['format']}: {res['architecture']}, {res['tensors']} tensors, {mib:.1f} MiB{tok} -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
