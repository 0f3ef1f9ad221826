"""A GPT whose blocks take a fixed time in forward and backward (they sleep), so a pipeline's
timing is set by the schedule, not by how busy the shared CPU is. Used through
`model.factory: slow_gpt:build`; same parameter names and numerics as the plain GPT."""

from __future__ import annotations

import time

import torch
from torch import nn

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT, Block

FORWARD_S, BACKWARD_S = 0.02, 0.04  # per block: backward about twice the forward, as in real models


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_S)
        return grad


class SlowBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return _SlowBackward.apply(super().forward(x))


def build(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    model.blocks = nn.ModuleDict({key: SlowBlock(cfg) for key in model.blocks})
    return model
