"""The process group, and this rank's place in the layout's device mesh with the groups of each axis."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshrun.hardware.device import pick_device
from meshrun.launcher.torchrun import in_launched_worker
from meshrun.parallel.layout import Layout


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the layout, with the process groups of each axis."""

    layout: Layout
    device: torch.device
    device_mesh: DeviceMesh  # (pp, dp, tp)
    data_mesh: DeviceMesh | None  # fsdp: the dp axis; hsdp and ddp x tp: (dp_replicate, dp_shard); ddp: None
    tp_mesh: DeviceMesh  # the tp axis (same root as data_mesh)

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def tp(self) -> int:
        return self.layout.tp

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
    def local_stages(self) -> list[int]:
        """The pipeline stages this rank runs."""
        return self.layout.stages_of(self.pp_rank)


def init_mesh(layout: Layout) -> Mesh:
    """Join (or, for a lone process, create) the process group and build the layout's meshes (the
    world size was checked against the layout by `preflight.check_worker_env` before workers started)."""
    device, backend = pick_device()
    if in_launched_worker():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:  # one process started directly: no ports, no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return mesh_on(layout, device)


def mesh_on(layout: Layout, device: torch.device) -> Mesh:
    """The layout's meshes over the existing process group (which may hold several layouts of one world size)."""
    device_mesh, data_mesh, tp_mesh = layout.build_device_mesh(device.type)
    return Mesh(layout=layout, device=device, device_mesh=device_mesh, data_mesh=data_mesh, tp_mesh=tp_mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
