"""A GPT that checks, before its final norm, that every rank holds the same hidden states: under
tensor parallelism without sequence parallel the residual stream is replicated over the tp ranks,
so their dropout must drop the same elements. Run with tp = world size (one tp group). Used
through `model.factory: tp_dropout_gpt:build`; same parameters and numerics as the plain GPT."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT


def _same_on_every_rank(module: nn.Module, inputs: tuple) -> None:
    (x,) = inputs
    copies = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, x.detach().contiguous())
    if not all(torch.equal(copies[0], c) for c in copies[1:]):
        raise RuntimeError("the tp ranks' hidden states differ before the final norm")


def build(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    model.norm.register_forward_pre_hook(_same_on_every_rank)  # before the replicated-input hook tp adds
    return model
