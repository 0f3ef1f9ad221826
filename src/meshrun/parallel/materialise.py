"""One pipeline stage of the model made real: built on the meta device and pruned to its blocks (the
planner sizes this) and, under parallel.ep, to its ep rank's experts, then materialised on the
device, initialised (pretrained weights: only the tensors, and rows, it holds are read), given
model.lora's adapters, split over the tp mesh and wrapped for recompute."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config.schema import Config
from meshrun.launcher import progress
from meshrun.models.families import build_model
from meshrun.models.moe import HeldExperts, held_experts, hold_experts
from meshrun.models.protocol import ProtocolModule, keep_stage
from meshrun.parallel.expert_shards import experts_modules
from meshrun.parallel.recompute import apply_recompute

M = TypeVar("M", bound=nn.Module)


def build_stage(cfg: Config, *, layers: list[int] | None, first: bool, last: bool) -> ProtocolModule:
    """Steps 1-2 for one stage (layers=None: the whole model), on the meta device, with model.lora's
    adapters (uninitialised): what the planner and --dry-run size, trainable parameters included."""
    return with_adapters(meta_stage(cfg, layers=layers, first=first, last=last), cfg, seed=None)


def meta_stage(
    cfg: Config, *, layers: list[int] | None, first: bool, last: bool, ep_rank: tuple[int, int] = (0, 1)
) -> ProtocolModule:
    """Steps 1-2: the stage on the meta device, cut to ep rank `ep_rank` (coordinate, ep)'s experts,
    a LoRA base in the dtypes it will be loaded in."""
    part = prune_stage(build_model(cfg.model), layers=layers, first=first, last=last)
    hold_rank_experts(part, *ep_rank)
    if cfg.model.lora is not None:
        from meshrun.models.lora import hold_base_as_stored  # only when used, as with_adapters

        hold_base_as_stored(part, cfg)
    return part


def with_adapters(part: M, cfg: Config, *, seed: int | None) -> M:
    """`part` with model.lora's adapters added in place, the rest frozen (no model.lora: as it is)."""
    if cfg.model.lora is not None:
        from meshrun.models.lora import add_adapters  # imports peft: only when used

        add_adapters(part, cfg.model.lora, seed=seed)
    return part


def prune_stage(part: ProtocolModule, *, layers: list[int] | None, first: bool, last: bool) -> ProtocolModule:
    """Step 2: the whole model `part` cut to one stage's blocks and ends, in place (layers=None: all)."""
    if layers is not None:
        keep = {str(i) for i in layers}
        for key in [k for k in part.blocks if k not in keep]:
            del part.blocks[key]
        keep_stage(part, first=first, last=last)  # e.g. a tied last stage keeps the embedding matrix for its head
    return part


def hold_rank_experts(part: nn.Module, rank: int, ranks: int) -> None:
    """Step 2b: every experts module of `part` cut to ep rank `rank` of `ranks`'s experts (nothing at
    ep 1): on the meta device, so to_empty and init_weights make and load only those."""
    if ranks == 1:
        return
    for _, module in experts_modules(part):
        hold_experts(module, HeldExperts.of_rank(held_experts(module).total, rank, ranks))


def materialise_part(
    cfg: Config,
    device: torch.device,
    *,
    layers: list[int] | None,
    first: bool,
    last: bool,
    tp_mesh: DeviceMesh | None = None,
    ep_rank: tuple[int, int] = (0, 1),
) -> ProtocolModule:
    """Steps 1-5 for one stage (layers=None: the whole model); `tp_mesh` of more than one rank:
    tensor parallel (before recompute wraps the blocks, whose module paths the plan names);
    `ep_rank` (coordinate, ep): the experts this rank holds under parallel.ep."""
    part = meta_stage(cfg, layers=layers, first=first, last=last, ep_rank=ep_rank)
    part.to_empty(device=device)
    part.init_weights(cfg.train.seed)
    part = with_adapters(part, cfg, seed=cfg.train.seed)  # after the base's init: an adapter renames the layer it wraps
    if tp_mesh is not None:  # a training rank (not balance's lone measurement): what follows communicates
        progress.mark_init("the model's first collectives: its weights placed and synchronised")
    if tp_mesh is not None and tp_mesh.size() > 1:
        from meshrun.parallel.tensor import apply_tensor_parallel  # torch's tensor.parallel: only when used

        apply_tensor_parallel(
            part,
            tp_mesh,
            sequence_parallel=cfg.parallel.sequence_parallel,
            experts_over_tp=cfg.layout.experts_over_tp,
        )
    apply_recompute(part.blocks, cfg.recompute)
    return part
