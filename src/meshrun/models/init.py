"""Layout-independent initialisation helpers shared by all models."""

from __future__ import annotations

import zlib

import torch


def seeded_normal_(tensor: torch.Tensor, seed: int, name: str, *, std: float) -> None:
    """Fill `tensor` from a generator seeded by (seed, parameter name), on the CPU.

    Seeding by name rather than by draw order means a stage that holds only blocks 4-7
    draws exactly what the single-process model draws for them, on any device.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std
    tensor.copy_(values)
