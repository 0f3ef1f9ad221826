"""A lost node's `meshrun train` run again (launch.recovery peer over several nodes, issue 46): a node
lost whole (its agent, keepers and workers with it) comes back the way a scheduler brings it back,
the same command run again there. Nothing on it is left to start a replacement, and torchrun's
rendezvous admits no node into a running round (a new node would make every agent restart its
workers), so this launcher does not enter it: it asks the job's store (the host agent's, at
`launch.rdzv_endpoint`, which outlives every other node) whether this node ran in the job, and then
starts this node's keepers itself, each worker a replacement that joins the survivors' next
generation and takes its state from a replica (training/recovery.py), as a killed worker's does.

A node is known by its address (`launch.local_addr`, else its hostname): its first workers record
the environment torchrun gave them under that name. The host node (the store's) cannot come back
this way: the store died with it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

from meshrun.config.schema import Config
from meshrun.config.topology import peer_recovery
from meshrun.files.console import say
from meshrun.launcher.failures import new_loss, record
from meshrun.launcher.lifetime import wait_for_session
from meshrun.launcher.rendezvous import probe, store_address
from meshrun.launcher.run_lock import HELD_ENV, RunDirLock

NODE_KEY_ENV = "MESHRUN_NODE_KEY"  # where a node's first workers record it in the job's store
# What torchrun's agent tells its workers about the job (RANK and LOCAL_RANK are made per worker).
RECORDED = (
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def node_key(cfg: Config) -> str | None:
    """This node's name in the job's store; None where no node can come back (one node, or not peer)."""
    launch = cfg.launch
    if launch.nnodes == 1 or not peer_recovery(cfg.parallel, launch):
        return None
    return f"meshrun/{launch.rdzv_id}/node/{launch.local_addr or socket.gethostname()}"


def record_node(env: Mapping[str, str], endpoint: str | None) -> None:
    """A node's first worker at local rank 0: the job as torchrun told it, under NODE_KEY_ENV, in the
    rendezvous store at `endpoint` (the host node's, which outlives every other node)."""
    import torch.distributed as dist

    key = env.get(NODE_KEY_ENV)
    if not key or endpoint is None or env.get("LOCAL_RANK") != "0":
        return
    store = dist.TCPStore(*store_address(endpoint), is_master=False, timeout=timedelta(seconds=30))
    store.set(key, json.dumps({name: env[name] for name in RECORDED if name in env}))


def lost_node(cfg: Config, key: str) -> dict[str, str] | None:
    """The job this node ran in, as its first workers recorded it, where the job's store answers and
    holds it (the job runs on, this node lost); None: a launch like any other."""
    import torch.distributed as dist

    assert cfg.launch.rdzv_endpoint is not None
    host, port = store_address(cfg.launch.rdzv_endpoint)
    if cfg.launch.host_node or probe(host, port) is not None:
        return None
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
        if not store.check([key]):
            return None
        recorded = json.loads(store.get(key))
    except (RuntimeError, OSError, ValueError):  # not a store, or not one that ran this job
        return None
    if not ours(recorded, cfg):
        return None
    stand_in_at_exit(store, cfg)
    return {name: str(recorded[name]) for name in RECORDED if name in recorded}


def ours(recorded: object, cfg: Config) -> bool:
    """Whether a record read from the network is one this job's workers wrote: only the RECORDED names
    reach a worker's environment (a store any host can write to names no LD_PRELOAD or PYTHONPATH),
    and its group rank and local world size are this node's numbers, not a count to start."""
    if not isinstance(recorded, dict):
        return False
    group, local = str(recorded.get("GROUP_RANK", "")), str(recorded.get("LOCAL_WORLD_SIZE", ""))
    return group.isdigit() and int(group) < cfg.launch.nnodes and local == str(cfg.nproc_per_node)


def stand_in_at_exit(store: object, cfg: Config) -> None:
    """Check this node in at the exit barrier of torchrun's agents for the agent lost with it: the
    others wait there for every node's agent (300 s, torchrun's bound) once their workers are done.
    torch's private pieces (the barrier's key and its non-blocking half, the rendezvous round's key
    prefix: the first round, the only one under peer recovery, which restarts no agent) are all here;
    tests/launcher/test_node_return.py fails by name if an upgrade changes them."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _barrier_nonblocking

    agents = dist.PrefixStore(f"torch.rendezvous.{cfg.launch.rdzv_id}.0", store)  # type: ignore[arg-type]
    _barrier_nonblocking(agents, cfg.launch.nnodes, _TERMINAL_STATE_SYNC_ID)


def worker_envs(recorded: Mapping[str, str], base: Mapping[str, str]) -> list[dict[str, str]]:
    """Each local worker's environment, as torchrun's agent gave it to the worker it replaces."""
    local, group = int(recorded["LOCAL_WORLD_SIZE"]), int(recorded["GROUP_RANK"])
    envs = []
    for local_rank in range(local):
        rank = str(group * local + local_rank)
        envs.append({**base, **recorded, "LOCAL_RANK": str(local_rank), "RANK": rank, "ROLE_RANK": rank})
    return envs


def run_returned(
    cfg: Config, recorded: Mapping[str, str], keeper_argv: list[str], *, env: dict[str, str], lock: RunDirLock
) -> int:
    """This node's keepers, each starting its rank's worker as a replacement; returns the first
    non-zero status (a signal: 128 + it), else 0. The node's loss is recorded for each rank."""
    envs = worker_envs(recorded, env)
    ranks = [int(each["RANK"]) for each in envs]
    say(
        f"this node (group rank {recorded['GROUP_RANK']}, ranks {', '.join(map(str, ranks))}) was lost from the running "
        f"job {cfg.launch.rdzv_id}: starting its workers as replacements, which take their state from a replica"
    )
    run_dir = Path(cfg.run_dir)
    for rank in ranks:
        with contextlib.suppress(OSError):  # the record is for the report: the run goes on without it
            record(run_dir, new_loss(rank, "lost with its node", job=env.get(HELD_ENV, ""), replaced=True))
    keepers = [subprocess.Popen(keeper_argv, env=each, start_new_session=True) for each in envs]
    for keeper in keepers:
        lock.add_holder(keeper.pid, "a keeper of a returned node")

    def relay(signum: int, frame: object) -> None:
        for keeper in keepers:
            keeper.send_signal(signum)

    previous = {sig: signal.signal(sig, relay) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        codes = [keeper.wait() for keeper in keepers]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for keeper in keepers:
            wait_for_session(keeper.pid)
    failed = next((code for code in codes if code), 0)
    return failed if failed >= 0 else 128 - failed
