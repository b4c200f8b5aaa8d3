"""A Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3 style, and the mixture-of-experts
Qwen2-MoE, Qwen3-MoE and Mixtral) as lowp ModelConfig fields.

    model=hf model.hf_config=/path/to/config.json (or the model directory holding it)

`conf/model/hf.yaml` reads every architecture field through the `hf` resolver (`${hf:${.hf_config},
num_layers}`), so a command-line override of any of them still wins. Each field of the JSON is
mapped, known to change nothing lowp computes (token ids, generation and serving settings), or
refused in one line: lowp never trains a different model than the config describes. Refused:
MoE families lowp does not implement (DeepSeek's multi-head latent attention, ...), sliding-window
attention, RoPE scaling other than Llama 3.1's (rope_type llama3: factor, low/high_freq_factor,
original_max_position_embeddings), activations other than SiLU (SwiGLU), attention bias on the
output projection without MLP bias (Megatron has no flag for it), dropout, and fields this module
does not know.

Mixture of experts (transformers 5.24's modeling_{qwen2_moe,qwen3_moe,mixtral}.py against Megatron
Core's router, harness/model/routing.py):
- num_experts (Qwen) / num_local_experts (Mixtral) -> num_moe_experts; num_experts_per_tok ->
  moe_router_topk; moe_intermediate_size -> moe_ffn_hidden_size (Mixtral's experts are
  intermediate_size wide); intermediate_size stays the dense layers' width (mlp_only_layers).
- Routing: transformers takes the softmax over all experts in fp32, then the top k. With
  norm_topk_prob (Mixtral: always) it divides the k probabilities by their sum, which is the
  softmax over the k chosen logits: Megatron's moe_router_pre_softmax=false (top-k, then softmax).
  Without it the k probabilities are the full softmax's: moe_router_pre_softmax=true.
- Layers: block i is sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
  Megatron's integer moe_layer_freq N makes blocks 0, N, 2N, ... sparse instead, so any other pattern
  is written as the 0/1 list moe_layer_freq takes.
- Qwen2-MoE's shared expert (shared_expert_intermediate_size wide) and its sigmoid gate
  (shared_expert_gate, a bias-free (1, h) linear) -> moe_shared_expert_intermediate_size and
  moe_shared_expert_gate=true.
- router_aux_loss_coef -> moe_aux_loss_coeff with Megatron's per-layer aux_loss, as Megatron's own
  converters map it (transformers adds its loss only with output_router_logits, over all layers at once).
- The router runs in the checkpoint's dtype in transformers (F.linear of the hidden states):
  moe_router_dtype stays null, the model's bf16, Megatron's default.
- Mixtral's router_jitter_noise (training-time noise on the router's input) must be 0.
"""

from __future__ import annotations

import functools
import json
import os

from harness.config.errors import ConfigError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
# fields of MoE families lowp does not implement -> what they are (refused first, naming the field)
FOREIGN_MOE = {
    "kv_lora_rank": "DeepSeek's multi-head latent attention",
    "q_lora_rank": "DeepSeek's multi-head latent attention",
    "n_routed_experts": "DeepSeek-style routed experts (group-limited routing)",
    "topk_group": "group-limited expert routing",
}

# Fields that change nothing lowp computes: ids of special tokens, serving and generation settings,
# bookkeeping written by save_pretrained. (The dtype a checkpoint was saved in is not the recipe.)
IGNORED = {
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "use_cache",
    "transformers_version", "torch_dtype", "dtype", "_name_or_path", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "task_specific_params", "model_type", "auto_map",
    "_attn_implementation_autoset", "unsloth_fixed", "max_window_layers", "generation_config",
    "output_router_logits",
    "lowp_objective", "mask_token_id",  # a masked-diffusion export's objective: the run's objective group
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
    foreign = [k for k in FOREIGN_MOE if k in raw]
    if foreign:
        raise ConfigError(
            f"{option}: {foreign[0]} ({FOREIGN_MOE[foreign[0]]}, model_type={family!r}) is not implemented "
            f"by lowp; it reads {', '.join(FAMILIES)} configs"
        )
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
        "qk_layernorm": family in ("qwen3", "qwen3_moe"),
        "add_bias_linear": bias_linear,
        "add_qkv_bias": qkv_bias,
        "layernorm_epsilon": float(raw.get("rms_norm_eps", 1e-6)),
        "init_method_std": float(raw.get("initializer_range", 0.02)),
        **moe_fields(raw, family, option),
    }


