"""Mixed precision: autocast context and the fp16 loss scaler that all pipeline stages agree on."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from meshrun.config import Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.precision])


def make_scaler(cfg: Config, device: torch.device, group: dist.ProcessGroup | None) -> ShardedGradScaler | None:
    """fp16 only. The scaler all-reduces found_inf over `group` (the pipeline stages), so when
    one stage overflows every stage skips the same step and backs off the same scale."""
    if cfg.precision != "fp16":
        return None
    scaler = ShardedGradScaler(
        device.type, init_scale=cfg.amp.init_scale, growth_interval=cfg.amp.growth_interval, process_group=group
    )
    scaler.scale(torch.zeros((), device=device))  # creates the scale now: non-last stages never scale a loss
    return scaler
