"""What a split experts module holds (parallel.ep, see parallel/experts.py), and how checkpoints name
it: `global_state` presents each shard as its part of the whole tensor (a DTensor over the (ep_dp, ep)
grid, sharing the shard's memory: sharded on dim 0 over ep; over ep_dp replicated, or under fsdp / hsdp
as FSDP2 shards it there) and `local_state` takes it back, so DCP saves whole experts and a resume at
another ep degree (ep 1 included) or another dp_mode reads its own share. A leaf (torch only):
checkpoint/ reads it without importing the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # 3-D, experts on dim 0
EXPERTS_SHARD_DIM = 1  # FSDP2 shards split experts over ep_dp on dim 1: dim 0 is split over ep already


def is_experts(module: nn.Module) -> bool:
    """A module whose experts ep can split: 3-D `gate_up_proj` and `down_proj` parameters."""
    return all(isinstance(p := getattr(module, n, None), nn.Parameter) and p.ndim == 3 for n in EXPERT_WEIGHTS)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every experts module of `model`, with its name."""
    return [(name, module) for name, module in model.named_modules() if is_experts(module)]


@dataclass(frozen=True)
class ExpertShard:
    """The experts a split module holds: `count` of `total`, from `first`, over `mesh` (the ep mesh);
    `grid`: the (ep_dp, ep) mesh a whole expert tensor is laid out on."""

    first: int
    count: int
    total: int
    mesh: DeviceMesh
    grid: DeviceMesh


def _shards(part: nn.Module) -> dict[str, ExpertShard]:
    """Each split expert weight's name as state dicts name it (without wrappers' `_checkpoint_wrapped_module`
    and the like) -> its shard."""
    named = {}
    for name, module in experts_modules(part):
        clean = ".".join(segment for segment in name.split(".") if not segment.startswith("_"))
        named.update({f"{clean}.{n}": module.expert_shard for n in EXPERT_WEIGHTS if hasattr(module, "expert_shard")})
    return named


def global_state(part: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a model or flattened optimizer state of `part`) with each expert shard as its part of the
    whole tensor: a DTensor over the ep mesh sharded on dim 0, sharing the shard's memory."""
    shards = _shards(part)
    return {key: _as_global(value, shards.get(_weight_of(key, shards))) for key, value in state.items()}


def local_state(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each DTensor made by `global_state` back to what this rank's module holds: its
    experts, or FSDP2's shard of them over ep_dp."""
    return {key: _as_local(v) if isinstance(v, DTensor) and _from_ep(v) else v for key, v in state.items()}


def _weight_of(key: str, shards: dict[str, ExpertShard]) -> str:
    """The expert weight a state key belongs to (`…experts.gate_up_proj`, `state.…gate_up_proj.exp_avg`), or ''."""
    return next((name for name in shards if key == name or f".{name}." in f".{key}."), "")


def _as_global(value: Any, shard: ExpertShard | None) -> Any:
    if shard is None or not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    over_ep_dp = value.placements[0] if isinstance(value, DTensor) else Replicate()  # FSDP2's, or a copy each
    return _laid_out(value, shard.grid, [over_ep_dp, Shard(0)], (shard.total, *value.shape[1:]))


def _as_local(value: DTensor) -> torch.Tensor:
    over_ep_dp = value.placements[0]
    if isinstance(over_ep_dp, Replicate):
        return value.to_local()
    ep = value.device_mesh.size(1)
    return _laid_out(value, value.device_mesh["ep_dp"], [over_ep_dp], (value.shape[0] // ep, *value.shape[1:]))


def _laid_out(value: torch.Tensor, mesh: DeviceMesh, placements: list, shape: tuple[int, ...]) -> DTensor:
    """`value`'s local tensor as its part of a `shape` tensor laid out over `mesh` by `placements`."""
    local = value.to_local() if isinstance(value, DTensor) else value
    whole = torch.Size(shape)
    stride = torch.empty(whole, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=whole, stride=stride)


def _from_ep(value: DTensor) -> bool:
    return value.device_mesh.mesh_dim_names == ("ep_dp", "ep")