MOE_DEFAULTS = {  # ModelConfig's, so a dense config still gives every field hf.yaml asks for
    "num_moe_experts": None,
    "moe_ffn_hidden_size": None,
    "moe_router_topk": 2,
    "moe_router_pre_softmax": False,
    "moe_layer_freq": 1,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_aux_loss_coeff": 0.0,
}


# transformers' defaults of the MoE fields a config may leave out: experts, top-k, expert width
HF_MOE_DEFAULTS = {"qwen3_moe": (128, 8, 768), "qwen2_moe": (60, 4, 1408), "mixtral": (8, 2, None)}


def moe_fields(raw: dict, family: str, option: str) -> dict:
    """The MoE fields of a Qwen2-MoE / Qwen3-MoE / Mixtral config (the module docstring's map);
    ModelConfig's defaults for a dense family."""
    if family not in MOE_FAMILIES:
        return dict(MOE_DEFAULTS)
    layers, (experts, topk, width) = raw["num_hidden_layers"], HF_MOE_DEFAULTS[family]
    # transformers aliases the two names (attribute_map); 5.x writes num_local_experts for all three
    named = {raw[k] for k in ("num_experts", "num_local_experts") if k in raw}
    if len(named) > 1:
        raise ConfigError(
            f"{option}: num_experts={raw['num_experts']} but num_local_experts="
            f"{raw['num_local_experts']}; give one"
        )
    experts = named.pop() if named else experts
    if family == "mixtral":
        renorm = True
        pattern = [1] * layers
        if raw.get("router_jitter_noise", 0.0):
            raise ConfigError(
                f"{option}: router_jitter_noise={raw['router_jitter_noise']}; lowp's router has no input "
                "noise: set it to 0"
            )
    else:
        width = raw.get("moe_intermediate_size", width)
        renorm = bool(raw.get("norm_topk_prob", False))
        step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if experts < 1 or not any(pattern):
        raise ConfigError(f"{option}: no sparse layer (num_experts={experts}); give a dense config instead")
    shared = raw.get("shared_expert_intermediate_size", 5632) if family == "qwen2_moe" else None
    return {
        "num_moe_experts": int(experts),
        "moe_ffn_hidden_size": width,
        "moe_router_topk": int(raw.get("num_experts_per_tok", topk)),
        "moe_router_pre_softmax": not renorm,
        "moe_layer_freq": 1 if all(pattern) else pattern,
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_shared_expert_gate": bool(shared),
        "moe_aux_loss_coeff": float(raw.get("router_aux_loss_coef", 0.001)),
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
    if family in MOE_FAMILIES:
        keys |= {"num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"}
        if family == "mixtral":
            keys |= {"router_jitter_noise"}
        else:
            keys |= {"moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step"}
            keys |= {"mlp_only_layers"}
        if family == "qwen2_moe":
            keys |= {"shared_expert_intermediate_size", "qkv_bias"}
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
    dense_moe = [k for k in ("num_experts", "num_local_experts", "moe_intermediate_size") if k in raw]
    if dense_moe and family not in MOE_FAMILIES:
        raise ConfigError(
            f"{option}: {dense_moe[0]} is a mixture-of-experts field in a model_type={family!r} config; "
            f"lowp reads experts from {', '.join(MOE_FAMILIES)} configs"
        )
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
    qwen = family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    sliding = raw.get("use_sliding_window") if qwen else raw.get("sliding_window")
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
    if family == "qwen2_moe":
        return False, bool(raw.get("qkv_bias", True))
    attn, mlp = bool(raw.get("attention_bias", False)), bool(raw.get("mlp_bias", False))
    if attn != mlp:
        raise ConfigError(
            f"{option}: attention_bias={attn} with mlp_bias={mlp}: lowp (like Megatron's add_bias_linear) "
            "puts a bias on all linears or none; only Qwen2's q/k/v-only bias is separate (add_qkv_bias)"
        )
    return attn, False
