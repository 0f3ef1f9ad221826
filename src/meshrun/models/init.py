"""Layout-independent initialisation helpers shared by all models."""

from __future__ import annotations

import zlib

import torch
from torch import nn


def named_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, parameter name).

    Seeding by name rather than by draw order means a stage that holds only blocks 4-7
    draws exactly what the single-process model draws for them, on any device.
    """
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def seeded_normal_(
    tensor: torch.Tensor, seed: int, name: str, *, std: float, rows: tuple[int, int] | None = None
) -> None:
    """Fill `tensor` from the (seed, parameter name) generator (`named_generator`). `rows` (first,
    total): `tensor` holds rows first .. of a tensor of `total` rows (a rank's experts), drawn whole
    (one tensor at a time) for the same values at every split."""
    shape = tensor.shape if rows is None else (rows[1], *tensor.shape[1:])
    values = torch.randn(shape, generator=named_generator(seed, name), dtype=torch.float32) * std
    tensor.copy_(values if rows is None else values[rows[0] : rows[0] + tensor.shape[0]])


@torch.no_grad()
def init_transformer_(model: nn.Module, seed: int, *, num_layers: int) -> None:
    """GPT-2 style init of the parts present, each parameter from its own (seed, name) stream so any
    pipeline split starts identical: normal(0.02) matrices, depth-scaled residual projections
    (names ending in `.proj`), zero biases, unit LayerNorms."""
    std, depth_std = 0.02, 0.02 / (2 * num_layers) ** 0.5
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            seeded_normal_(module.weight, seed, name, std=depth_std if name.endswith(".proj") else std)
            if (bias := getattr(module, "bias", None)) is not None:
                bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
