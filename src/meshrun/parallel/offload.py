"""Activation offload (`train.offload_activations`): the tensors a block's backward needs kept in
host memory from its forward until its backward, instead of on the device.

torch's own `offload_wrapper` (the sibling of the checkpoint wrapper recompute uses, and whose
state-dict hooks likewise keep parameter names unchanged) runs the block under
`torch.autograd.graph.save_on_cpu(pin_memory=True)`: each saved tensor is copied to a pinned host
buffer (non-blocking on CUDA) and copied back when backward unpacks it. On a CPU the copy is a plain
host copy (nothing to pin): the same values, so results are bit-identical with offload on or off.

Blocks are chosen by their global layer index, as recompute's are, so the choice is the same
whatever the pipeline split. A block is either recomputed or offloaded: one that the recompute
policy selects keeps nothing to offload, and is left to recompute.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

from meshrun.parallel.recompute import wants_recompute


def wants_offload(policy: bool | str, layer: int) -> bool:
    """Whether `policy` (true, false, every:N) offloads block `layer`'s saved activations."""
    if isinstance(policy, bool):
        return policy
    return wants_recompute(policy, layer)  # every:N selects blocks as recompute's every:N does


def apply_offload(blocks: nn.ModuleDict, policy: bool | str, *, recompute: str) -> None:
    """Wrap the blocks `policy` selects and `recompute` does not with torch's offload wrapper."""
    for key in list(blocks.keys()):
        if wants_offload(policy, int(key)) and not wants_recompute(recompute, int(key)):
            blocks[key] = offload_wrapper(blocks[key])
