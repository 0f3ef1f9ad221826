"""A test user model (`model.factory`): the built-in GPT, whose forward on one rank blocks at one
step (MESHRUN_TEST_HANG="RANK:STEP"), or, with MESHRUN_TEST_SLOW=SECONDS, sleeps that long in every
forward on every rank (slow but progressing). MESHRUN_TEST_HANG_ONCE=PATH: block only while PATH
does not exist (created when blocking), so a restarted job runs through."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from meshrun.config import ModelConfig
from meshrun.launcher import progress
from meshrun.models.gpt import GPT


def block_here() -> None:
    """Where the stack report must point."""
    threading.Event().wait()


class HangingGPT(GPT):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hang := os.environ.get("MESHRUN_TEST_HANG"):
            rank, step = (int(v) for v in hang.split(":"))
            once = os.environ.get("MESHRUN_TEST_HANG_ONCE")
            here = int(os.environ["RANK"]) == rank and progress.current().step == step and self.training
            if here and (once is None or not Path(once).exists()):
                if once is not None:
                    Path(once).touch()
                block_here()
        if slow := os.environ.get("MESHRUN_TEST_SLOW"):
            time.sleep(float(slow))
        return super().forward(x)


def build(cfg: ModelConfig) -> HangingGPT:
    return HangingGPT(cfg)
