"""A user's own model, defined outside meshrun, following meshrun's model protocol.

Different from the built-in GPT on purpose: no positional embedding, causal depthwise
convolution for token mixing, RMSNorm, SiLU-gated MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config import ModelConfig
from meshrun.models.init import seeded_normal_
from meshrun.models.protocol import StagedModel


class ConvBlock(nn.Module):
    def __init__(self, dim: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.mix = nn.Conv1d(dim, dim, kernel, groups=dim)
        self.gate, self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.norm1(x).transpose(1, 2), (self.kernel - 1, 0))  # causal: only past tokens
        x = x + self.mix(h).transpose(1, 2)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ToyLM(StagedModel):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleDict(
            {str(i): ConvBlock(cfg.dim, cfg.options.get("kernel", 3)) for i in range(cfg.num_layers)}
        )
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                seeded_normal_(param, seed, name, std=0.05)

    def flops_per_token(self) -> float:
        return 6.0 * sum(p.numel() for n, p in self.named_parameters() if not n.startswith("embed."))


def build(cfg: ModelConfig) -> ToyLM:
    return ToyLM(cfg)
