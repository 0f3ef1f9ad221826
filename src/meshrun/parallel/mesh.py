"""The process group, and one world mesh over the layout's axes that every rank asks by name: its
coordinate, an axis's size, its group, the sub-mesh over some axes (`mesh.view("dp_shard", "tp")`),
and the flattened views of groups that span several axes (`dp`; an axis that borrows ranks from
others, see parallel.layout). Built once per layout over the existing process group; the layout's
coordinates are checked against the groups torch built, so the two rank orders cannot drift apart."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshrun.errors import RunError
from meshrun.files.console import say
from meshrun.hardware.device import pick_device
from meshrun.launcher.rendezvous import probe
from meshrun.launcher.torchrun import in_launched_worker
from meshrun.parallel.layout import AXES, DATA_AXES, EXPERT_VIEWS, VIEWS, Coordinates, Layout

WAIT_NOTICE_S = 10  # a wait for the job's other workers is said once it lasts this long (or half its bound)
PROBE_SECONDS = 0.5


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the layout, with the device mesh and process group of each axis and view."""

    layout: Layout
    device: torch.device
    world: DeviceMesh  # every axis of the layout (AXES, outermost first)
    views: Mapping[
        str, DeviceMesh
    ]  # each view (VIEWS, and EXPERT_VIEWS when ep > 1) cut from `world`: torch keeps no way back to it
    expert_grid: DeviceMesh | None = None  # ep > 1: the dp view as (ep_dp, ep), where a split expert's whole lives

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def coordinates(self) -> Coordinates:
        """This rank's coordinate on every axis and view (its rank in that axis's group)."""
        return self.layout.coordinates(self.rank)

    def size(self, name: str) -> int:
        """The degree of an axis or view."""
        return self.layout.size(name)

    def view(self, *names: str) -> DeviceMesh:
        """The sub-mesh over these axes (outermost first), or one view: all cut from the one world mesh,
        as FSDP2 needs of the tp and data meshes it composes."""
        if len(names) == 1 and names[0] in self.views:
            return self.views[names[0]]
        if names == EXPERT_VIEWS and self.expert_grid is not None:
            return self.expert_grid
        return self.world[names[0] if len(names) == 1 else names]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of this rank's group on an axis or view."""
        return self.view(name).get_group()

    @property
    def data_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over (Layout.fsdp_axes); None: DDP over the `dp` group, or no dp."""
        axes = self.layout.fsdp_axes
        return self.view(*axes) if axes else None

    @property
    def local_stages(self) -> list[int]:
        """The pipeline stages this rank runs."""
        return self.layout.stages_of(self.coordinates.pp)

    def data_shard(self, batch: int) -> range:
        """The samples of a `batch`-sample global batch this rank reads (Layout.data_shard)."""
        return self.layout.data_shard(self.rank, batch)

    @property
    def seed_offset(self) -> int:
        """This rank's dropout stream (Layout.seed_offset)."""
        return self.layout.seed_offset(self.rank)


def init_mesh(layout: Layout, *, join_timeout: int = 600) -> Mesh:
    """Join (or, for a lone process, create) the process group and build the layout's meshes (the
    world size was checked against the layout by `preflight.check_worker_env` before workers started).
    `join_timeout`: seconds a worker waits for the job's other workers (launch.rdzv_timeout)."""
    device, backend = pick_device()
    if in_launched_worker():
        store, rank, world = join_store(join_timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, device_id=device if device.type == "cuda" else None
        )
    else:  # one process started directly: no ports, no rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return mesh_on(layout, device)


