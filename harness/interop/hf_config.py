"""A Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3 style) as lowp ModelConfig fields.

    model=hf model.hf_config=/path/to/config.json (or the model directory holding it)

`conf/model/hf.yaml` reads every architecture field through the `hf` resolver (`${hf:${.hf_config},
num_layers}`), so a command-line override of any of them still wins. Each field of the JSON is
mapped, known to change nothing lowp computes (token ids, generation and serving settings), or
refused in one line: lowp never trains a different model than the config describes. Refused:
mixture-of-experts, sliding-window attention, RoPE scaling other than Llama 3.1's (rope_type
llama3: factor, low/high_freq_factor, original_max_position_embeddings), activations
other than SiLU (SwiGLU), attention bias on the output projection without MLP bias (Megatron has no
flag for it), dropout, and fields this module does not know.
"""

from __future__ import annotations

import functools
import json
import os

from harness.config.errors import ConfigError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Fields that change nothing lowp computes: ids of special tokens, serving and generation settings,
# bookkeeping written by save_pretrained. (The dtype a checkpoint was saved in is not the recipe.)
IGNORED = {
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "use_cache",
    "transformers_version", "torch_dtype", "dtype", "_name_or_path", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "task_specific_params", "model_type", "auto_map",
    "_attn_implementation_autoset", "unsloth_fixed", "max_window_layers", "generation_config",
}  # fmt: skip
# max_window_layers only matters with sliding windows, which are refused


def read_hf_config(path: str) -> dict:
    """The JSON of `path` (a config.json, or a directory holding one) with one-line errors."""
    option = f"model.hf_config={path}"
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.isfile(p):
        raise ConfigError(f"{option}: no such file {p}; point it at a Hugging Face config.json")
    try:
        with open(p) as fh:
            raw = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option}: not JSON ({exc.msg}, line {exc.lineno}); give a config.json") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{option}: not a JSON object; give a Hugging Face config.json")
    return raw


@functools.lru_cache(maxsize=16)
def _model_fields(path: str, mtime: float) -> dict:
    raw = read_hf_config(path)
    fields = model_fields(raw, f"model.hf_config={path}")
    # named after the checkpoint's directory (Llama-3.2-1B), so runs of two HF models never share one
    p = os.path.abspath(os.path.expanduser(path))
    return {**fields, "name": "hf:" + os.path.basename(os.path.dirname(p) if os.path.isfile(p) else p)}


def hf_field(path: str, field: str):
    """The `hf` resolver: one ModelConfig field of the HF config at `path` (validated once)."""
    if path is None or str(path) in ("???", "None"):
        raise ConfigError("model.hf_config: not set; model=hf needs model.hf_config=/path/to/config.json")
    p = os.path.expanduser(str(path))
    mtime = os.path.getmtime(p) if os.path.exists(p) else 0.0
    fields = _model_fields(str(path), mtime)
    if field not in fields:
        raise AssertionError(f"conf/model/hf.yaml asks for {field}, which hf.config does not map")
    return fields[field]


def model_fields(raw: dict, option: str) -> dict:
    """ModelConfig fields for a Llama/Mistral/Qwen2/Qwen3 config dict; ConfigError if lowp would
    compute anything else than the config describes."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        hint = "mixture-of-experts models are not supported" if "moe" in str(family) else ""
        raise ConfigError(
            f"{option}: model_type={family!r} is not supported{' (' + hint + ')' if hint else ''}; "
            f"lowp reads {', '.join(FAMILIES)} configs"
        )
    _refuse_unsupported(raw, family, option)
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    head_dim = raw.get("head_dim") or hidden // heads
    bias_linear, qkv_bias = _bias_flags(raw, family, option)
    known = _mapped_keys(family) | IGNORED
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise ConfigError(
            f"{option}: field {unknown[0]!r} is not known to lowp (it may change the model); "
            "lowp refuses rather than ignores it: remove it if it is inert, or use a supported config"
        )
    return {
        "name": f"hf_{family}",  # replaced by the checkpoint's name when read from a file
        "num_layers": raw["num_hidden_layers"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": raw.get("num_key_value_heads") or heads,
        "kv_channels": head_dim,
        "ffn_hidden_size": raw["intermediate_size"],
        "seq_length": min(int(raw.get("max_position_embeddings", 4096)), 4096),
        "vocab_size": raw["vocab_size"],
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "position_embedding": "rope",
        "rotary_base": float(_rope(raw)["rope_theta"]),
        **_ROPE_DEFAULTS,
        **_rope_fields(raw),
        # absent: transformers' default for all four families is untied
        "untie_embeddings_and_output_weights": not raw.get("tie_word_embeddings", False),
        "qk_layernorm": family == "qwen3",
        "add_bias_linear": bias_linear,
        "add_qkv_bias": qkv_bias,
        "layernorm_epsilon": float(raw.get("rms_norm_eps", 1e-6)),
        "init_method_std": float(raw.get("initializer_range", 0.02)),
    }


_ROPE_DEFAULTS = {  # ModelConfig's, so a plain-RoPE config still gives every field hf.yaml asks for
    "rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position_embeddings": 8192,
}


def _mapped_keys(family: str) -> set[str]:
    keys = {
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "max_position_embeddings", "vocab_size", "rms_norm_eps", "initializer_range",
        "tie_word_embeddings", "hidden_act", "rope_theta", "rope_scaling", "rope_parameters",
        "attention_dropout", "attention_bias", "mlp_bias", "pretraining_tp", "sliding_window",
        "use_sliding_window", "layer_types",
    }  # fmt: skip
    return keys


# rope_type -> its parameters (HF name -> ModelConfig field); Llama 3.1's needs all four
ROPE_TYPES = {
    "default": {},
    "llama3": {
        "factor": "rope_scaling_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_position_embeddings",
    },
}


def _rope_fields(raw: dict) -> dict:
    """ModelConfig's rope_scaling fields (validated by _refuse_unsupported); defaults when plain."""
    rope = _rope(raw)
    kinds = {"factor": float, "low_freq_factor": float, "high_freq_factor": float}
    out: dict = {"rope_scaling": rope["rope_type"] == "llama3"}
    out |= {field: kinds.get(k, int)(rope[k]) for k, field in ROPE_TYPES[rope["rope_type"]].items()}
    return out


