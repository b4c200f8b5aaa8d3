"""The mixture-of-experts fields (model.num_moe_experts, model.moe_*): their names, what Megatron-LM
refuses (megatron/core/transformer/transformer_config.py at d98e8a6, cited by line), and what lowp
does not run yet. Every error is one line naming the option and the fix."""

from __future__ import annotations

import fnmatch

from harness.config.schema import Config, ModelConfig
from harness.model import routing as R
from harness.model.moe import expert_groups
from harness.model.plan import in_int4_scope

MOE_EXPERT_KERNELS = ("te", "grouped", "auto")
"""backend.moe_experts: the kernels of BF16 expert groups on backend=te (harness.backends.te_moe)."""
_NAMES = {
    "moe_router_score_function": R.SCORE_FUNCTIONS,
    "moe_router_load_balancing_type": R.LOAD_BALANCING_TYPES,
    "moe_router_dtype": tuple(R.ROUTER_DTYPES),
}


def moe_name_errors(m: ModelConfig) -> list[str]:
    """Values outside lowp's choices; Megatron's values that lowp does not implement are named so."""
    errs = []
    for key, allowed in _NAMES.items():
        value = getattr(m, key)
        if value in allowed:
            continue
        choices = [a for a in allowed if a is not None]
        if value in R.NOT_IMPLEMENTED.get(key, ()):
            errs.append(f"model.{key}={value}: Megatron's, not implemented by lowp; use one of {choices}")
        else:
            errs.append(f"model.{key}={value}: unknown; choose one of {choices}")
    return errs


def moe_errors(cfg: Config) -> list[str]:
    """What Megatron refuses, and the shapes an MoE layer needs (names already checked)."""
    m = cfg.model
    if m.num_moe_experts is None:
        if cfg.recipe.int4_scope == "routed_experts" and not in_int4_scope(cfg.recipe, "blocks.0.attn.qkv"):
            return [
                "recipe.int4_scope=routed_experts without model.num_moe_experts: a dense model has no "
                "routed experts, nothing would be quantized; use recipe.int4_scope=all_linear"
            ]
        if m.moe_ffn_hidden_size is not None:  # transformer_config.py:1689-1705
            return [
                f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} without model.num_moe_experts: "
                "set model.num_moe_experts or remove it"
            ]
        return []
    if m.num_moe_experts < 1:  # transformer_config.py:1682-1683
        return [f"model.num_moe_experts={m.num_moe_experts}: must be >= 1 (null = a dense model)"]
    errs = _size_errors(m) + _layer_freq_errors(m) + _router_errors(m)
    if m.moe_router_padding_for_quantization and cfg.recipe.fp8 is None and cfg.recipe.fp4 is None:
        errs.append(  # transformer_config.py:2649-2653
            f"model.moe_router_padding_for_quantization=true with recipe={cfg.recipe.name}: it pads to "
            "an FP8/FP4 recipe's alignment (Megatron refuses it without one); use one or set it false"
        )
    if m.moe_shared_expert_intermediate_size is not None and m.add_bias_linear:
        errs.append(  # shared_experts.py:124: SharedExpertMLP asserts add_bias_linear == False
            "model.moe_shared_expert_intermediate_size with model.add_bias_linear=true: Megatron's shared "
            "expert has no biases; set model.add_bias_linear=false"
        )
    return errs + _grouped_gemm_errors(cfg)


def _grouped_gemm_errors(cfg: Config) -> list[str]:
    """Megatron's experts are TE GroupedLinear (--moe-grouped-gemm), whose kernels validate_args
    asserts compute capability >= 8.0 for (megatron/training/arguments.py:1378-1380)."""
    hw = cfg.hardware
    if hw.compute_capability is None or hw.compute_capability >= 8.0:
        return []
    return [
        f"model.num_moe_experts={cfg.model.num_moe_experts} with hardware={hw.name} (compute capability "
        f"{hw.compute_capability}): "
        "Megatron's grouped GEMM experts (--moe-grouped-gemm) need compute capability >= 8.0; use "
        "an A100 or later (hardware=a100, h100, h200, b200)"
    ]


def _size_errors(m: ModelConfig) -> list[str]:
    errs = []
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if getattr(m, key) is not None and getattr(m, key) < 1:  # transformer_config.py:1813-1819
            errs.append(f"model.{key}={getattr(m, key)}: must be >= 1 (or null)")
    if not 1 <= m.moe_router_topk <= m.num_moe_experts:
        errs.append(
            f"model.moe_router_topk={m.moe_router_topk}: must be 1..model.num_moe_experts={m.num_moe_experts}"
        )
    if (f := m.moe_expert_capacity_factor) is not None and f <= 0:
        errs.append(
            f"model.moe_expert_capacity_factor={f}: must be > 0; null = dropless (Megatron reads a "
            "negative factor as null)"
        )
    for key in ("moe_aux_loss_coeff", "moe_router_bias_update_rate"):
        if (v := getattr(m, key)) < 0:
            errs.append(f"model.{key}={v}: must be >= 0")
    if m.moe_z_loss_coeff is not None and m.moe_z_loss_coeff <= 0:  # the z-loss is logged / its coeff
        errs.append(f"model.moe_z_loss_coeff={m.moe_z_loss_coeff}: must be > 0 (null = no z-loss)")
    return errs


