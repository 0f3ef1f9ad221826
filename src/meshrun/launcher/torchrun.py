"""Config -> torchrun argv (single node today; multi-node flags slot in here)."""

from __future__ import annotations

import sys

from meshrun.config import Config

# torchrun's agent shares its TCPStore with the workers by default; after a restart the store
# keeps stale addresses and gloo fails to connect (pytorch #135712). Not sharing it is reliable.
WORKER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_argv(cfg: Config, worker_args: list[str]) -> list[str]:
    """One node, `dp x pp` processes; rendezvous on a free local port (--standalone)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.world_size}",
        "-m",
        "meshrun",
        *worker_args,
    ]
