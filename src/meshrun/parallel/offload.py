"""Activation offload (`train.offload_activations`): the tensors a block's backward needs kept in
host memory from its forward until its backward, instead of on the device.

A selected block runs under saved-tensor hooks that are torch's `save_on_cpu(pin_memory=True)`
with one change: each saved tensor is copied to a pinned host buffer of the same strides
(`empty_like`, not torch's contiguous `empty`), non-blocking on CUDA, and copied back when backward
unpacks it. A compiled block's backward checks the strides of what its forward saved (torch's
contiguous copy fails that check), and the hooks sit outside the compiled forward, which dynamo
does not trace them in (parallelize.py wraps blocks after compiling them). The wrapper is torch's
`ActivationWrapper`, the base of the checkpoint wrapper recompute uses, whose state-dict hooks keep
parameter names unchanged. On a CPU the copy is a plain host copy (nothing to pin): the same
values, so results are bit-identical with offload on or off.

Blocks are chosen by their global layer index, as recompute's are, so the choice is the same
whatever the pipeline split. A block is either recomputed or offloaded: one that the recompute
policy selects keeps nothing to offload, and is left to recompute.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from meshrun.parallel.recompute import wants_recompute


class HostCopies(torch.autograd.graph.saved_tensors_hooks):
    """Each tensor autograd saves, kept in host memory (pinned where CUDA is) with its strides."""

    def __init__(self) -> None:
        pin = torch.cuda.is_available()

        def pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
            host = torch.empty_like(tensor, device="cpu", pin_memory=pin and not tensor.is_sparse)
            host.copy_(tensor, non_blocking=pin)
            return tensor.device, host

        def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


class OffloadedBlock(ActivationWrapper):
    """A block whose saved activations wait for its backward in host memory."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with HostCopies():
            return self._checkpoint_wrapped_module(*args, **kwargs)


def wants_offload(policy: bool | str, layer: int) -> bool:
    """Whether `policy` (true, false, every:N) offloads block `layer`'s saved activations."""
    if isinstance(policy, bool):
        return policy
    return wants_recompute(policy, layer)  # every:N selects blocks as recompute's every:N does


def apply_offload(blocks: nn.ModuleDict, policy: bool | str, *, recompute: str) -> None:
    """Wrap the blocks `policy` selects and `recompute` does not with torch's offload wrapper."""
    for key in list(blocks.keys()):
        if wants_offload(policy, int(key)) and not wants_recompute(recompute, int(key)):
            blocks[key] = OffloadedBlock(blocks[key])
