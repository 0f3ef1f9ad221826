"""The built-in time-series Transformer for regression: a value projection (Linear features -> dim)
in place of a token embedding, learned positions, GPT's causal blocks (each step sees only its
past), a final LayerNorm, and a linear head that maps the last step's state to the next `horizon`
steps' values. No distributed code lives here.

Input: past values (B, seq_len, features), float, standardised (data/series.py). Between blocks
(and pipeline stages) the state is the hidden states (B, T, C) alone, as GPT's. Output: (B,
horizon, features). Causal blocks: the last step's state is the only one the head reads, and it
sees the whole window either way; causal attention lets the same weights forecast from a shorter
window's last step, and it is GPT's blocks unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from meshrun.config.model_sections import TimeSeriesSection
from meshrun.models import gpt
from meshrun.models.init import init_transformer_
from meshrun.models.protocol import StagedModel


class ValueEmbedding(nn.Module):
    """Each step's values projected to the model width, plus its learned position."""

    def __init__(self, cfg: TimeSeriesSection) -> None:
        super().__init__()
        self.value = nn.Linear(cfg.features, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(values.shape[1], device=values.device)
        return self.drop(self.value(values) + self.pos(positions))  # (B, T, C)


class ForecastHead(nn.Linear):
    """The last step's state -> the next `horizon` steps' values (B, horizon, features)."""

    def __init__(self, cfg: TimeSeriesSection) -> None:
        super().__init__(cfg.dim, cfg.horizon * cfg.features)
        self.horizon, self.features = cfg.horizon, cfg.features

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h[:, -1]).view(h.shape[0], self.horizon, self.features)


class TimeSeries(StagedModel):
    """Value projection, causal blocks, norm, forecast head: split over pipeline stages like GPT
    (StagedModel's forward: a stage hands the next its hidden states)."""

    def __init__(self, cfg: TimeSeriesSection) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = ValueEmbedding(cfg)
        self.blocks = nn.ModuleDict({str(i): gpt.Block(cfg) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(cfg.dim)
        self.head: nn.Module | None = ForecastHead(cfg)

    def tp_plan(self) -> dict[str, str]:
        """GPT's split of the blocks (models/gpt.py); the value projection and the forecast head
        stay whole (features and horizon x features wide: nothing worth splitting). Sequence
        parallel splits the residual stream by position from the value embedding's output on, and
        the head gathers it back (it reads the last step, which one rank holds)."""
        return {"embed": "scatter", **gpt.BLOCK_SEQUENCE_SPLIT, "norm": "norm", **gpt.BLOCK_SPLIT, "head": "gather"}

    def init_weights(self, seed: int) -> None:
        """GPT's init of the parts present, each from its own seed: any pipeline split starts identical."""
        init_transformer_(self, seed, num_layers=self.cfg.num_layers)

    def flops_per_token(self, length: int | None = None) -> float:
        """Training FLOPs per time step: 6 x the value projection's and the blocks' matmul params +
        causal attention over `length` (PaLM appendix B); the head runs once per sample and is left out."""
        counted = sum(p.numel() for n, p in self.named_parameters() if n.startswith(("blocks.", "embed.value.")))
        c = self.cfg
        return 6.0 * counted + 12.0 * c.num_layers * c.dim * (length or c.seq_len)
