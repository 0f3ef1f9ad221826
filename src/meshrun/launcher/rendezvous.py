"""What a multi-node launcher says while its rendezvous gathers: whether the endpoint answers at all,
and how many nodes have joined. torchrun's agent says nothing until every node is there, and a node
cannot tell a host that is not up yet from one that never will be, so it waits `launch.rdzv_timeout`
either way: this watch makes the wait legible and gives the timeout's one line its reason.

Each node's launcher connects to the rendezvous store (the TCPStore torchrun's c10d backend serves
at `launch.rdzv_endpoint` on the host node) as one more client and adds itself to a counter of its
own key; the count it reads back is how many launchers reached the store.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from meshrun.config.address import split_endpoint
from meshrun.config.schema import Config
from meshrun.files.console import say

if TYPE_CHECKING:
    from torch.distributed import TCPStore

POLL_SECONDS = 1.0
DEFAULT_PORT = 29400  # torchrun's c10d rendezvous port where the endpoint names none


def store_address(endpoint: str) -> tuple[str, int]:
    """The host and port of the rendezvous store at `endpoint` (HOST[:PORT], an IPv6 host in brackets)."""
    host, port = split_endpoint(endpoint)
    return host.strip("[]"), int(port or DEFAULT_PORT)


def probe(host: str, port: int) -> str | None:
    """None when `host`:`port` accepts a TCP connection, else what it does instead (a store that is
    not up yet: asked this way, torch's own client would print a C++ stack for each refused try)."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return None
    except ConnectionRefusedError:
        return "refuses connections (nothing listens there yet)"
    except TimeoutError:
        return "does not answer"
    except OSError as exc:
        return f"cannot be reached ({exc.strerror or exc})"


class RendezvousWatch:
    """A daemon thread from `start()` to `stop()`: says once what the endpoint does when it does not
    accept connections, then the count of nodes each time it grows; `state()` for the last line."""

    def __init__(self, cfg: Config) -> None:
        launch = cfg.launch
        assert launch.rdzv_endpoint is not None  # nnodes > 1 needs it (config/topology.py)
        self.host, self.port = store_address(launch.rdzv_endpoint)
        self.endpoint, self.nnodes, self.key = launch.rdzv_endpoint, launch.nnodes, f"meshrun/nodes/{launch.rdzv_id}"
        self.timeout = launch.rdzv_timeout
        self.started = time.monotonic()
        self.joined = 0
        self.unreachable: str | None = None  # why the endpoint took no connection, while it does not
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshrun-rendezvous-watch", daemon=True)

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def state(self) -> str:
        """Where the gathering stood, for the timeout's line."""
        if self.joined:
            return f"{self.joined} of {self.nnodes} nodes had joined"
        if self.unreachable:
            return f"{self.endpoint} {self.unreachable}"
        return "no node reached the rendezvous store"

    def _watch(self) -> None:
        store = None
        while not self._done.is_set() and store is None:
            reason = probe(self.host, self.port)
            if reason is None:
                store = self._connect()
            elif reason != self.unreachable:
                self.unreachable = reason
                say(
                    f"rendezvous {self.endpoint} {reason}: waiting for its host node's `meshrun train`; "
                    "check --rdzv-endpoint if that node is already running"
                )
            if store is None:
                self._done.wait(POLL_SECONDS)
        if store is None:
            return
        self.unreachable = None
        # The host's agent closes its store when it gives up, rdzv_timeout after its rendezvous began,
        # which is after this watch started (with torchrun): stop asking a second before this watch's
        # own deadline, so no request is cut off by the close (torch would print a C++ stack for it).
        quiet_after = self.started + self.timeout - 1
        try:
            store.add(self.key, 1)
            while not self._done.is_set() and self.joined < self.nnodes and time.monotonic() < quiet_after:
                count = int(store.add(self.key, 0))
                if count != self.joined:
                    self.joined = count
                    say(f"rendezvous {self.endpoint}: {count} of {self.nnodes} nodes here")
                self._done.wait(POLL_SECONDS)
        except (RuntimeError, OSError):  # the store went away (the job ended or gave up): nothing more to say
            return

    def _connect(self) -> TCPStore | None:
        """A client of the rendezvous store, or None while it is not serving yet (torch imported only here)."""
        import torch.distributed as dist

        try:
            return dist.TCPStore(
                self.host, self.port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False
            )
        except (RuntimeError, OSError):  # DistStoreError and friends: the port answers, the store is not up yet
            return None
