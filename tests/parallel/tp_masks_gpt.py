"""A GPT that checks its dropout masks across the ranks of one tp group (run with tp = world size),
every step: the residual stream's masks equal on every rank without sequence parallel (the
activations are replicated) and different with it (each rank holds its own positions); the
attention probabilities' masks different (each rank holds its own heads). Its attention applies
dropout to the probabilities itself, as sdpa's math does, so the mask can be read. Used through
`model.factory: tp_masks_gpt:build`; same parameters as the plain GPT."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshrun.config.schema import ModelConfig
from meshrun.models.gpt import GPT, Attention


def _check(mask: torch.Tensor, *, equal: bool, where: str) -> None:
    """`mask` (True = dropped) equal on every rank, or different on every pair; never empty."""
    copies = [torch.empty_like(mask) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, mask.contiguous())
    if not mask.any():
        raise RuntimeError(f"{where}: nothing dropped (is dropout on?)")
    same = [torch.equal(copies[0], c) for c in copies[1:]]
    if (equal and not all(same)) or (not equal and any(same)):
        raise RuntimeError(f"{where}: the tp ranks' masks are {'not ' if equal else ''}equal")


class MaskedAttention(Attention):
    """The GPT's causal attention on this rank's heads, its probabilities' dropout done in the open."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, H, T, D)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        probs = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf")).softmax(
            -1
        )
        dropped = F.dropout(probs, self.dropout, self.training)
        if self.training:
            _check((dropped == 0) & (probs != 0), equal=False, where="attention probabilities")
        return self.proj((dropped @ v).transpose(1, 2).reshape(b, t, -1))


def _check_residual(module: nn.Module, inputs: tuple, output: torch.Tensor, *, seq_len: int) -> None:
    (x,) = inputs
    if module.training:  # split by position under sequence parallel: masks differ; else replicated: equal
        _check((output == 0) & (x != 0), equal=x.shape[1] == seq_len, where="residual dropout")


def _same_on_every_rank(module: nn.Module, inputs: tuple, *, seq_len: int) -> None:
    (x,) = inputs
    copies = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, x.detach().contiguous())
    if x.shape[1] == seq_len and not all(torch.equal(copies[0], c) for c in copies[1:]):
        raise RuntimeError("the tp ranks' hidden states differ before the final norm")


def build(cfg: ModelConfig) -> GPT:
    model = GPT(cfg)
    residual = partial(_check_residual, seq_len=cfg.seq_len)
    for block in model.blocks.values():
        block.attn = MaskedAttention(cfg)  # the same parameters, by name
        block.drop.register_forward_hook(residual)
    assert model.embed is not None and model.norm is not None
    model.embed.drop.register_forward_hook(residual)  # before the scatter: the whole sequence, equal masks
    # before the replicated-input hook tp adds
    model.norm.register_forward_pre_hook(partial(_same_on_every_rank, seq_len=cfg.seq_len))
    return model
