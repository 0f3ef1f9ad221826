"""What the parallel wrappers need from a loss (meshrun.training.loss.MicrobatchLoss is one).

A protocol here, not an import of the training package: training builds on parallel, so
parallel names only the shape of what it calls."""

from __future__ import annotations

from typing import Protocol

import torch


class LossFn(Protocol):
    @property
    def num_microbatches(self) -> int:
        """The loss of one microbatch is divided by this (schedules run with scale_grads=False)."""
        ...

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def unscaled(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of returned values in plain loss units (undoing any fp16 loss scale)."""
        ...
