"""The loss, normalised once for every layout: by the global batch's target-token count.

A step's loss is the sum of token cross-entropies over the whole global batch divided by the
number of non-pad target tokens in it (`IGNORE` marks padding). Microbatches of padded data
hold different token counts, so a mean of per-microbatch means would weight a token in a short
microbatch more than one in a long one. Each microbatch therefore contributes its token SUM /
(global count / dp): summing over a rank's microbatches and DDP's average over dp ranks give
sum / global count, the same gradient one process computes on that batch. The count comes from
the batch itself before the step (`set_target_tokens`), so no collective runs inside the
schedule. Pipeline schedules run with scale_grads=False.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.amp import GradScaler

from meshrun.data.storage import IGNORE


class MicrobatchLoss:
    """Loss callable for both the plain loop and pipeline schedules (called on the last stage)."""

    def __init__(self, num_microbatches: int, *, dp: int = 1) -> None:
        self.num_microbatches, self.dp = num_microbatches, dp
        # The global batch's target tokens / dp, set before every step by the trainer; None (a
        # loss used on its own): each microbatch's token mean / num_microbatches.
        self.per_rank_tokens: float | None = None
        self.scaler: GradScaler | None = None  # set by the trainer for fp16 training steps

    def set_target_tokens(self, global_count: int) -> None:
        """The non-pad target tokens of the global batch about to run (at least 1: an all-pad batch gives loss 0)."""
        self.per_rank_tokens = max(int(global_count), 1) / self.dp

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        if self.per_rank_tokens is None:
            loss = total / ((targets != IGNORE).sum().clamp(min=1) * self.num_microbatches)
        else:
            loss = total / self.per_rank_tokens
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscaled(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the values this callable returned, in plain loss units (the scale is a power of 2: exact)."""
        total = torch.stack([loss.detach() for loss in losses]).sum()
        return total / self.scaler.get_scale() if self.scaler is not None else total
