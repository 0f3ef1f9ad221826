"""A GPT whose pipeline stage drops one layer's gradient: the broken layout `meshrun parity` must catch.

Used through `model.factory: dropped_grad_gpt:build`. In a launched worker (torchrun sets
WORLD_SIZE) the gradient of `blocks.1.mlp.fc.weight` is zeroed on its way back, as a stage that
lost a layer's gradient would; one process (no torchrun) trains the plain GPT.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT

DROPPED = "blocks.1.mlp.fc.weight"


class _DropGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


class DroppingLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _DropGrad.apply(self.weight), self.bias)


def build(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        model.get_submodule(DROPPED.removesuffix(".weight")).__class__ = DroppingLinear  # same parameters
    return model
