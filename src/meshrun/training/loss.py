"""The loss, normalised once for every layout: by the global batch's target count.

A step's loss is the sum of the task's per-target losses over the whole global batch divided by
the number of targets in it: for token tasks the token cross-entropies over the non-pad target
tokens (`IGNORE` marks padding); for classification the samples' cross-entropies over the samples
(each task's `summed` loss and the data's `target_tokens` say which, meshrun/tasks/); with class
weights, the weighted cross-entropies over the summed weights of the targets, as torch's
`F.cross_entropy(weight=...)` normalises (`Task.divisor`). Microbatches of padded data
hold different token counts, so a mean of per-microbatch means would weight a token in a short
microbatch more than one in a long one. Each microbatch therefore contributes its token SUM /
(global count / dp): summing over a rank's microbatches and DDP's average over dp ranks give
sum / global count, the same gradient one process computes on that batch. Under context parallel
(parallel.cp) a rank holds T / cp positions of its samples: `dp` is then dp x cp, the ranks the
gradients are averaged over, and the mean of the ranks' losses is again sum / global count. The count comes from
the batch itself before the step (`MicrobatchLoss.for_batch`), so no collective runs inside the
schedule. Pipeline schedules run with scale_grads=False.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrun.data.storage import IGNORE
from meshrun.tasks import SummedLoss
from meshrun.tasks.tokens import token_cross_entropy


@dataclass(frozen=True, eq=False)
class MicrobatchLoss:
    """Loss callable for both the plain loop and pipeline schedules (called on the last stage).

    Immutable: a training step builds its own (`for_batch`) with everything the loss divides and
    multiplies by, and hands it to the model's forward_backward; nothing is set between steps.
    """

    num_microbatches: int
    per_rank_tokens: float | None = None
    """The global batch's non-pad target tokens (or their summed weights) / dp; None (a loss used on its own): each
    microbatch's token mean / num_microbatches."""
    grad_scale: torch.Tensor | None = None
    """fp16: the GradScaler's scale when the step starts (0-d, on the device: no host sync); None: unscaled."""
    summed: SummedLoss = token_cross_entropy
    """The task's loss summed over a microbatch's targets."""

    @classmethod
    def for_batch(
        cls,
        num_microbatches: int,
        *,
        target_tokens: float,
        dp: int,
        grad_scale: torch.Tensor | None = None,
        summed: SummedLoss = token_cross_entropy,
    ) -> MicrobatchLoss:
        """The loss of a global batch with `target_tokens` targets, or their summed weights (a batch with
        none, all padding or all weighing 0, divides by 1: its loss is 0)."""
        per_rank = (target_tokens if target_tokens > 0 else 1) / dp
        return cls(num_microbatches, per_rank_tokens=per_rank, grad_scale=grad_scale, summed=summed)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = self.summed(logits, targets)
        if self.per_rank_tokens is None:
            loss = total / ((targets != IGNORE).sum().clamp(min=1) * self.num_microbatches)
        else:
            loss = total / self.per_rank_tokens
        return loss * self.grad_scale if self.grad_scale is not None else loss

    def unscaled(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the values this callable returned, in plain loss units (the scale is a power of 2: exact)."""
        total = torch.stack([loss.detach() for loss in losses]).sum()
        return total / self.grad_scale if self.grad_scale is not None else total
