"""Throughput, FLOP/s, MFU and memory: the numbers a training run is judged by."""

from __future__ import annotations

import torch

from meshrun.hardware.device import peak_rss_bytes
from meshrun.hardware.peaks import find_device


def peak_tflops(device: torch.device, configured: float | None, precision: str = "bf16") -> float | None:
    """Per-device peak for MFU: the configured value, else the GPU table for this precision, else
    unknown (None: CPU, a GPU the table does not know, or bf16 on a GPU without it)."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    spec = find_device(torch.cuda.get_device_name(device))
    return spec.peak(precision) if spec is not None else None


def mfu_note(device: torch.device, peak: float | None) -> str | None:
    """Why MFU is missing from the metrics, for a GPU whose peak is unknown (say so, never guess)."""
    if peak is not None or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return f"MFU omitted: no peak TFLOP/s known for {name!r} at this precision; set metrics.peak_tflops to report it"


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: max allocated by tensors. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return peak_rss_bytes() / 1e9


def device_utilisation(device: torch.device) -> float | None:
    """Percent of the last NVML sample period (1/6 s to 1 s) in which the GPU ran a kernel, read at
    a log step; None where the backend reports none (CPU, or no NVML library): absent, not zero."""
    if device.type != "cuda":
        return None
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # noqa: BLE001 - pynvml missing or NVML refusing: no figure rather than a wrong one
        return None


def throughput(*, tokens: int, seconds: float, flops: float, world_size: int, peak: float | None) -> dict[str, float]:
    """Global tokens/s, achieved TFLOP/s (whole job) and MFU (per-device average) for a window
    that trained `tokens` positions with `flops` model FLOPs."""
    tokens_per_s = tokens / seconds
    tflops = flops / seconds / 1e12
    row = {"tokens_per_s": tokens_per_s, "tflops": tflops}
    if peak:
        row["mfu"] = tflops / (peak * world_size)
    return row
