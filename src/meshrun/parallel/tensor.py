"""Tensor parallelism (`parallel.tp`): the model's declared split (`tp_plan`, models/protocol.py)
applied with torch.distributed.tensor.parallel over the layout's tp mesh, the vocabulary-parallel
loss, and the global gradient norm over sharded gradients.

Megatron's split: column-parallel q, k, v and MLP input, row-parallel output projections (one
all-reduce per attention and per MLP, forward and backward), the embedding and the head split by
vocabulary. The head's logits stay sharded by vocabulary and `loss_parallel` computes the cross
entropy from the shards (never gathering B x T x V). Activations between blocks, and so between
pipeline stages, are plain replicated tensors. The vocabulary need not divide by tp: DTensor
shards unevenly (torch.chunk's split) and the embedding's and the loss's masks follow the shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from fnmatch import fnmatch
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from meshrun.errors import ConfigError
from meshrun.models.protocol import TP_STYLES, tp_plan
from meshrun.parallel.loss_fn import LossFn

STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    "vocab_head": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
}
assert tuple(STYLES) == TP_STYLES
T = TypeVar("T", bound=torch.Tensor)


def check_plan(model: nn.Module, tp: int, source: str) -> None:
    """Before spawn (tp > 1): a plan of known styles that names modules the model has."""
    plan = tp_plan(model)
    if plan is None:
        raise ConfigError(
            f"parallel.tp {tp}: {source} declares no tensor-parallel plan (tp_plan); "
            "use model.name gpt, give the model a tp_plan, or set parallel.tp=1"
        )
    names = [name for name, _ in model.named_modules()]
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"{source}'s tp_plan gives {pattern} style {style!r}: choose one of {', '.join(STYLES)}")
        if not any(fnmatch(name, pattern) for name in names):
            raise ConfigError(f"{source}'s tp_plan names {pattern}, which matches no module of the model; fix the plan")


def apply_tensor_parallel(part: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split this stage's modules over the tp mesh as the model's plan says (patterns matching
    nothing here belong to other pipeline stages). Every tp rank holds the same initialised
    values: each keeps its slice, so a shard equals that slice of what one process draws."""
    plan = tp_plan(part)
    assert plan is not None  # check_plan refused tp > 1 without one
    names = [name for name, _ in part.named_modules()]
    concrete = {name: STYLES[style]() for pattern, style in plan.items() for name in names if fnmatch(name, pattern)}
    parallelize_module(part, tp_mesh, concrete)


def vocab_parallel(tp: int) -> contextlib.AbstractContextManager:
    """The context a forward + loss + backward runs in: loss_parallel under tp (the cross entropy
    of vocabulary-sharded logits, forward and backward), nothing otherwise."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def tp_loss(loss: LossFn, tp: int) -> LossFn:
    """The loss a step under `tp` calls: its value as a plain tensor (LocalLoss) when tp > 1."""
    return LocalLoss(loss) if tp > 1 else loss


class LocalLoss:
    """A loss over vocabulary-sharded logits, returned as a plain tensor (every tp rank holds the
    same value), so schedules, accumulation and logging see what they see without tp."""

    def __init__(self, loss: LossFn) -> None:
        self.loss = loss

    @property
    def num_microbatches(self) -> int:
        return self.loss.num_microbatches

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = self.loss(logits, targets)
        return value.to_local() if isinstance(value, DTensor) else value

    def unscaled(self, losses: list[torch.Tensor]) -> torch.Tensor:
        return self.loss.unscaled(losses)


def by_mesh(tensors: Iterable[T]) -> list[list[T]]:
    """`tensors` grouped by the mesh a DTensor lives on (tp, fsdp's dp, or both; plain tensors
    together): torch's foreach kernels take no mix of the two, nor of meshes."""
    groups: dict[object, list[T]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device_mesh if isinstance(tensor, DTensor) else None, []).append(tensor)
    return list(groups.values())


def global_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 2-norm of all `grads`, each element counted once: DTensor gradients reduced over their
    mesh (a sharded one sums its shards, a replicated one counts once); plain ones are whole on
    every rank."""
    norms = []
    for group in by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros((), device=device)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_to_norm_(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / norm where the global `norm` exceeds it."""
    for group in by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
