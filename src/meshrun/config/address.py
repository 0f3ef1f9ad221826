"""Host and port syntax of the addresses a job connects to (launch.rdzv_endpoint,
launch.local_addr, a worker's MASTER_ADDR / MASTER_PORT), checked before anything starts: torch
takes a malformed one (`[::1`, a space, an empty name) and retries it until its timeout. Torch-free."""

from __future__ import annotations

import ipaddress
import re

_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.\-]*[A-Za-z0-9_.])?")


def host_problem(host: str) -> str | None:
    """Why `host` is not a host name, an IPv4 address or an IPv6 one (bare or in brackets); None when it is one."""
    if not host:
        return "is empty"
    if any(c.isspace() for c in host):
        return "contains spaces"
    if host.startswith("[") or host.endswith("]"):
        bracketed = host.startswith("[") and host.endswith("]") and _is_ipv6(host[1:-1])
        return None if bracketed else "is not an IPv6 address in brackets, like [::1]"
    if ":" in host:
        return None if _is_ipv6(host) else "is not an IPv6 address (a host name or IPv4 address has no ':')"
    return None if _HOST_NAME.fullmatch(host) else "is not a host name or address"


def port_problem(port: str) -> str | None:
    """Why `port` is not a TCP port (1-65535, ASCII digits); None when it is one."""
    return None if re.fullmatch(r"[0-9]{1,5}", port) and 0 < int(port) < 65536 else "is not a port (1-65535)"


def split_endpoint(endpoint: str) -> tuple[str, str | None]:
    """HOST[:PORT] as torchrun splits it: (host, port or None). `[::1]` is a host without a port."""
    if endpoint.endswith("]") or ":" not in endpoint or (endpoint.startswith("[") and "]" not in endpoint):
        return endpoint, None  # a bracketed host, a name alone, or a bracket left open (host_problem says so)
    host, _, port = endpoint.rpartition(":")
    return host, port


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True