def join_store(timeout: int) -> tuple[dist.Store, int, int]:
    """torch's env:// rendezvous (the store at MASTER_ADDR:MASTER_PORT: rank 0 hosts it, or torchrun's
    agent), waiting at most `timeout` s: torch's own wait is its 30 min collective timeout, silent. A
    wait longer than a few seconds is said, with its bound. Returns the store as init_process_group
    makes it, with torch's default timeout for later requests."""
    rank, where = int(os.environ["RANK"]), f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    awaited = "rank 0" if rank else f"the other {int(os.environ['WORLD_SIZE']) - 1} workers"
    line = (
        f"rank {rank}: waiting for {awaited} at the job's store {where} (MASTER_ADDR:MASTER_PORT); giving up after "
        f"{timeout} s (launch.rdzv_timeout, --rdzv-timeout)"
    )
    notice = threading.Timer(min(WAIT_NOTICE_S, timeout / 2), say, [line])
    notice.daemon = True
    notice.start()
    try:
        joined = _rendezvous(rank, time.monotonic() + timeout)
    finally:
        notice.cancel()
    if joined is None:
        raise RunError(
            f"rank {rank}: {awaited} did not reach the job's store at {where} within {timeout} s (launch.rdzv_timeout); "
            "start every worker with the same MASTER_ADDR and MASTER_PORT, or raise --rdzv-timeout"
        )
    store, rank, world = joined
    store.set_timeout(default_pg_timeout)
    return dist.PrefixStore("default_pg", store), rank, world


def _rendezvous(rank: int, deadline: float) -> tuple[dist.Store, int, int] | None:
    """The env:// rendezvous by `deadline` (None: not every worker came). A client waits until the
    store's port answers first (rank 0 may not be up yet), asking quietly (rendezvous.probe)."""
    host, port = os.environ["MASTER_ADDR"].strip("[]"), int(os.environ["MASTER_PORT"])
    while rank and probe(host, port) is not None:
        if time.monotonic() > deadline:
            return None
        time.sleep(PROBE_SECONDS)
    try:
        return next(dist.rendezvous("env://", timeout=timedelta(seconds=max(1.0, deadline - time.monotonic()))))
    except dist.DistError:
        return None


def mesh_on(layout: Layout, device: torch.device) -> Mesh:
    """The layout's world mesh over the existing process group (which may hold several layouts of one
    world size), with its views flattened onto it, checked against the layout's coordinates."""
    world = init_device_mesh(device.type, tuple(layout.degrees.values()), mesh_dim_names=tuple(layout.degrees))
    views = {name: flatten(world, axes, name) for name, axes in VIEWS.items()}
    split = None
    if layout.ep > 1:  # the dp view (x tp where ep spans it) split into (ep_dp, ep): one root, as FSDP2 needs
        borrowed = flatten(world, (*DATA_AXES, "tp"), "dp_tp") if layout.experts_over_tp else views["dp"]
        split = borrowed._unflatten(0, (layout.size("ep_dp"), layout.ep), EXPERT_VIEWS)
        views.update({name: split[name] for name in EXPERT_VIEWS})
    mesh = Mesh(layout=layout, device=device, world=world, views=views, expert_grid=split)
    check_groups(mesh)
    return mesh


def flatten(world: DeviceMesh, axes: tuple[str, ...], name: str) -> DeviceMesh:
    """One group over `axes` of `world`, named `name`. The one use of torch's private
    `DeviceMesh._flatten` (torchtitan's way to the same groups; no public API makes them from one
    root; `_unflatten` splits the dp view for parallel.ep the same way): tests/parallel/test_layout_object.py
    fails by name if a torch upgrade changes `_flatten`, tests/parallel/test_experts.py if `_unflatten` changes."""
    return world[axes]._flatten(name)


def check_groups(mesh: Mesh) -> None:
    """Every axis's and view's group, as torch built it, holds the ranks the layout says, in the order
    of their coordinates: else a rank's data, dropout stream or loss would be counted by an order torch
    does not use. A bug, not a user's error (a traceback); it asks no other rank."""
    for name in (*AXES, *mesh.views):
        built, expected = dist.get_process_group_ranks(mesh.group(name)), mesh.layout.group_ranks(mesh.rank, name)
        if built != expected or mesh.view(name).get_local_rank() != mesh.coordinates[name]:
            raise RuntimeError(
                f"rank {mesh.rank}: torch built the {name} group of ranks {built} (this rank at "
                f"{mesh.view(name).get_local_rank()}), the layout says {expected} (at {mesh.coordinates[name]})"
            )


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
