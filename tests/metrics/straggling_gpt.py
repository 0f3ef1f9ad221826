"""A test user model (`model.factory`): the built-in GPT, whose training forward on one rank sleeps
(MESHRUN_TEST_STRAGGLER="RANK:SECONDS"): a straggler the others must wait for. Same parameter
names and numerics as the plain GPT."""

from __future__ import annotations

import os
import time

import torch

from meshrun.config import ModelConfig
from meshrun.models.gpt import GPT


class StragglingGPT(GPT):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank, seconds = os.environ.get("MESHRUN_TEST_STRAGGLER", "-1:0").split(":")
        if self.training and int(os.environ["RANK"]) == int(rank):
            time.sleep(float(seconds))
        return super().forward(x)


def build(cfg: ModelConfig) -> StragglingGPT:
    return StragglingGPT(cfg)
