"""The process group, and this rank's place in the layout's device mesh with the groups of each axis."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh

from meshrun.errors import RunError
from meshrun.files.console import say
from meshrun.hardware.device import pick_device
from meshrun.launcher.rendezvous import probe
from meshrun.launcher.torchrun import in_launched_worker
from meshrun.parallel.layout import Layout

WAIT_NOTICE_S = 10  # a wait for the job's other workers is said once it lasts this long (or half its bound)
PROBE_SECONDS = 0.5


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
    """The layout's meshes over the existing process group (which may hold several layouts of one world size)."""
    device_mesh, data_mesh, tp_mesh = layout.build_device_mesh(device.type)
    return Mesh(layout=layout, device=device, device_mesh=device_mesh, data_mesh=data_mesh, tp_mesh=tp_mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
