"""Config -> torchrun argv: one node on a free local port, or many nodes through c10d rendezvous."""

from __future__ import annotations

import os
import sys

from meshrun.config import Config

# torchrun's agent shares its TCPStore with the workers by default; after a restart the store
# keeps stale addresses and gloo fails to connect (pytorch #135712). Not sharing it is reliable.
WORKER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
AGENT = "meshrun.launcher.agent"


def torchrun_argv(cfg: Config, worker_args: list[str]) -> list[str]:
    """The torchrun command for this node; `worker_args` are `meshrun` arguments for each worker.

    One node without an endpoint: `--standalone` (a private rendezvous on a free port). Otherwise
    c10d rendezvous at `launch.rdzv_endpoint`: every node runs the same command (only `local_addr`
    and `host_node` differ), and torchrun numbers the nodes as they join.
    """
    launch = cfg.launch
    argv = [sys.executable, "-m", AGENT]  # torch.distributed.run, without a traceback on a stop
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        argv.append("--standalone")
    else:
        argv += [
            f"--nnodes={launch.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={launch.rdzv_endpoint}",
            f"--rdzv-id={launch.rdzv_id}",
        ]
        if launch.host_node is not None:  # the host binds the store; the others only connect
            argv.append(f"--rdzv-conf=is_host={int(launch.host_node)}")
        if launch.local_addr is not None:
            argv.append(f"--local-addr={launch.local_addr}")
    argv += [
        f"--nproc-per-node={cfg.nproc_per_node}",
        f"--max-restarts={launch.max_restarts}",
        "-m",
        "meshrun",
        *worker_args,
    ]
    return argv


def in_launched_worker() -> bool:
    """True inside torchrun / Slurm-started workers (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
