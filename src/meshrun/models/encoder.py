"""The built-in encoder for classification and masked_lm: GPT's blocks without the causal mask,
padding masked out of attention, and a head per task (model.head): labels or tokens. No
distributed code lives here.

Input: token ids (B, T), padding marked `PAD` (-1: no id of any vocabulary, so a tokenizer needs no
pad token of its own). Between blocks (and pipeline stages) the state is one tuple (hidden (B, T, C),
keep-mask (B, T) int64: 1 = a token), as encdec's: the mask travels with the hidden states. The head
pools the final-normed states over each sample's tokens (their mean) and maps them to (B, num_labels)
logits. Mean pooling, not the first token: the data holds the tokenizer's own ids with no [CLS]
added (data/labelled.py; bytes have no free id for one), and a mean hands every token's state a
direct gradient from the loss, which a model trained from scratch on short texts learns from faster.

The tokens head (masked_lm) maps each position's final-normed state to (B, T, vocab_size) logits,
as GPT's head does and, like it, not tied to the embedding: the two live on different pipeline
stages.
"""

from __future__ import annotations

import torch
from torch import nn

from meshrun.config.model_sections import EncoderSection
from meshrun.data.labelled_batches import PAD
from meshrun.models import gpt
from meshrun.models.init import init_transformer_
from meshrun.models.protocol import StagedModel

State = tuple[torch.Tensor, torch.Tensor]


class Embedding(gpt.Embedding):
    """GPT's token + position embedding of the ids; padding embeds as id 0 and is masked from then on."""

    # Returns the state tuple, not a tensor, by design: subclassing keeps gpt's parameter names.
    def forward(self, ids: torch.Tensor) -> State:  # pyright: ignore[reportIncompatibleMethodOverride]
        keep = (ids != PAD).long()
        return super().forward(ids * keep), keep  # (B, T, C), (B, T)


class Block(gpt.Block):
    """GPT's block, bidirectional over the tokens the state's mask keeps."""

    def __init__(self, cfg: EncoderSection) -> None:
        super().__init__(cfg, causal=False)

    def forward(self, state: State) -> State:  # pyright: ignore[reportIncompatibleMethodOverride]
        h, keep = state
        return super().forward(h, keep=keep), keep


class Norm(nn.LayerNorm):
    """The final LayerNorm, on the state's hidden states (the mask passes on to the head)."""

    def forward(self, state: State) -> State:  # pyright: ignore[reportIncompatibleMethodOverride]
        h, keep = state
        return super().forward(h), keep


class ClassifierHead(nn.Linear):
    """Mean of each sample's token states (padding left out) -> label logits (B, num_labels)."""

    def forward(self, state: State) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        h, keep = state
        weights = keep.to(h.dtype).unsqueeze(-1)  # (B, T, 1)
        pooled = (h * weights).sum(1) / weights.sum(1).clamp(min=1)  # (B, C)
        return super().forward(pooled)


class TokenHead(nn.Linear):
    """Each position's state -> token logits (B, T, vocab_size); the loss reads the chosen positions' rows."""

    def forward(self, state: State) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().forward(state[0])


class Encoder(StagedModel):
    """Embedding, bidirectional blocks, norm, the task's head: split over pipeline stages like GPT."""

    def __init__(self, cfg: EncoderSection) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = Embedding(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = Norm(cfg.dim)
        self.head: nn.Module | None = (
            TokenHead(cfg.dim, cfg.vocab_size, bias=False)
            if cfg.head == "tokens"
            else ClassifierHead(cfg.dim, cfg.num_labels)
        )

    def forward(self, *inputs: torch.Tensor) -> State | torch.Tensor:
        """Token ids (B, T) -> logits (B, num_labels) or (B, T, vocab_size); a stage after the first receives the state
        tuple (a pipeline passes it on as separate inputs), a stage before the last returns it."""
        state = self.embed(inputs[0]) if self.embed is not None else (inputs[0], inputs[1])
        for block in self.blocks.values():
            state = block(state)
        if self.norm is not None:
            state = self.norm(state)
        return self.head(state) if self.head is not None else state

    def tp_plan(self) -> dict[str, str]:
        """GPT's split of the token embedding and the blocks (q, k, v and the MLP's first matrix
        by columns, their output projections by rows); the classifier head stays whole (a few
        labels, read once per sample). No sequence-parallel styles: the pooling head reads every
        position of the (hidden, mask) state, so parallel.sequence_parallel is refused."""
        return {"embed.tok": "vocab_embedding", **gpt.BLOCK_SPLIT}

    def init_weights(self, seed: int) -> None:
        """GPT's init of the parts present, each from its own seed: any pipeline split starts identical."""
        init_transformer_(self, seed, num_layers=self.cfg.num_layers)

    def flops_per_token(self, length: int | None = None) -> float:
        """Training FLOPs per token: 6 x the blocks' matmul params + attention over the whole
        `length` (PaLM appendix B counts it whole; here every position sees every other); a labels
        head runs once per sample, not per token, and is left out, a tokens head once per token."""
        blocks = sum(p.numel() for n, p in self.named_parameters() if n.startswith("blocks."))
        c = self.cfg
        head = c.dim * c.vocab_size if c.head == "tokens" else 0
        return 6.0 * (blocks + head) + 12.0 * c.num_layers * c.dim * (length or c.seq_len)
