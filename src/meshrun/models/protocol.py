"""The model protocol as types, and the forward every protocol model shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn


class ModelProtocol(Protocol):
    """What meshrun reads from a model beyond nn.Module (the protocol in `meshrun.models.families`).

    nn.Module creates these attributes in `__init__`, where a type checker does not look (it
    types a module's unknown attributes as `Tensor | Module`): code that reaches them holds a
    `ProtocolModule`.
    """

    embed: nn.Module | None
    blocks: nn.ModuleDict
    norm: nn.Module | None
    head: nn.Module | None

    def init_weights(self, seed: int) -> None: ...

    def flops_per_token(self, length: int | None = None) -> float: ...


if TYPE_CHECKING:

    class ProtocolModule(nn.Module, ModelProtocol):
        """An nn.Module that follows the model protocol: what `build_model` returns.

        Python has no intersection type (`nn.Module & ModelProtocol`); this class spells one for
        the type checker only. At run time it is `nn.Module` itself: a model need not subclass
        anything, `build_model` checks the protocol when the model is built.
        """

else:
    ProtocolModule = nn.Module


class StagedModel(ProtocolModule):
    """Base for models meshrun can split: subclasses set `embed`, `blocks`, `norm` and `head`
    (and implement `init_weights` and `flops_per_token`); any part may be pruned to None."""

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
