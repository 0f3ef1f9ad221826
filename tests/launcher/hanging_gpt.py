"""A test user model (`model.factory`): the built-in GPT, which on one rank blocks at one step
(MESHRUN_TEST_HANG="RANK:STEP" in its forward, "RANK:STEP:backward" in its backward, "RANK:0" in
its weight initialisation, before step 1), or, with MESHRUN_TEST_SLOW=SECONDS, sleeps that long in
every forward on every rank (slow but progressing). MESHRUN_TEST_HANG_ONCE=PATH: block only while
PATH does not exist (created when blocking), so a restarted job runs through.
MESHRUN_TEST_SPOIL_REPORTS=PATH: just before blocking, put a file at PATH (the run's hang folder),
where no report can then be written."""

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
    if spoil := os.environ.get("MESHRUN_TEST_SPOIL_REPORTS"):
        Path(spoil).write_text("not a folder\n")
    threading.Event().wait()


def hangs_here(step: int, where: str) -> bool:
    """Whether this rank blocks now, at `step` (0: initialisation) in `where` (forward, backward)."""
    hang = os.environ.get("MESHRUN_TEST_HANG")
    if not hang:
        return False
    rank, at, *phase = hang.split(":")
    wanted = phase[0] if phase else "init" if int(at) == 0 else "forward"
    here = (int(rank), int(at), wanted) == (int(os.environ.get("RANK", "0")), step, where)  # one process: 0
    once = os.environ.get("MESHRUN_TEST_HANG_ONCE")
    if here and once is not None:
        if Path(once).exists():
            return False
        Path(once).touch()
    return here


class HangingGPT(GPT):
    def init_weights(self, seed: int) -> None:
        if hangs_here(0, "init"):
            block_here()
        super().init_weights(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = progress.current().step
        if self.training and hangs_here(step, "forward"):
            block_here()
        if slow := os.environ.get("MESHRUN_TEST_SLOW"):
            time.sleep(float(slow))
        output = super().forward(x)
        if self.training and output.requires_grad and hangs_here(step, "backward"):
            output.register_hook(lambda grad: block_here())
        return output


def build(cfg: ModelConfig) -> HangingGPT:
    return HangingGPT(cfg)
