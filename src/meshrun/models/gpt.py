"""A GPT-style decoder-only Transformer. No distributed code lives here.

Follows the model protocol in `meshrun.models.families`: `embed`, `blocks` (ModuleDict keyed str(i)),
`norm`, `head`; each may be pruned away (set to None / deleted) for a pipeline stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config.model_sections import ModelSection
from meshrun.models.documents import causal_attention
from meshrun.models.init import init_transformer_
from meshrun.models.protocol import StagedModel


class Embedding(nn.Module):
    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: a packed row's (B, T), restarting per document; None: 0 .. T-1."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))  # (B, T, C)


class Attention(nn.Module):
    """Separate q, k, v projections: a column split of each holds whole heads (a split of one fused
    [q; k; v] matrix would not), so the same forward runs on a tensor-parallel shard: the head
    count comes from the width the projections return. `causal` False: every position attends to
    every position `keep` marks (the encoder's padding mask, (B, T), nonzero = a token). `core`:
    the causal attention on (B, H, T, D) q, k, v, a seam where parallel/context.py puts its all-to-alls."""

    core: Callable[..., torch.Tensor] = staticmethod(causal_attention)

    def __init__(self, cfg: ModelSection, *, causal: bool = True) -> None:
        super().__init__()
        self.head_dim, self.dropout, self.causal = cfg.dim // cfg.num_heads, cfg.dropout, causal
        self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`positions` (a packed row's): each document attends only to itself. Not causal: every
        token attends to every token `keep` marks."""
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, H, T, D)
        p = self.dropout if self.training else 0.0
        if self.causal:
            y = self.core(q, k, v, positions, dropout_p=p)
        else:
            mask = None if keep is None else keep.bool()[:, None, None, :]  # (B, 1, 1, T): True = attend
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm residual block; `causal` False: bidirectional over the tokens `keep` marks."""

    def __init__(self, cfg: ModelSection, *, causal: bool = True) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.dim), Attention(cfg, causal=causal)
        self.ln2, self.mlp = nn.LayerNorm(cfg.dim), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        # by keyword (a tp hook sees x alone), and only when given: an Attention subclass taking x alone still fits
        given = {name: t for name, t in (("positions", positions), ("keep", keep)) if t is not None}
        x = x + self.drop(self.attn(self.ln1(x), **given))
        return x + self.drop(self.mlp(self.ln2(x)))


# A block's tp plan (Megatron's): q, k, v and the MLP's first matrix by columns, whole heads per
# rank; the output projections by rows. Every model built of these blocks uses it (encoder, timeseries).
BLOCK_SPLIT = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
}
# and under sequence parallel: the norms on a rank's positions, attention and the MLP gather them all
BLOCK_SEQUENCE_SPLIT = {
    "blocks.*.ln1": "norm",
    "blocks.*.ln2": "norm",
    "blocks.*.attn": "gather",
    "blocks.*.mlp": "gather",
}


class GPT(StagedModel):
    takes_documents = True  # packed rows: positions reach the embedding and every attention

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = Embedding(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(cfg.dim)
        # Not tied to the embedding: the two usually live on different pipeline stages.
        self.head: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def tp_plan(self) -> dict[str, str]:
        """Megatron's split: q, k, v and the MLP's first matrix by columns (whole heads per rank),
        their output projections by rows; the vocabulary split in the embedding and the head.
        Sequence parallel splits the residual stream by position from the embedding's output on:
        the norms run on a rank's positions, attention and the MLP gather the whole sequence."""
        return {
            "embed": "scatter",
            "embed.tok": "vocab_embedding",
            **BLOCK_SEQUENCE_SPLIT,
            "norm": "norm",
            **BLOCK_SPLIT,
            "head": "vocab_head",
        }

    def init_weights(self, seed: int) -> None:
        """Initialise the parts present, each from its own seed, so any pipeline split starts identical."""
        init_transformer_(self, seed, num_layers=self.cfg.num_layers)

    def flops_per_token(self, length: int | None = None) -> float:
        """Training FLOPs per token of `length`-token samples (default model.seq_len): 6 x matmul
        params + causal attention, which grows with the length (PaLM appendix B)."""
        matmul_params = sum(p.numel() for n, p in self.named_parameters() if not n.startswith("embed."))
        c = self.cfg
        return 6.0 * matmul_params + 12.0 * c.num_layers * c.dim * (length or c.seq_len)
