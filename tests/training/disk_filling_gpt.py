"""A GPT whose block, at its third forward, takes every free byte of the disk holding the file
named by FILL_DISK (a tmpfs in the test): the next file meshrun writes meets a full disk mid-run.
Used through `model.factory: disk_filling_gpt:build`; numerics as the plain GPT."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT, Block

FILL_AT = 3  # block forwards before the disk fills: a few metrics rows are written first


class DiskFillingBlock(Block):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        DiskFillingBlock.calls += 1
        if DiskFillingBlock.calls == FILL_AT:
            with contextlib.suppress(OSError), Path(os.environ["FILL_DISK"]).open("wb") as filler:
                while True:  # ends when a write (or the close) meets the full disk
                    filler.write(b"\0" * 4096)
                    filler.flush()
        return super().forward(x)


def build(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    model.blocks = nn.ModuleDict({key: DiskFillingBlock(cfg) for key in model.blocks})
    return model
