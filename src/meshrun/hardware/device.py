"""This process's device and the backend that goes with it (chosen here and nowhere else), and how much
memory one rank has on it."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch


def local_device() -> torch.device:
    """This process's device: the GPU LOCAL_RANK picks when CUDA is visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def rank_memory_bytes(ranks_per_node: int) -> tuple[int, str]:
    """Memory one rank has here (bytes) and what it is, for --dry-run's warning: the GPU's own
    memory, else the host's RAM shared by this node's ranks."""
    device = local_device()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the {props.total_memory / 2**30:.1f} GiB of this machine's {props.name}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = host // ranks_per_node
    if ranks_per_node == 1:
        return share, f"this host's {host / 2**30:.1f} GiB"
    return share, f"its {share / 2**30:.1f} GiB share of this host's {host / 2**30:.1f} GiB ({ranks_per_node} ranks)"


def pick_device() -> tuple[torch.device, str]:
    """CUDA + nccl when a GPU is visible (LOCAL_RANK picks it), else CPU + gloo."""
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return device, "nccl"
    return device, "gloo"


def peak_rss_bytes() -> int:
    """This process's peak resident set size. Linux: the memory map's high-water mark (VmHWM), not
    getrusage's ru_maxrss, which execve keeps from the process that started it: a worker spawned
    by a 0.8 GB parent read 0.8 GB however little it used itself."""
    if sys.platform.startswith("linux"):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
