"""AdamW with warm-up and cosine decay, gradient clipping; fp32 master weights are the parameters."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from harness.config.schema import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (and embeddings, as nanoGPT does); never biases or norm weights."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps}
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Linear warm-up to lr over warmup_steps, then cosine decay to min_lr at total_steps."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global grad norm as a device tensor (no host sync); clipped in place when max_norm > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in params])
