"""Throughput, FLOP/s, MFU and memory: the numbers a training run is judged by."""

from __future__ import annotations

import resource
import sys

import torch

# Dense bf16/fp16 tensor-core peak TFLOP/s of one device, by a substring of its CUDA name.
# Order matters: the first match wins ("H100 PCIe" before "H100").
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("V100", 125.0),
    ("T4", 65.0),
)


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Per-device peak for MFU: the configured value, else the table, else unknown (CPU)."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: max allocated by tensors. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


def throughput(
    *, tokens: int, seconds: float, flops_per_token: float, world_size: int, peak: float | None
) -> dict[str, float]:
    """Global tokens/s, achieved TFLOP/s (whole job) and MFU (per-device average) for a window."""
    tokens_per_s = tokens / seconds
    tflops = tokens_per_s * flops_per_token / 1e12
    row = {"tokens_per_s": tokens_per_s, "tflops": tflops}
    if peak:
        row["mfu"] = tflops / (peak * world_size)
    return row
