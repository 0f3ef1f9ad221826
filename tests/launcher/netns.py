"""Two "hosts" on one machine for multi-node tests: network namespaces joined by a veth pair
(test_torchrun's nodes, test_k8s's pods)."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

SUBNET = "10.200.0"  # private test addresses; they exist only inside the namespaces made here


def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces `a` (10.200.0.1) and `b` (10.200.0.2) linked by a veth pair, as
    (namespace, veth, address); deleted afterwards. Skips (saying why) where namespaces cannot be
    made, e.g. without root. A generator for a fixture to `yield from`."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: the `ip` command (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"meshrun-{tag}-a", f"mra{tag}", f"{SUBNET}.1"), (f"meshrun-{tag}-b", f"mrb{tag}", f"{SUBNET}.2")]
    made: list[str] = []

    def ip(*args: str) -> None:
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
        if result.returncode != 0:
            raise OSError(f"ip {' '.join(args)}: {result.stderr.strip()}")

    try:
        for ns, _, _ in hosts:
            try:
                ip("netns", "add", ns)
            except OSError as exc:
                pytest.skip(f"network namespaces cannot be created here ({exc}); the loopback tests cover multi-node")
            made.append(ns)
        (ns_a, veth_a, _), (ns_b, veth_b, _) = hosts
        ip("link", "add", veth_a, "netns", ns_a, "type", "veth", "peer", "name", veth_b, "netns", ns_b)
        for ns, veth, addr in hosts:
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in made:  # deleting a namespace also deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
