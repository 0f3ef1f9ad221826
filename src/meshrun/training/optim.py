"""AdamW with decoupled weight decay on matrices only, linear warmup and cosine decay."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from meshrun.config import TrainConfig


def build_optimizer(modules: Iterable[nn.Module], cfg: TrainConfig) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for module in modules:
        for param in module.parameters():
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in decay + no_decay) and len(decay + no_decay) > 0
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused or None)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier on cfg.lr for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
