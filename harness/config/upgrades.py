"""A config stored by an older lowp (a checkpoint's state.json), read as today's schema.

Every field added to the schema since checkpoints could be resumed (4bfca9b) is in ADDED with the value
that does what lowp did before the field existed, and why; that value is the field's default (a
new field whose default changed behaviour would make every older checkpoint resume as another run).
Every field that left the schema is in REMOVED with the value at which the old option did what
today's lowp does; a stored config that set it otherwise is refused on resume, naming the key.

    config, refusals = upgrade(saved)   # ADDED filled where absent, REMOVED dropped
    absent_fields(saved)                # ["ModelConfig.qk_layernorm", ...]: what ADDED must hold

A field is named by its dataclass and its name (`RecipeConfig.fp8_dpa`), so one entry covers every
place the class is stored (the run's recipe and each stability override's resolved recipe).
tests/test_upgrade.py holds the contract: every schema field absent from a stored config under
tests/assets/checkpoints/ is in ADDED at its default, every key it has beyond the schema is in
REMOVED. Adding a field therefore means adding its line here, with the reason its default is the
behaviour before it. (Removed recipe names are the registry's: `harness.recipes.LEGACY`.)
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from harness.config import schema

ANY = object()
"""REMOVED value of an option that never changed what a run computed: any stored value resumes."""


@dataclass(frozen=True)
class Change:
    """One field added to or removed from the schema."""

    field: str
    """`Class.name` in harness.config.schema (the class may be gone from the schema for a removal)."""
    value: Any
    """ADDED: what reproduces lowp before the field (its default). REMOVED: what reproduces lowp today."""
    since: str
    """The commit that added or removed it."""
    why: str
    """ADDED: why that value is the old behaviour. REMOVED: what the option did and why it left."""


_ROPE = "read only with rope_scaling=true"
_MOE, _MOE_SINCE = "read only with num_moe_experts set (every model was dense)", "3658696"
_MOE_FIELDS = {  # Megatron's TransformerConfig defaults
    "moe_ffn_hidden_size": None,
    "moe_router_topk": 2,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_layer_freq": 1,
    "moe_router_dtype": None,
    "moe_expert_capacity_factor": None,
    "moe_router_padding_for_quantization": False,
}
_TE220 = "cfaa1cc"
_PARALLEL = {
    "name": "none",
    "strategy": "none",
    "backend": "auto",
    "timeout_s": 600.0,
    "tp_only_amax_red": False,
    "reshard_after_forward": True,
}
# fmt: off
ADDED: dict[str, Change] = {c.field: c for c in (
    Change("ModelConfig.num_query_groups", None, "98cda1f", "null: a key/value head per query head (MHA)"),
    Change("ModelConfig.kv_channels", None, "98cda1f", "null: head size hidden_size / num_attention_heads"),
    Change("ModelConfig.rotary_base", 10000.0, "98cda1f", "RoPE's theta was fixed at 10000"),
    Change("ModelConfig.untie_embeddings_and_output_weights", True, "98cda1f",
           "the LM head had its own weights"),
    Change("ModelConfig.qk_layernorm", False, "98cda1f", "queries and keys were not normalized"),
    Change("ModelConfig.add_qkv_bias", False, "98cda1f", "QKV had a bias only with add_bias_linear"),
    Change("ModelConfig.hf_config", None, "98cda1f", "the shape came from the model fields alone"),
    Change("Config.init_from", None, "98cda1f", "the model started from its seeded random init"),
    Change("ModelConfig.rope_scaling", False, "beaa6db", "RoPE frequencies were not scaled"),
    Change("ModelConfig.rope_scaling_factor", 8.0, "beaa6db", _ROPE),
    Change("ModelConfig.rope_low_freq_factor", 1.0, "beaa6db", _ROPE),
    Change("ModelConfig.rope_high_freq_factor", 4.0, "beaa6db", _ROPE),
    Change("ModelConfig.rope_original_max_position_embeddings", 8192, "beaa6db", _ROPE),
    Change("RecipeConfig.fp8_dpa", False, "ae8d0b7", "attention ran in BF16"),
    Change("RecipeConfig.fp8_mha", False, "ae8d0b7", "read only with fp8_dpa=true"),
    Change("ModelConfig.cross_entropy_loss_fusion", False, "ae8d0b7", "the loss read fp32 logits, unfused"),
    Change("BackendConfig.packed_qkv_grad", False, "ae8d0b7", "q, k and v left the QKV output as TE does it"),
    Change("Config.parallel", _PARALLEL, "cc34101",
           "strategy none: one process, as every run was (the other fields are read only with ranks)"),
    Change("RecipeConfig.fp8_fast_accumulation", "fprop", "7d8ad47",
           "TE's default: fast accumulation in the forward GEMMs only, what TE did without the field"),
    Change("OptimizerConfig.step_in_backward", False, "b3384d0", "the optimizer stepped after backward"),
    Change("ModuleOverride.fields", {}, "95aba5e", "no fields: the override's recipe ran as its preset"),
    Change("ModelConfig.num_moe_experts", None, _MOE_SINCE, "every model was dense (an MLP in each block)"),
    Change("RecipeConfig.int4_scope", "all_linear", "c787023", "int4_qat fake-quantized every block linear"),
    *(Change(f"ModelConfig.{name}", value, _MOE_SINCE, _MOE) for name, value in _MOE_FIELDS.items()),
    Change("Config.telemetry", {"moe_experts_per_layer": 4}, "ca1581a",
           "what telemetry rows are written, never what a run computes; read only with experts"),
    *(Change(f"DataConfig.{name}", value, "5cfc642", "read only by the data sources added with it "
             "(hf_dataset, stdlib_text, custom)") for name, value in (
        ("tokenizer", None), ("text_key", "text"), ("cache_dir", "~/.cache/lowp/data"), ("_target_", None),
        ("params", {}))),
    Change("RecipeConfig.backward_override", None, _TE220, "the backward GEMMs took the quantized operands"),
    Change("RecipeConfig.row_scaled_activation", False, _TE220, "NVFP4 activations had one global scale"),
    Change("RecipeConfig.nvfp4_4over6", "none", _TE220, "NVFP4 blocks always mapped their max to 6"),
    Change("RecipeConfig.nvfp4_4over6_e4m3_use_256", "all", _TE220, "read only with nvfp4_4over6 set"),
    Change("RecipeConfig.nvfp4_4over6_err_mode", "MAE", _TE220, "read only with nvfp4_4over6 set"),
    Change("RecipeConfig.enable_2d_quantization", False, _TE220, "MXFP8 weights had 1x32 blocks"),
    Change("BackendConfig.moe_experts", "te", "965f549", "TE's GroupedLinear ran every expert group"),
    Change("BackendConfig.deterministic", False, "579db9c",
           "kernels chose their algorithms as the libraries default (atomics allowed)"),
    Change("Config.objective", {"name": "autoregressive", "mask_token": None, "difflm_varilen_prob": 0.01,
                                "eps": 0.0, "eval_t": [0.1, 0.3, 0.5, 0.7, 0.9], "eval_mask_seed": 0},
           "17e3316",
           "every model was trained on the next token with causal attention; the other fields are read "
           "only with objective=masked_diffusion"),
    Change("TelemetryConfig.candidates", [], "fabae69", "no counterfactual rows; training never reads it"),
    Change("StabilityConfig.plan_file", None, "fabae69", "no plan: the overrides were all there was"),
    Change("Config.schedule", {"name": "none", "phases": []}, "6400d46",
           "no phases: the recipe group ran the whole run"),
    Change("Config.warm_start", None, "6400d46",
           "a run started from its seeded init or its own checkpoint"),
)}

_HEAD = "the FP8 LM head failed the loss check (benchmarks/RESULTS.md, 'Loss checks of the TE options')"
_SPEED = "a speed option of the TE backend, removed with its code"
REMOVED: dict[str, Change] = {c.field: c for c in (
    Change("Config.dtype", "bf16", "95aba5e", "the compute dtype; validation accepted only bf16"),
    Change("HardwareConfig.arch", ANY, "95aba5e", "the architecture its name says; nothing read it"),
    Change("HardwareConfig.memory_gib", ANY, "95aba5e", "the device memory; nothing a run computes read it"),
    Change("RecipeConfig.fp8_lm_head", False, "95aba5e", _HEAD),
    Change("RecipeConfig.fp8_lm_head_fprop", True, "95aba5e", _HEAD),
    Change("RecipeConfig.fp8_lm_head_grad_format", None, "95aba5e", _HEAD),
    Change("RecipeConfig.fp8_dpa_recipe", None, "95aba5e",
           "attention's own delayed-scaling recipe went through TE's private globals and failed the loss "
           "check (benchmarks/RESULTS.md, 'Loss checks of the TE options')"),
    Change("BackendConfig.cuda_graphs", False, "95aba5e", f"CUDA graphs of the TE blocks, {_SPEED}"),
    Change("OptimizerConfig.quantize_weights_in_backward", False, "95aba5e",
           f"the FP8 weight recast in backward, {_SPEED}"),
    Change("OptimizerConfig.step_in_backward_yields", False, "e3bd872",
           "the step's stream at high priority; it measured no faster"),
    Change("OptimizerConfig.backward_sm_margin", 0, "26b221b",
           "SMs left free in backward for the step; it did not shorten the step"),
)}
# fmt: on


@dataclass(frozen=True)
class Refusal:
    """A removed option a stored config set to a value today's lowp cannot reproduce."""

    key: str
    """Its dotted key in the stored config (`recipe.fp8_lm_head`)."""
    value: Any
    change: Change


