"""What the low-precision guide, Megatron-LM and TE forbid (the Megatron export checks only these):
names, the recipe's formats and fields, stability, the optimizer, sizes and shapes, TE's limits.
Every error is one line that names the options and the fix."""

from __future__ import annotations

from harness import recipes
from harness.backends import determinism
from harness.backends.capability import runs_on_te, te_blocker, te_installed_version
from harness.backends.te_env import conflicts as nvte_conflicts
from harness.backends.te_env import userbuffers_errors
from harness.backends.te_options import option_errors
from harness.config import schema
from harness.config.schema import Config, ModelConfig, OptimizerConfig, RecipeConfig, StabilityConfig
from harness.data import SOURCES
from harness.interop.hf_tokenizer import run_offers
from harness.model.objective import config_errors as objective_errors
from harness.model.plan import OVERRIDE_FIELDS
from harness.validation.moe_rules import moe_errors, moe_name_errors
from harness.validation.recipe_fields import field_errors, value_names, wgrad_conflicts

NAMES = {
    "recipe.name": recipes.names(),
    "recipe.fp8": (None, *schema.FP8_FORMATS),
    "recipe.fp4": (None, *schema.FP4_FORMATS),
    "recipe.fp8_amax_compute_algo": ("max", "most_recent"),
    "recipe.fp8_fast_accumulation": schema.FP8_FAST_ACCUMULATION,
    "recipe.int4_scope": schema.INT4_SCOPES,
    **value_names(),
    "optimizer.main_grads_dtype": ("fp32", "bf16"),
    "optimizer.main_params_dtype": ("fp32", "fp16"),
    "optimizer.exp_avg_dtype": schema.STATE_DTYPES,
    "optimizer.exp_avg_sq_dtype": schema.STATE_DTYPES,
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.position_embedding": ("learned", "rope"),
    "data.name": tuple(SOURCES),
    "data.token_dtype": ("uint16", "uint32"),
    "backend.name": ("te", "emulated", "auto"),
    "logger.name": ("wandb", "none"),
    "logger.wandb.mode": ("offline", "online", "disabled"),
    "resume": schema.RESUME_MODES,
    "parallel.strategy": schema.PARALLEL_STRATEGIES,
    "parallel.backend": ("auto", "gloo", "nccl"),
    "objective.name": schema.OBJECTIVES,
}


def _get(cfg: Config, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def world_size() -> int:
    """Ranks of the job this process belongs to (torchrun's WORLD_SIZE, or a Slurm step's tasks)."""
    from harness.parallel.process import launch_env

    return launch_env().world_size


def te_version(cfg: Config) -> tuple[str, str]:
    """(version, where it came from): the installed TE, else backend.te_version."""
    installed = te_installed_version()
    if installed:
        return installed, "installed transformer_engine"
    return cfg.backend.te_version, "backend.te_version"


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def uses_te(cfg: Config) -> bool:
    """backend=te, or auto on a machine where it would resolve to te."""
    blocked = te_blocker(cfg.recipe, cfg.stability, cfg.model)
    return runs_on_te(cfg.backend.name, cfg.recipe.name, cfg.hardware.name, blocked)


def _quantized_dims(cfg: Config) -> dict[str, int]:
    m = cfg.model
    f = m.ffn_hidden_size
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    head_dim = m.kv_channels or m.hidden_size // heads
    return {
        "model.hidden_size": m.hidden_size,
        "model.ffn_hidden_size": f,
        "model.kv_channels*num_attention_heads": heads * head_dim,
        "(num_attention_heads+2*num_query_groups)*kv_channels": (heads + 2 * groups) * head_dim,
        "micro_batch_size*model.seq_length": cfg.micro_batch_size * m.seq_length,
    }


def _attention_errors(m: schema.ModelConfig) -> list[str]:
    """Heads, query groups (GQA) and head size (kv_channels) that make an attention layer."""
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads != 0:
        return [
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}: change one of them (or set model.kv_channels)"
        ]
    groups, head_dim = m.num_query_groups, m.kv_channels or m.hidden_size // m.num_attention_heads
    if groups is not None and (groups < 1 or m.num_attention_heads % groups):
        return [
            f"model.num_query_groups={groups}: must divide model.num_attention_heads="
            f"{m.num_attention_heads} (each key/value head serves a whole group of query heads)"
        ]
    if m.kv_channels is not None and m.kv_channels < 1:
        return [f"model.kv_channels={m.kv_channels}: must be >= 1 (or null for hidden/heads)"]
    if m.position_embedding == "rope" and head_dim % 2:
        return [f"model.position_embedding=rope needs an even head size, not {head_dim} (model.kv_channels)"]
    return _rope_scaling_errors(m)


