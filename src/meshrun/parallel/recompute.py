"""Activation recompute policies applied per Transformer block.

Blocks are chosen by their global layer index (the ModuleDict key), so `every:2` recomputes
the same blocks whatever the pipeline split. Wrapping uses torch's checkpoint wrapper, whose
state-dict hooks keep parameter names unchanged (checkpoints do not see the wrapper).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

# Selective: keep the outputs of the expensive ops (matmuls, attention) and recompute the
# cheap elementwise ones (GELU, LayerNorm, dropout, residual adds) in backward. Under tp a
# row-parallel matmul's output is summed over the tp ranks (all-reduce; reduce-scatter under
# sequence parallel): kept too, or backward would rerun the collective (Megatron's selective
# reruns none; torchtitan keeps its reduce-scatter). The price, on the built-in GPT at tp 2: the
# policy caches 8 B x T x C a block instead of 6 (7 under sequence parallel, whose sums hold 1/tp
# of the positions). Sequence parallel's all-gathers of a block's input are rerun, as Megatron
# does: keeping them would hold tp times the rank's positions.
_SAVE_OPS = {
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def wants_recompute(policy: str, layer: int) -> bool:
    if policy in ("full", "selective"):
        return True
    if policy.startswith("every:"):
        return layer % int(policy.split(":")[1]) == 0
    return False


OnSaved = Callable[[object], None]  # sees each output the selective policy keeps (a tensor or a tuple)


def apply_recompute(blocks: nn.ModuleDict, policy: str, *, on_saved: OnSaved | None = None) -> None:
    """Wrap the blocks the policy selects with non-reentrant torch.utils.checkpoint.

    `on_saved` (the planner's byte counter): selective checkpointing keeps the outputs its policy
    saves in a cache of its own, outside autograd's saved tensors, so saved-tensor hooks never
    see them; this callback does, as each is computed in the forward."""
    extra: dict[str, Any] = {"context_fn": partial(selective_contexts, on_saved)} if policy == "selective" else {}
    for key in list(blocks.keys()):
        if wants_recompute(policy, int(key)):
            blocks[key] = checkpoint_wrapper(blocks[key], preserve_rng_state=True, **extra)


def selective_contexts(
    on_saved: OnSaved | None = None,
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """The forward and recompute contexts of one checkpointed call under the selective policy."""
    forward, recompute = create_selective_checkpoint_contexts(_save_matmuls)
    return (forward if on_saved is None else _both(forward, SavedOutputs(on_saved))), recompute


@contextmanager
def _both(first: AbstractContextManager[Any], second: AbstractContextManager[Any]) -> Iterator[None]:
    with first, second:
        yield


class SavedOutputs(TorchDispatchMode):
    """Hands each output of an op the selective policy saves to a callback.

    The one use of a private torch module (`torch.utils._python_dispatch`, where torch's own
    selective checkpointing defines its modes): tests/parallel/test_recompute.py fails loudly if
    it moves."""

    def __init__(self, on_saved: OnSaved) -> None:
        super().__init__()
        self.on_saved = on_saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _SAVE_OPS:
            self.on_saved(out)
        return out
