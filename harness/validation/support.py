"""What lowp itself cannot run yet, and the data-parallel rules, checked on every rank before any
process group or model exists (each lifted by the issue that implements it)."""

from __future__ import annotations

from harness import recipes
from harness.config.schema import Config
from harness.validation.legality import uses_te, world_size
from harness.validation.moe_rules import moe_support_errors


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
    return errs + moe_support_errors(cfg, te) + _in_backward_errors(cfg) + parallel_errors(cfg)


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
