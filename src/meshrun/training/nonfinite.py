"""Non-finite gradients under fp32/bf16: found, and the step skipped, on the device; reported at
the next step boundary where the host reads anything anyway."""

from __future__ import annotations

import torch

from meshrun.errors import RunError


class NonFiniteLossError(RunError):
    """Loss or gradients became inf/NaN outside an fp16 scaler skip."""


class NonFiniteSteps:
    """Non-finite gradients (fp32/bf16), tracked on the device so that no step waits for the host.

    From the first non-finite step on, every optimizer step is skipped on the device (weights,
    moments and AdamW's step counter stay as they were before it); `raise_if_any` reports it the
    next time the host reads anything anyway: a log line, a validation, a checkpoint, the end.
    """

    def __init__(self, device: torch.device) -> None:
        self.first = torch.zeros((), dtype=torch.int64, device=device)  # 1-based step; 0: none yet

    def skip(self, grad_norm: torch.Tensor, step: int) -> torch.Tensor:
        """1.0 when this step must not be applied (it, or an earlier one, was non-finite)."""
        self.first = torch.where((self.first == 0) & ~torch.isfinite(grad_norm), step + 1, self.first)
        return (self.first > 0).float()

    def raise_if_any(self) -> None:
        first = int(self.first.item())  # the host sync, at a step boundary that syncs anyway
        if first:
            raise NonFiniteLossError(
                f"non-finite loss/gradients at step {first}; lower train.lr, set train.grad_clip, or use bf16"
            )
