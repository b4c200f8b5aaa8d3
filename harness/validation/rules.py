"""Validation before any work: the low-precision guide's rules, TE's limits and lowp's own support.

Every error is one line that names the options and the fix (exit code 2 at the entry point);
warnings where the guide only recommends. `legality_errors` is what the guide and TE forbid (the
Megatron export checks only these); `support_errors` is what lowp cannot run yet.
"""

from __future__ import annotations

import dataclasses
import warnings

from harness import recipes
from harness.backends.capability import runs_on_te, te_installed_version
from harness.backends.te_env import conflicts as nvte_conflicts
from harness.backends.te_env import userbuffers_errors
from harness.backends.te_options import option_errors, option_warnings
from harness.config import schema
from harness.config.errors import ConfigError, ConfigWarning  # noqa: F401 - re-exported
from harness.config.schema import Config, ModelConfig, OptimizerConfig, RecipeConfig, StabilityConfig
from harness.validation.megatron_rules import reference_errors

NAMES = {
    "recipe.name": recipes.names(),
    "recipe.fp8": (None, *schema.FP8_FORMATS),
    "recipe.fp4": (None, *schema.FP4_FORMATS),
    "recipe.fp8_amax_compute_algo": ("max", "most_recent"),
    "recipe.fp8_fast_accumulation": schema.FP8_FAST_ACCUMULATION,
    "optimizer.main_grads_dtype": ("fp32", "bf16"),
    "optimizer.main_params_dtype": ("fp32", "fp16"),
    "optimizer.exp_avg_dtype": schema.STATE_DTYPES,
    "optimizer.exp_avg_sq_dtype": schema.STATE_DTYPES,
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.position_embedding": ("learned", "rope"),
    "data.name": ("synthetic", "markov", "stdlib_bytes", "memmap", "megatron"),
    "data.token_dtype": ("uint16", "uint32"),
    "backend.name": ("te", "emulated", "auto"),
    "logger.name": ("wandb", "none"),
    "logger.wandb.mode": ("offline", "online", "disabled"),
    "resume": schema.RESUME_MODES,
    "parallel.strategy": schema.PARALLEL_STRATEGIES,
    "parallel.backend": ("auto", "gloo", "nccl"),
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
    return runs_on_te(cfg.backend.name, cfg.recipe.name, cfg.hardware.name)


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


def _name_errors(cfg: Config) -> list[str]:
    if cfg.recipe.name in recipes.LEGACY:
        return [recipes.legacy_message(cfg.recipe.name)]
    errs = []
    for key, allowed in NAMES.items():
        if _get(cfg, key) not in allowed:
            shown = [a for a in allowed if a is not None]
            errs.append(f"{key}={_get(cfg, key)}: unknown; choose one of {shown}")
    return errs


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
    return errs


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
    return errs + [e for ov in s.overrides for e in _override_errors(ov)]


def _override_errors(ov: schema.ModuleOverride) -> list[str]:
    """A stability override's recipe and fields, checked as the run's own recipe.* is."""
    where = f"stability.overrides pattern={ov.pattern}"
    if ov.recipe in recipes.LEGACY:
        return [recipes.legacy_message(ov.recipe, where=f"{where} recipe")]
    if ov.recipe not in recipes.names():
        return [f"{where} recipe={ov.recipe}: unknown; use bf16 or one of {list(recipes.names())}"]
    known = {f.name for f in dataclasses.fields(RecipeConfig)} - {"name"}
    bad = [k for k in ov.fields if k not in known]
    if bad:
        return [
            f"{where} fields.{bad[0]}: no such recipe field; use fields of conf/recipe/{ov.recipe}.yaml "
            "(python -m harness.train --cfg job lists them)"
        ]
    if ov.resolved is None:
        return []
    errs = [f"{where}: {e}" for e in _recipe_errors(ov.resolved)]
    for key, allowed in NAMES.items():
        if key.startswith("recipe.") and key != "recipe.name":
            value = getattr(ov.resolved, key.split(".", 1)[1])
            if value not in allowed:
                errs.append(
                    f"{where} fields.{key.split('.', 1)[1]}={value}: unknown; choose one of "
                    f"{[a for a in allowed if a is not None]}"
                )
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


def _shape_errors(cfg: Config) -> list[str]:
    errs = _attention_errors(cfg.model)
    if cfg.steps < 1:
        errs.append(f"steps={cfg.steps}: must be >= 1")
    return errs


def legality_errors(cfg: Config) -> list[str]:
    """What the guide, Megatron and TE forbid. Each item is a one-line message; a group of rules
    runs only where the ones before it found nothing its checks rely on (names, then sizes)."""
    errs = _name_errors(cfg)
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


def support_errors(cfg: Config) -> list[str]:
    """What lowp itself cannot run yet (each lifted by the issue that implements it)."""
    errs = []
    o, r = cfg.optimizer, cfg.recipe
    te = uses_te(cfg)
    if not o.master_weights and not te:
        errs.append(
            "optimizer.master_weights=false with backend=emulated: not supported yet (the emulated "
            "backend keeps fp32 master weights); use backend=te or optimizer.master_weights=true"
        )
    if not o.master_weights and (o.use_precision_aware_optimizer or o.fp8_param or o.optimizer_cpu_offload):
        errs.append(
            "optimizer.master_weights=false with the precision-aware optimizer, fp8_param or CPU "
            "offload: those keep master weights; set optimizer.master_weights=true"
        )
    if te and recipes.get(r.name).full_master and (not o.master_weights or o.optimizer_cpu_offload):
        errs.append(
            f"recipe={r.name} with backend=te keeps the fake-quantized weights in the bf16 params and "
            "the real ones in TE FusedAdam's master weights: set optimizer.master_weights=true and "
            "optimizer.optimizer_cpu_offload=false"
        )
    return errs + _in_backward_errors(cfg) + parallel_errors(cfg)


def _in_backward_errors(cfg: Config) -> list[str]:
    """optimizer.step_in_backward: a torch AdamW step per parameter, so nothing global in the step."""
    o = cfg.optimizer
    if not o.step_in_backward:
        return []
    why = []
    if uses_te(cfg) and o.master_weights:
        why.append(
            "backend=te keeps fp32 masters in TE FusedAdam, which steps all tensors at once: set "
            "optimizer.master_weights=false (optimizer=bf16_params)"
        )
    if o.use_precision_aware_optimizer or o.optimizer_cpu_offload:
        why.append(
            "the precision-aware and CPU-offload optimizers step all tensors at once: set "
            "optimizer.use_precision_aware_optimizer=false and optimizer.optimizer_cpu_offload=false"
        )
    if o.clip_grad > 0:
        why.append(
            f"optimizer.clip_grad={o.clip_grad} needs the global grad norm before any update: set "
            "optimizer.clip_grad=0"
        )
    accumulation = cfg.global_batch_size // max(cfg.micro_batch_size * world_size(), 1)
    if accumulation != 1:
        why.append(
            f"{accumulation} micro-batches a step would update after the first: set global_batch_size = "
            "micro_batch_size"
        )
    if world_size() > 1 or cfg.parallel.strategy != "none":
        why.append("data parallelism reduces the gradients after backward: use one process, parallel=none")
    return [f"optimizer.step_in_backward=true: {w}" for w in why]


def parallel_errors(cfg: Config) -> list[str]:
    """The data-parallel rules, checked on every rank before any process group or model exists."""
    p, o, world = cfg.parallel, cfg.optimizer, world_size()
    errs: list[str] = []
    if p.strategy == "none" and world > 1:
        errs.append(
            f"parallel=none with {world} ranks (WORLD_SIZE/SLURM_NTASKS): every rank would train alone; "
            "use parallel=ddp or parallel=fsdp2"
        )
    if p.timeout_s <= 0:
        errs.append(f"parallel.timeout_s={p.timeout_s}: must be > 0 (seconds a collective may wait)")
    if p.backend == "nccl" and cfg.hardware.name == "cpu":
        errs.append(
            "parallel.backend=nccl with hardware=cpu: NCCL needs GPUs; use parallel.backend=gloo or auto"
        )
    if p.strategy == "fsdp2":
        if o.optimizer_cpu_offload:
            errs.append(
                "parallel=fsdp2 with optimizer.optimizer_cpu_offload=true: not supported; "
                "use parallel=ddp or optimizer.optimizer_cpu_offload=false"
            )
        if o.use_precision_aware_optimizer and not uses_te(cfg):
            errs.append(
                "parallel=fsdp2 with the precision-aware optimizer on backend=emulated: its main-grad "
                "hooks need whole gradients; use parallel=ddp (optimizer.use_distributed_optimizer=true "
                "shards its states there)"
            )
        if uses_te(cfg) and o.master_weights and o.main_grads_dtype == "fp32":
            errs.append(
                "parallel=fsdp2 with backend=te and fp32 main grads: TE's fused wgrad accumulation "
                "writes whole main_grad buffers that FSDP2 does not shard; set "
                "optimizer.main_grads_dtype=bf16 (with the precision-aware optimizer) or use parallel=ddp"
            )
    return errs


def recommendations(cfg: Config) -> list[str]:
    """Warnings: what the guide recommends but does not require."""
    r, s, o, m = cfg.recipe, cfg.stability, cfg.optimizer, cfg.model
    out = []
    spec = recipes.get(r.name)
    if spec.recommends_grad_buf_reuse and o.fp8_param and not o.reuse_grad_buf_for_mxfp8_param_ag:
        out.append(
            f"recipe={r.name} with optimizer.fp8_param=true: the guide strongly recommends "
            "optimizer.reuse_grad_buf_for_mxfp8_param_ag=true"
        )
    if s.fp8_margin and not spec.margin_applies:
        out.append(
            f"stability.fp8_margin={s.fp8_margin} has no effect on recipe={r.name} "
            "(TE applies the margin only in delayed scaling)"
        )
    if (
        s.first_last_layers_bf16
        and spec.scheme is not None
        and (s.num_layers_at_start_in_bf16 + s.num_layers_at_end_in_bf16 == m.num_layers)
    ):
        out.append(f"stability: all {m.num_layers} blocks are BF16, so recipe={r.name} quantizes nothing")
    if spec.fp4_family and not s.first_last_layers_bf16:
        out.append(
            f"recipe={r.name} without stability.first_last_layers_bf16: the guide advises BF16 "
            "first/last layers for FP4 (NVFP4 diverges if every linear layer is FP4)"
        )
    out += option_warnings(r, m, cfg.backend, uses_te(cfg))
    if not s.fp8_wgrad and uses_te(cfg):
        out.append(
            "stability.fp8_wgrad=false on backend=te maps to TE's high-precision backward, which "
            "also keeps dgrad in high precision (recorded in run.json)"
        )
    if not s.fp8_wgrad and r.fp8_fast_accumulation == "all":
        out.append(
            "recipe.fp8_fast_accumulation=all has no effect on the backward GEMMs with "
            "stability.fp8_wgrad=false: TE's high-precision backward runs dgrad and wgrad in BF16; "
            "use recipe.fp8_fast_accumulation=fprop for that run"
        )
    return out


def run_errors(cfg: Config) -> list[str]:
    """Out-of-range numbers of the run-level keys, the schedule and the divergence rule."""
    o, d = cfg.optimizer, cfg.divergence
    checks = [
        ("optimizer.lr", o.lr, o.lr > 0, "use a positive learning rate, e.g. optimizer.lr=3e-3"),
        (
            "optimizer.min_lr",
            o.min_lr,
            0 <= o.min_lr,
            "use optimizer.min_lr >= 0 (min_lr <= lr is the Megatron rule in reference_rules)",
        ),
        ("optimizer.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, "use 0 or more warm-up steps"),
        ("optimizer.clip_grad", o.clip_grad, o.clip_grad >= 0, "use 0 (off) or a positive norm, e.g. 1.0"),
        (
            "optimizer.weight_decay",
            o.weight_decay,
            o.weight_decay >= 0,
            "use 0 or a positive decay, e.g. 0.1",
        ),
        ("optimizer.eps", o.eps, o.eps > 0, "use a positive epsilon, e.g. 1e-8"),
        (
            "optimizer.betas",
            o.betas,
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
            "use two values in [0, 1), e.g. [0.9,0.95]",
        ),
        ("log_interval", cfg.log_interval, cfg.log_interval >= 1, "use log_interval>=1"),
        ("eval_interval", cfg.eval_interval, cfg.eval_interval >= 0, "use 0 (only at the end) or more steps"),
        ("eval_tokens", cfg.eval_tokens, cfg.eval_tokens >= 0, "use 0 (no eval) or a token budget"),
        ("telemetry_interval", cfg.telemetry_interval, cfg.telemetry_interval >= 0, "use 0 (off) or more"),
        (
            "checkpoint_interval",
            cfg.checkpoint_interval,
            cfg.checkpoint_interval is None or cfg.checkpoint_interval >= -1,
            "use null (every 10%), 0 (only at the end), -1 (never) or a number of steps",
        ),
        ("checkpoint_keep", cfg.checkpoint_keep, cfg.checkpoint_keep >= 1, "keep at least 1 checkpoint"),
        ("bench_warmup_steps", cfg.bench_warmup_steps, cfg.bench_warmup_steps >= 0, "use 0 or more"),
        ("divergence.patience", d.patience, d.patience >= 1, "use divergence.patience>=1"),
        (
            "divergence.loss_spike_factor",
            d.loss_spike_factor,
            d.loss_spike_factor == 0 or d.loss_spike_factor > 1,
            "use 0 (no spike check) or a factor above 1, e.g. 2.0",
        ),
        ("data.num_tokens", cfg.data.num_tokens, cfg.data.num_tokens >= 1, "use a positive token count"),
    ]
    return [f"{key}={value}: out of range; {fix}" for key, value, ok, fix in checks if not ok]


def unknown_keys(tree: dict, schema_cls: type = Config, prefix: str = "") -> list[str]:
    """Dotted keys of a composed config that name no field of the schema (a mistyped `+key=value`
    would otherwise be carried along and silently ignored)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema_cls)
    fields = {f.name for f in dataclasses.fields(schema_cls)}
    out = []
    for key, value in tree.items():
        if not prefix and key == "hydra":
            continue
        if key not in fields:
            out.append(prefix + str(key))
        elif isinstance(value, dict) and dataclasses.is_dataclass(hints[key]):
            out += unknown_keys(value, hints[key], f"{prefix}{key}.")
    return out


def check_known_keys(dcfg) -> None:
    """Raise ConfigError (one line) for the first key that is not a config field."""
    from omegaconf import OmegaConf

    unknown = unknown_keys(OmegaConf.to_container(dcfg, resolve=False))
    if unknown:
        key = unknown[0]
        parent = key.rpartition(".")[0]
        raise ConfigError(
            f"{key}: no such config field{f' in {parent}' if parent else ''}; check the spelling "
            "(python -m harness.train --cfg job lists every field), or put free-form tags under extras.<name>"
        )


def validate(cfg: Config, *, for_export: bool = False) -> list[str]:
    """Raise ConfigError on the first problem; return (and emit) the warnings."""
    errs = legality_errors(cfg)
    if not errs:
        errs += run_errors(cfg)  # out-of-range numbers before the rules that compare them
    if not _name_errors(cfg):  # the reference rules ask the registry about the names
        errs += reference_errors(cfg)  # then what Megatron-LM and TE refuse
    if not for_export:
        errs += support_errors(cfg)
    if errs:
        raise ConfigError(errs[0])
    notes = recommendations(cfg)
    for note in notes:
        warnings.warn(note, ConfigWarning, stacklevel=2)
    return notes
