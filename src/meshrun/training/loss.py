"""The loss, normalised once for every layout.

Each microbatch contributes mean-token cross-entropy / num_microbatches; summing over a
rank's microbatches and DDP's average over dp ranks then gives the mean over the whole global
batch, the same gradient one process computes on that batch (fixed-length samples, so every
microbatch holds the same number of tokens). Pipeline schedules run with scale_grads=False.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.amp import GradScaler


class MicrobatchLoss:
    """Loss callable for both the plain loop and pipeline schedules (called on the last stage)."""

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.scaler: GradScaler | None = None  # set by the trainer for fp16 training steps

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / self.num_microbatches
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscaled(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the values this callable returned, in plain loss units (the scale is a power of 2: exact)."""
        total = torch.stack([loss.detach() for loss in losses]).sum()
        return total / self.scaler.get_scale() if self.scaler is not None else total
