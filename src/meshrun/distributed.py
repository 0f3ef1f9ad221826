"""Process group, device and backend (chosen here and nowhere else), and the (pp, dp) mesh.

Rank layout: pp is the outer mesh axis and dp the inner one, so
`rank = pp_rank * dp + dp_rank`. The dp replicas of one stage are neighbouring ranks (same
node on a multi-GPU machine: gradient all-reduce, the heavy traffic, stays on fast links),
while consecutive pipeline stages are `dp` ranks apart (activations are small p2p messages).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def pick_device() -> tuple[torch.device, str]:
    """CUDA + nccl when a GPU is visible (LOCAL_RANK picks it), else CPU + gloo."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the dp x pp mesh, with the process groups of each axis."""

    device: torch.device
    device_mesh: DeviceMesh
    dp: int
    pp: int

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_rank(self) -> int:
        return self.device_mesh.get_local_rank("dp")

    @property
    def pp_rank(self) -> int:
        return self.device_mesh.get_local_rank("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("pp")

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def in_launched_worker() -> bool:
    """True inside torchrun / Slurm-started workers (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_mesh(*, dp: int, pp: int) -> Mesh:
    """Join (or, for a lone process, create) the process group and build the mesh."""
    device, backend = pick_device()
    if in_launched_worker():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:  # one process started directly: no ports, no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != dp * pp:
        world = dist.get_world_size()
        dist.destroy_process_group()
        raise RuntimeError(
            f"world size {world} does not match parallel.dp x parallel.pp = {dp} x {pp}; "
            "launch dp*pp processes or change parallel.dp / parallel.pp"
        )
    device_mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    return Mesh(device=device, device_mesh=device_mesh, dp=dp, pp=pp)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
