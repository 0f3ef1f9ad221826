"""Several torchrun agents started at once as the nodes of one job (over loopback, or inside
network namespaces): shared by the multi-node tests."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
from conftest import kill_tree


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run_nodes(nodes: list[tuple[list[str], dict[str, str]]], *, cwd: Path, timeout: float = 240) -> list[str]:
    """Start one agent command per node at once; all must exit 0. Returns each node's output
    (stdout and stderr). Every process group is killed on timeout or failure, so no worker outlives
    the test."""
    procs = [
        subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for argv, env in nodes
    ]
    outputs = finish(procs, timeout)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, f"node command {proc.args} exited {proc.returncode}\n{out[-6000:]}"
    return outputs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's output once it ends; past `timeout` the test fails, and every process still
    running is killed with its sessions' workers (they live in sessions of their own: a group kill
    misses them)."""
    outputs = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"{proc.args} did not end within {timeout} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    return outputs