def _rope(raw: dict) -> dict:
    """transformers >= 5 writes `rope_parameters`; older configs `rope_theta` and `rope_scaling`."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    return {"rope_type": kind, "rope_theta": theta, **params}


def _refuse_unsupported(raw: dict, family: str, option: str) -> None:
    moe = [
        k
        for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
        if k in raw
    ]
    if moe:
        raise ConfigError(f"{option}: {moe[0]} is a mixture-of-experts field; lowp trains dense models only")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{option}: hidden_act={raw['hidden_act']!r}; lowp's gated MLP is SwiGLU (hidden_act='silu')"
        )
    rope = _rope(raw)
    if rope["rope_type"] not in ROPE_TYPES:
        raise ConfigError(
            f"{option}: RoPE scaling rope_type={rope['rope_type']!r} is not implemented by lowp; "
            "use plain RoPE (no rope_scaling) or Llama 3.1's rope_type='llama3'"
        )
    missing = sorted(set(ROPE_TYPES[rope["rope_type"]]) - set(rope))
    if missing:
        raise ConfigError(f"{option}: rope_type={rope['rope_type']!r} without {missing[0]!r}; add it")
    extra = sorted(set(rope) - {"rope_type", "rope_theta", *ROPE_TYPES[rope["rope_type"]]})
    if extra:  # e.g. partial_rotary_factor: RoPE on part of each head, which lowp does not do
        raise ConfigError(f"{option}: RoPE parameter {extra[0]!r} is not implemented by lowp; remove it")
    sliding = raw.get("use_sliding_window") if family in ("qwen2", "qwen3") else raw.get("sliding_window")
    layer_types = set(raw.get("layer_types") or ["full_attention"])
    if sliding or layer_types != {"full_attention"}:
        what = (
            f"sliding_window={raw.get('sliding_window')}" if sliding else f"layer_types={sorted(layer_types)}"
        )
        raise ConfigError(
            f"{option}: {what}: sliding-window attention is not implemented by lowp; "
            "use full attention (sliding_window=null / use_sliding_window=false)"
        )
    if raw.get("attention_dropout", 0.0):
        raise ConfigError(
            f"{option}: attention_dropout={raw['attention_dropout']}; lowp trains without dropout"
        )
    if raw.get("pretraining_tp", 1) != 1:
        raise ConfigError(f"{option}: pretraining_tp={raw['pretraining_tp']}; only 1 (unsplit linears)")
    if raw.get("head_dim") is None and raw["hidden_size"] % raw["num_attention_heads"]:
        raise ConfigError(f"{option}: hidden_size is not a multiple of num_attention_heads and no head_dim")


def _bias_flags(raw: dict, family: str, option: str) -> tuple[bool, bool]:
    """(add_bias_linear, add_qkv_bias) in Megatron's terms. Qwen2 biases q/k/v only; Llama's
    attention_bias covers q/k/v/o and mlp_bias the MLP: together they are add_bias_linear."""
    if family == "qwen2":
        return False, True
    attn, mlp = bool(raw.get("attention_bias", False)), bool(raw.get("mlp_bias", False))
    if attn != mlp:
        raise ConfigError(
            f"{option}: attention_bias={attn} with mlp_bias={mlp}: lowp (like Megatron's add_bias_linear) "
            "puts a bias on all linears or none; only Qwen2's q/k/v-only bias is separate (add_qkv_bias)"
        )
    return attn, False