def upgrade(stored: dict) -> tuple[dict, list[Refusal]]:
    """`stored` as today's schema (a copy): ADDED fields filled where absent, REMOVED ones dropped.
    Returns it and the removed options it set otherwise than REMOVED says (the run cannot go on as
    it was). Keys in neither table stay as they are: the resume check names them."""
    config = copy.deepcopy(stored)
    refusals: list[Refusal] = []
    _upgrade(config, schema.Config, "", refusals)
    return config, refusals


def absent_fields(stored: dict) -> list[str]:
    """`Class.name` of each schema field a stored config does not have (with repeats per place)."""
    return [
        f"{cls.__name__}.{name}"
        for cls, node, _ in _nodes(stored)
        for name in _names(cls)
        if name not in node
    ]


def extra_keys(stored: dict) -> list[str]:
    """`Class.name` of each key a stored config has beyond today's schema."""
    return [
        f"{cls.__name__}.{key}" for cls, node, _ in _nodes(stored) for key in node if key not in _names(cls)
    ]


def _upgrade(node: dict, cls: type, prefix: str, refusals: list[Refusal]) -> None:
    names = _names(cls)
    for key in [k for k in node if k not in names]:
        change = REMOVED.get(f"{cls.__name__}.{key}")
        if change is None:
            continue
        value = node.pop(key)
        if change.value is not ANY and value != change.value:
            refusals.append(Refusal(prefix + key, value, change))
    for name in names:
        added = ADDED.get(f"{cls.__name__}.{name}")
        if name not in node and added is not None:
            node[name] = copy.deepcopy(added.value)
    for child_cls, child, path in _children(node, cls, prefix):
        _upgrade(child, child_cls, path, refusals)


def _nodes(node: dict, cls: type = schema.Config, prefix: str = ""):
    """(schema class, stored dict, dotted prefix) of `node` and of every dataclass stored below it."""
    yield cls, node, prefix
    for child_cls, child, path in _children(node, cls, prefix):
        yield from _nodes(child, child_cls, path)


def _children(node: dict, cls: type, prefix: str):
    """The stored dicts of `cls`'s dataclass-typed fields (a list of them: each item)."""
    for name, hint in typing.get_type_hints(cls).items():
        value, inner = node.get(name), _dataclass_in(hint)
        if inner is None or value is None:
            continue
        if isinstance(value, dict):
            yield inner, value, f"{prefix}{name}."
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    yield inner, item, f"{prefix}{name}.{i}."


def _dataclass_in(hint) -> type | None:
    """The schema dataclass a field holds: itself, in `X | None`, or as the items of `list[X]`."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]