def _rope_scaling_errors(m: schema.ModelConfig) -> list[str]:
    """Llama 3.1's RoPE scaling: only with RoPE, factor >= 1, 0 < low < high, a positive context."""
    if not m.rope_scaling:
        return []
    if m.position_embedding != "rope":
        return [f"model.rope_scaling=true needs model.position_embedding=rope, not {m.position_embedding}"]
    if m.rope_scaling_factor < 1:
        return [f"model.rope_scaling_factor={m.rope_scaling_factor}: must be >= 1 (Llama 3.1: 8)"]
    if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        return [
            f"model.rope_low_freq_factor={m.rope_low_freq_factor}, model.rope_high_freq_factor="
            f"{m.rope_high_freq_factor}: need 0 < low < high (Llama 3.1: 1 and 4)"
        ]
    if (n := m.rope_original_max_position_embeddings) < 1:
        return [f"model.rope_original_max_position_embeddings={n}: must be >= 1 (Llama 3.1: 8192)"]
    return []


def name_errors(cfg: Config) -> list[str]:
    if cfg.recipe.name in recipes.LEGACY:
        return [recipes.legacy_message(cfg.recipe.name)]
    return [
        _unknown(key, _get(cfg, key), allowed)
        for key, allowed in NAMES.items()
        if _get(cfg, key) not in allowed
    ] + moe_name_errors(cfg.model)


def _unknown(key: str, value, allowed: tuple) -> str:
    return f"{key}={value}: unknown; choose one of {[a for a in allowed if a is not None]}"


def _recipe_errors(r: RecipeConfig) -> list[str]:
    """The recipe's formats and fields, as its registry spec states them."""
    spec, errs = recipes.get(r.name), []
    if r.fp8 and r.fp4:
        errs.append(
            f"recipe.fp8={r.fp8} and recipe.fp4={r.fp4}: FP8 and FP4 are mutually exclusive; "
            "set one of them to null"
        )
    if spec.fp8_family and not r.fp8:
        errs.append(
            f"recipe={r.name} needs recipe.fp8 (e4m3 or hybrid): Megatron given --fp8-recipe without "
            "--fp8-format silently trains BF16; set recipe.fp8=e4m3"
        )
    if spec.fp4_family and r.fp4 != "e2m1":
        errs.append(f"recipe={r.name} needs recipe.fp4=e2m1: set recipe.fp4=e2m1")
    if not spec.quantizes_gemms and (r.fp8 or r.fp4):
        errs.append(
            f"recipe={r.name} with recipe.fp8={r.fp8} recipe.fp4={r.fp4}: {r.name} runs BF16 GEMMs; "
            "set recipe.fp8=null recipe.fp4=null or pick an FP8/FP4 recipe"
        )
    if spec.needs_factory and not r.quantizer_factory:
        errs.append(
            f"recipe={r.name} needs recipe.quantizer_factory=module:function (your quantizer factory)"
        )
    if spec.needs_factory and not (r.fp8 or r.fp4):
        errs.append(f"recipe={r.name} needs recipe.fp8 or recipe.fp4 (which format the factory emits)")
    if r.fp8_amax_history_len < 1:
        errs.append(f"recipe.fp8_amax_history_len={r.fp8_amax_history_len}: must be >= 1")
    for key in ("x_block_dim", "w_block_dim", "grad_block_dim"):
        if getattr(r, key) not in (1, 2):
            errs.append(f"recipe.{key}={getattr(r, key)}: use 1 (1x128 blocks) or 2 (128x128 tiles)")
    if r.int4_group_size < 1:
        errs.append(f"recipe.int4_group_size={r.int4_group_size}: must be a positive group size, e.g. 128")
    return errs + field_errors(r)


def _stability_errors(s: StabilityConfig, r: RecipeConfig, m: ModelConfig) -> list[str]:
    errs = []
    if s.first_last_layers_bf16 and not recipes.get(r.name).first_last_bf16_ok:
        errs.append(
            f"stability.first_last_layers_bf16=true with recipe={r.name}: Megatron rejects BF16 first/last "
            "layers under delayed scaling; use recipe=tensorwise (or blockwise/mxfp8) or drop the knob"
        )
    if s.first_last_layers_bf16:
        start, end = s.num_layers_at_start_in_bf16, s.num_layers_at_end_in_bf16
        for key, n in (("num_layers_at_start_in_bf16", start), ("num_layers_at_end_in_bf16", end)):
            if n < 0:
                errs.append(f"stability.{key}={n}: a layer count, must be >= 0 (0 = none at that end)")
        if min(start, end) >= 0 and start + end > m.num_layers:
            errs.append(
                f"stability.num_layers_at_start_in_bf16={start} + num_layers_at_end_in_bf16={end} "
                f"exceeds model.num_layers={m.num_layers}: Megatron checks each count alone and would "
                f"keep every block BF16; lower them so that their sum is at most {m.num_layers}"
            )
    errs += wgrad_conflicts(r, s)
    for ov in s.overrides:
        errs += _override_errors(ov)
        if ov.resolved is not None and ov.resolved is not r:
            errs += wgrad_conflicts(ov.resolved, s, f"stability.overrides pattern={ov.pattern}: ")
    return errs


