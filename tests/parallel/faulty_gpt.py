"""A GPT whose embedding output gradient becomes inf once, to force an fp16 overflow in one stage.

Used through `model.factory: faulty_gpt:build`. MESHRUN_TEST_INF_AT=k poisons the k-th
backward through the embedding (1-based, counted per process); with MESHRUN_TEST_INF_RANK=r,
only on global rank r (an overflow one tensor-parallel rank sees alone).
"""

from __future__ import annotations

import os

import torch

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT, Embedding

_calls = {"backward": 0}


class _PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        _calls["backward"] += 1
        if os.environ.get("MESHRUN_TEST_LOG_CALLS"):
            print(f"poison-backward {_calls['backward']}", flush=True)
        rank = os.environ.get("MESHRUN_TEST_INF_RANK")
        here = rank is None or rank == os.environ.get("RANK", "0")
        if here and _calls["backward"] == int(os.environ.get("MESHRUN_TEST_INF_AT", "0")):
            return grad * float("inf")
        return grad


class PoisonedEmbedding(Embedding):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _PoisonGrad.apply(super().forward(idx))


def build(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    model.embed = PoisonedEmbedding(cfg)  # same parameter names as the plain GPT
    return model