def _layer_freq_errors(m: ModelConfig) -> list[str]:
    """An int N >= 1, or a 0/1 list of num_layers entries (models/gpt/gpt_layer_specs.py:647-661)."""
    freq = m.moe_layer_freq
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        return [f"model.moe_layer_freq={freq}: use an int N (every N-th layer) or a 0/1 list of the layers"]
    if isinstance(freq, int):
        return [] if freq >= 1 else [f"model.moe_layer_freq={freq}: must be >= 1"]
    if len(freq) != m.num_layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
        return [
            f"model.moe_layer_freq={freq}: a pattern needs one 0 (dense) or 1 (MoE) per layer, "
            f"model.num_layers={m.num_layers} of them"
        ]
    return []


def _router_errors(m: ModelConfig) -> list[str]:
    errs = []
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        errs.append(  # transformer_config.py:2617-2625
            "model.moe_router_enable_expert_bias=true needs model.moe_router_score_function=sigmoid "
            f"(Megatron refuses it with {m.moe_router_score_function}); set it or disable the expert bias"
        )
    one_softmax = m.moe_router_topk == 1 and m.moe_router_score_function == "softmax"
    if one_softmax and not m.moe_router_pre_softmax:
        errs.append(  # transformer_config.py:2661-2669
            "model.moe_router_topk=1 with softmax needs model.moe_router_pre_softmax=true: a softmax over "
            "one logit is 1 and gives the router no gradient; set it"
        )
    return errs


def moe_support_errors(cfg: Config, te: bool) -> list[str]:
    """What lowp does not run with experts yet: FP8 primary weights on TE, biases."""
    m = cfg.model
    if m.num_moe_experts is None:
        return []
    errs = []
    if te and cfg.optimizer.fp8_param:
        errs.append(  # TE's experts would hold FP8 weights only as its experimental GroupedTensor
            f"optimizer.fp8_param=true with model.num_moe_experts={m.num_moe_experts} on backend=te: "
            "lowp's TE experts keep bf16 weights (TE quantizes them each step); set "
            "optimizer.fp8_param=false or use backend=emulated"
        )
    kernels = cfg.backend.moe_experts
    if kernels not in MOE_EXPERT_KERNELS:
        errs.append(f"backend.moe_experts={kernels}: unknown; choose one of {list(MOE_EXPERT_KERNELS)}")
    elif kernels == "grouped" and not te:
        errs.append(
            f"backend.moe_experts={kernels} with backend={cfg.backend.name} running the emulator: it picks "
            "the kernels of TE's expert groups; use backend=te or backend.moe_experts=te"
        )
    if m.add_bias_linear:
        errs.append(
            "model.add_bias_linear=true with model.num_moe_experts: MoE layers without biases only so far "
            "(as Qwen2/3-MoE and Mixtral); set model.add_bias_linear=false"
        )
    return errs + _expert_override_errors(cfg)


def _expert_override_errors(cfg: Config) -> list[str]:
    """TE runs an expert group (GroupedLinear) under one recipe: a stability override may select a
    group (blocks.3.mlp.experts.fc1) but not some of its experts (blocks.3.mlp.experts.fc1.0)."""
    E = cfg.model.num_moe_experts
    if not cfg.stability.overrides or _layer_freq_errors(cfg.model):
        return []
    groups = expert_groups(cfg.model)
    for ov in cfg.stability.overrides:
        for group in groups:
            if not fnmatch.fnmatchcase(group, ov.pattern) and any(
                fnmatch.fnmatchcase(f"{group}.{e}", ov.pattern) for e in range(E)
            ):
                return [
                    f"stability.overrides pattern={ov.pattern} selects experts of {group}, not the whole "
                    f"group: an expert group runs under one recipe; use pattern={group}"
                ]
    return []


def moe_export_errors(cfg: Config) -> list[str]:
    """What the Megatron export cannot print for an MoE model (harness.interop.megatron_arch.moe_flags
    prints the rest): biases, which lowp's MoE layers do not have, so there is no lowp model to hold
    Megatron's against (Megatron's own experts would need --no-bias-dropout-fusion, experts.py:205-207)."""
    m = cfg.model
    if m.num_moe_experts is None or not m.add_bias_linear:
        return []
    return [
        "model.add_bias_linear=true with model.num_moe_experts: lowp's MoE layers have no biases (as "
        "Qwen2/3-MoE and Mixtral), so there is no lowp model to export; set model.add_bias_linear=false"
    ]


def moe_warnings(cfg: Config) -> list[str]:
    m = cfg.model
    if (m.num_moe_experts or 0) >= 32 and m.moe_router_dtype is None:  # transformer_config.py:3119-3127
        return [
            f"model.num_moe_experts={m.num_moe_experts} with the router in bf16: Megatron advises "
            "model.moe_router_dtype=fp32 from 32 experts on"
        ]
    return []