def _override_errors(ov: schema.ModuleOverride) -> list[str]:
    """A stability override's recipe and fields, checked as the run's own recipe.* is."""
    where = f"stability.overrides pattern={ov.pattern}"
    if ov.recipe in recipes.LEGACY:
        return [recipes.legacy_message(ov.recipe, where=f"{where} recipe")]
    if ov.recipe not in recipes.names():
        return [f"{where} recipe={ov.recipe}: unknown; use bf16 or one of {list(recipes.names())}"]
    bad = [k for k in ov.fields if k not in OVERRIDE_FIELDS]
    if bad:
        return [
            f"{where} fields.{bad[0]}: no such recipe field; use fields of conf/recipe/{ov.recipe}.yaml "
            "(lowp-train --cfg job lists them)"
        ]
    if ov.resolved is None:
        return []
    errs = [f"{where}: {e}" for e in _recipe_errors(ov.resolved)]
    for key, allowed in NAMES.items():
        field = key.removeprefix("recipe.")
        if field != key and field != "name" and getattr(ov.resolved, field) not in allowed:
            errs.append(f"{where} {_unknown(f'fields.{field}', getattr(ov.resolved, field), allowed)}")
    return errs


def _optimizer_errors(o: OptimizerConfig, r: RecipeConfig) -> list[str]:
    spec, errs = recipes.get(r.name), []
    low_states = [
        k
        for k in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype", "main_params_dtype")
        if getattr(o, k) != "fp32"
    ]
    if low_states and not o.use_precision_aware_optimizer:
        errs.append(
            f"optimizer.{low_states[0]}={getattr(o, low_states[0])} needs the precision-aware optimizer: "
            "set optimizer.use_precision_aware_optimizer=true"
        )
    if o.optimizer_cpu_offload and not spec.cpu_offload_ok and spec.fp8_family:
        errs.append(
            f"optimizer.optimizer_cpu_offload=true with recipe={r.name}: only delayed scaling supports "
            "optimizer CPU offload (Megatron refuses it only with --fp8-param-gather and otherwise "
            "runs it unsupported); use recipe=delayed or optimizer.optimizer_cpu_offload=false"
        )
    elif o.optimizer_cpu_offload and not spec.cpu_offload_ok:
        errs.append(
            f"optimizer.optimizer_cpu_offload=true with recipe={r.name}: not supported by Megatron; "
            "use recipe=delayed or optimizer.optimizer_cpu_offload=false"
        )
    if o.fp8_param and not spec.quantizes_gemms:
        errs.append(
            f"optimizer.fp8_param=true with recipe={r.name}: there is no quantized weight to keep; "
            "pick an FP8/FP4 recipe or set optimizer.fp8_param=false"
        )
    return errs


def _size_errors(cfg: Config) -> list[str]:
    errs, m = [], cfg.model
    tokens = cfg.micro_batch_size * m.seq_length
    if not 0 <= m.lm_head_loss_chunks <= tokens:
        errs.append(
            f"model.lm_head_loss_chunks={m.lm_head_loss_chunks}: use 0 (whole logits) or 1..{tokens} "
            "(the tokens of a micro-batch)"
        )
    if cfg.micro_batch_size >= 1 and cfg.global_batch_size % (cfg.micro_batch_size * world_size()) != 0:
        errs.append(
            f"global_batch_size={cfg.global_batch_size} is not a multiple of micro_batch_size="
            f"{cfg.micro_batch_size} x {world_size()} ranks: make it one"
        )
    for key in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "seq_length",
        "vocab_size",
    ):
        if getattr(m, key) < 1:
            errs.append(f"model.{key}={getattr(m, key)}: must be >= 1")
    for key in ("micro_batch_size", "global_batch_size"):
        if getattr(cfg, key) < 1:
            errs.append(f"{key}={getattr(cfg, key)}: must be >= 1")
    return errs


def config_vocab(d: schema.DataConfig, m: ModelConfig) -> int | None:
    """The data's vocabulary where the config alone sets it, for the sources that draw their own ids
    (markov, synthetic): data.vocab_size, else the model's; None where files or a tokenizer decide."""
    if d.name not in ("markov", "synthetic"):
        return None
    return d.vocab_size if d.vocab_size is not None else m.vocab_size


