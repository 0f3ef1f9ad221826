"""The forward every protocol model shares: run whichever of its parts this stage owns."""

from __future__ import annotations

import torch
from torch import nn


class StagedModel(nn.Module):
    """Base for models meshrun can split: subclasses set `embed`, `blocks`, `norm` and `head`
    (and implement `init_weights` and `flops_per_token`); any part may be pruned to None."""

    embed: nn.Module | None
    blocks: nn.ModuleDict
    norm: nn.Module | None
    head: nn.Module | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); a pruned stage maps what it receives to what the next expects."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x