def _objective_errors(cfg: Config) -> list[str]:
    """The objective's fields, and its mask token where the data's vocabulary is known from the config
    (from a Hugging Face model's tokenizer where it offers one: harness/interop/hf_tokenizer.py)."""
    data_vocab = config_vocab(cfg.data, cfg.model)
    try:
        offers = run_offers(cfg.objective, cfg.model.hf_config, cfg.init_from) if data_vocab else []
    except ValueError as exc:
        return [str(exc)]
    return objective_errors(cfg.objective, data_vocab, cfg.model.vocab_size, offers)


def _shape_errors(cfg: Config) -> list[str]:
    errs = _attention_errors(cfg.model) + moe_errors(cfg)
    errs += _objective_errors(cfg)
    if cfg.backend.deterministic:
        errs += determinism.option_errors(cfg.model.cross_entropy_loss_fusion) + determinism.env_errors()
    if cfg.steps < 1:
        errs.append(f"steps={cfg.steps}: must be >= 1")
    return errs


def legality_errors(cfg: Config) -> list[str]:
    """What the guide, Megatron and TE forbid. Each item is a one-line message; a group of rules
    runs only where the ones before it found nothing its checks rely on (names, then sizes)."""
    errs = name_errors(cfg)
    if errs:
        return errs
    r, s, o, m = cfg.recipe, cfg.stability, cfg.optimizer, cfg.model
    errs = _recipe_errors(r)
    errs += _stability_errors(s, r, m) + _optimizer_errors(o, r) + _size_errors(cfg)
    if errs:
        return errs
    errs = _shape_errors(cfg)
    errs += option_errors(r, m, cfg.hardware, uses_te(cfg))
    for ov in s.overrides:  # a module's own recipe under the same TE rules
        if ov.resolved is not None and ov.resolved is not r:
            errs += [
                f"stability.overrides pattern={ov.pattern}: {e}"
                for e in option_errors(ov.resolved, m, cfg.hardware, uses_te(cfg))
            ]
    if uses_te(cfg):
        errs += _te_errors(cfg)
    return errs


def _te_errors(cfg: Config) -> list[str]:
    r, hw, s = cfg.recipe, cfg.hardware, cfg.stability
    if hw.name == "cpu":
        return ["backend=te with hardware=cpu: Transformer Engine needs a CUDA GPU; use backend=emulated"]
    spec, cc = recipes.get(r.name), hw.compute_capability
    errs: list[str] = []
    if spec.quantizes_gemms and spec.min_cc is not None and cc is not None and cc < spec.min_cc:
        arch = " (Blackwell)" if spec.min_cc >= 10.0 else ""
        errs.append(
            f"recipe={r.name} with backend=te on hardware={hw.name} (compute capability {cc}): TE needs "
            f"compute capability >= {spec.min_cc}{arch}: Megatron accepts the flags and TE stops at the "
            "first autocast; use backend=emulated or hardware=b200"
        )
    elif (
        spec.quantizes_gemms
        and not spec.needs_factory
        and hw.native_recipes
        and r.name not in hw.native_recipes
    ):
        errs.append(
            f"recipe={r.name} with backend=te on hardware={hw.name}: that GPU has no native {r.name}; "
            f"use backend=emulated or one of {list(hw.native_recipes)}"
        )
    errs += _te_version_errors(cfg, spec)
    if not s.fp8_wgrad and not spec.te_high_precision_backward_ok:
        errs.append(
            f"stability.fp8_wgrad=false with recipe={r.name} and backend=te: TE 2.x ignores Megatron's "
            "--no-fp8-wgrad (Megatron would silently keep the wgrad GEMM in FP8) and forbids its "
            "high-precision backward under delayed scaling; use "
            "recipe=tensorwise, or backend=emulated (wgrad GEMM only)"
        )
    elif (blocked := te_blocker(r, s, cfg.model)) is not None:
        errs.append(f"backend=te with {blocked}; use backend=emulated (or backend=auto, which picks it)")
    if spec.quantizes_gemms:
        n = spec.gemm_multiple
        for key, dim in _quantized_dims(cfg).items():
            if dim % n:
                errs.append(
                    f"{key}={dim} is not divisible by {n}, which recipe={r.name} GEMMs need on "
                    f"backend=te: make it a multiple of {n}"
                )
    return errs + nvte_conflicts(r) + userbuffers_errors(cfg.model.activation)


def _te_version_errors(cfg: Config, spec: recipes.RecipeSpec) -> list[str]:
    """The recipe's oldest TE (any FP4 format needs NVFP4's)."""
    need = spec.min_te or (recipes.fp4_min_te() if cfg.recipe.fp4 else None)
    if need is None:
        return []
    version, source = te_version(cfg)
    if _version_tuple(version) >= _version_tuple(need):
        return []
    what = f"recipe={cfg.recipe.name}" if spec.min_te else f"recipe.fp4={cfg.recipe.fp4}"
    return [
        f"{what} needs Transformer Engine >= {need} ({source} is {version}): upgrade TE or use an FP8 recipe"
    ]
