"""An encoder-decoder Transformer ("Attention is all you need", pre-LN). No distributed code lives here.

Input: token ids (B, seq_len) = [source (B, S) | decoder input (B, T)], S = `source_len`; token 0
is padding (data/pairs.py makes such batches). A shorter batch (B, L) of a length bucket holds
S = L * source_len / seq_len source tokens. Output: logits (B, T, V) for the target.

Follows the model protocol: blocks "0" .. "E-1" encode, "E" .. "L-1" decode, so a pipeline
splits encoder blocks first, then decoder blocks, with stages free to hold both kinds. Between
blocks (and pipeline stages) the state is one tuple (encoder hidden (B, S, C), decoder hidden
(B, T, C), source keep-mask (B, S) int64): the encoder output and the padding mask travel with
the decoder's hidden state. The last encoder block applies the encoder's final LayerNorm.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.config.model_sections import EncDecSection, ModelConfig, ModelSection
from meshrun.data.pairs import PAD
from meshrun.errors import ConfigError
from meshrun.models.gpt import MLP
from meshrun.models.init import init_transformer_
from meshrun.models.protocol import StagedModel

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def split_lengths(cfg: EncDecSection) -> tuple[int, int]:
    """(source tokens S, target tokens T) of model.seq_len."""
    source = cfg.source_len or cfg.seq_len // 2
    if not 1 <= source < cfg.seq_len:
        raise ConfigError(
            f"model.source_len ({source}) must be below model.seq_len ({cfg.seq_len}): the rest is the target"
        )
    return source, cfg.seq_len - source


def source_len(cfg: ModelConfig) -> int | None:
    """The encoder's share of seq_len when the config builds this model, else None (decoder-only data)."""
    return split_lengths(cfg)[0] if isinstance(cfg, EncDecSection) else None


def sinusoids(length: int, dim: int, device: torch.device) -> torch.Tensor:
    """Fixed position encodings (length, dim): sin on even channels, cos on odd (Vaswani et al. 3.5)."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)[:, : dim // 2]
    return table


class Embedding(nn.Module):
    def __init__(self, cfg: EncDecSection) -> None:
        super().__init__()
        self.source_len, self.seq_len = split_lengths(cfg)[0], cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(max(split_lengths(cfg)), cfg.dim) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)

    def _positions(self, length: int, like: torch.Tensor) -> torch.Tensor:
        if self.pos is None:
            return sinusoids(length, like.shape[-1], like.device)
        return self.pos(torch.arange(length, device=like.device))

    def forward(self, ids: torch.Tensor) -> State:
        split = ids.shape[1] * self.source_len // self.seq_len  # a length bucket keeps the source's share
        source, target = ids[:, :split], ids[:, split:]
        enc, dec = self.tok(source), self.tok(target)
        enc = self.drop(enc + self._positions(source.shape[1], enc))  # (B, S, C)
        dec = self.drop(dec + self._positions(target.shape[1], dec))  # (B, T, C)
        return enc, dec, (source != PAD).long()


class Attention(nn.Module):
    """Multi-head attention of x over `memory` (itself for self-attention). Separate q, k, v
    projections and a head count read from the width they return, as in gpt.py: a column split
    of each holds whole heads, so the same forward runs on a tensor-parallel shard."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.head_dim, self.dropout = cfg.dim // cfg.num_heads, cfg.dropout
        self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        *,
        keep: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Self-attention without `memory`: x is given once (a sequence-parallel gather gathers it once)."""
        memory = x if memory is None else memory
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k, v = (p(memory).view(b, memory.shape[1], -1, self.head_dim).transpose(1, 2) for p in (self.k, self.v))
        mask = keep.bool()[:, None, None, :] if keep is not None else None  # (B, 1, 1, S): True = attend
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class EncoderBlock(nn.Module):
    """Pre-LN self-attention over the unpadded source, then MLP; the last one also normalises the output."""

    def __init__(self, cfg: ModelSection, *, last: bool) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.dim), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.dim), MLP(cfg)
        self.out_norm = nn.LayerNorm(cfg.dim) if last else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, state: State) -> State:
        enc, dec, keep = state
        h = self.ln1(enc)
        enc = enc + self.drop(self.attn(h, keep=keep))
        enc = enc + self.drop(self.mlp(self.ln2(enc)))
        return (self.out_norm(enc) if self.out_norm is not None else enc), dec, keep


class DecoderBlock(nn.Module):
    """Pre-LN causal self-attention, cross-attention to the encoder output, MLP."""

    def __init__(self, cfg: ModelSection) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.dim), Attention(cfg)
        self.ln2, self.cross = nn.LayerNorm(cfg.dim), Attention(cfg)
        self.ln3, self.mlp = nn.LayerNorm(cfg.dim), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, state: State) -> State:
        enc, dec, keep = state
        h = self.ln1(dec)
        dec = dec + self.drop(self.attn(h, causal=True))
        dec = dec + self.drop(self.cross(self.ln2(dec), enc, keep=keep))
        return enc, dec + self.drop(self.mlp(self.ln3(dec))), keep


class DecoderNorm(nn.LayerNorm):
    """The decoder's final LayerNorm: takes the whole state, returns the decoder hidden (B, T, C)."""

    # Takes the state tuple, not LayerNorm's tensor, by design: subclassing keeps LayerNorm's parameter names.
    def forward(self, state: State) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        return super().forward(state[1])


class TiedHead(nn.Module):
    """Logits from the token embedding matrix; holds the embedding unregistered so the matrix keeps one name."""

    embedding: nn.Embedding

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.__dict__["embedding"] = embedding  # not a submodule: named once, as embed.tok.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.embedding.weight)


class EncDec(StagedModel):
    def __init__(self, cfg: EncDecSection) -> None:
        super().__init__()
        num_encoder = cfg.encoder_layers or cfg.num_layers // 2
        if not 1 <= num_encoder < cfg.num_layers:
            raise ConfigError(
                f"model.encoder_layers ({num_encoder}) must be at least 1 and below model.num_layers "
                f"({cfg.num_layers}): the remaining blocks decode"
            )
        self.cfg, self.num_encoder = cfg, num_encoder
        self.embeds_input = True  # False on pipeline stages after the first (they receive the state)
        self.embed: nn.Module | None = Embedding(cfg)
        self.blocks = nn.ModuleDict(
            {
                str(i): EncoderBlock(cfg, last=i == num_encoder - 1) if i < num_encoder else DecoderBlock(cfg)
                for i in range(cfg.num_layers)
            }
        )
        self.norm: nn.Module | None = DecoderNorm(cfg.dim)
        self.head: nn.Module | None = (
            TiedHead(self.embed.tok) if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        )

    def tp_plan(self) -> dict[str, str]:
        """Megatron's split, as gpt.py's: every attention's q, k, v (cross-attention's k and v read
        the encoder output) and each MLP's first matrix by columns, their output projections by
        rows; the vocabulary split in the token embedding and the head (tied or not). Sequence
        parallel splits the state's encoder and decoder hidden states by position (the source
        mask stays whole): the norms run on a rank's positions, attention (cross-attention: its
        queries and the encoder output) and the MLPs gather the whole sequences."""
        attention = {f"blocks.*.{a}.{m}": "colwise" for a in ("attn", "cross") for m in "qkv"}
        return {
            "embed": "scatter_state",
            "blocks.*.ln?": "norm",
            "blocks.*.out_norm": "norm",
            "norm": "norm_state",
            "blocks.*.attn": "gather",
            "blocks.*.cross": "gather_pair",
            "blocks.*.mlp": "gather",
            "embed.tok": "vocab_embedding",
            **attention,
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.cross.proj": "rowwise",
            "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise",
            "head": "tied_vocab_head" if self.cfg.tie_embeddings else "vocab_head",
        }

    @property
    def tied_weight(self) -> str | None:
        """The matrix the first and last pipeline stage each hold a copy of (see parallel/tied.py)."""
        return "embed.tok.weight" if self.cfg.tie_embeddings else None

    def keep_stage(self, *, first: bool, last: bool) -> None:
        """Drop the parts another stage owns; a tied last stage keeps the token matrix for its head."""
        if not last:
            self.norm = self.head = None
        if first:
            return
        self.embeds_input = False
        if last and self.cfg.tie_embeddings and isinstance(self.embed, Embedding):
            self.embed.pos = None  # the head needs only the token matrix
        else:
            self.embed = None

    def forward(self, *inputs: torch.Tensor) -> State | torch.Tensor:
        """Token ids (B, S + T) -> logits (B, T, V); a stage after the first receives the state tuple."""
        # embeds_input: this stage owns the embedding; pruned norm and head go together
        state = self.embed(inputs[0]) if self.embeds_input and self.embed is not None else cast(State, inputs)
        for block in self.blocks.values():
            state = block(state)
        if self.norm is None or self.head is None:
            return state
        return self.head(self.norm(state))

    def init_weights(self, seed: int) -> None:
        """Each parameter from its own (seed, name) stream, so any pipeline split starts identical."""
        init_transformer_(self, seed, num_layers=self.cfg.num_layers)

    def flops_per_token(self, length: int | None = None) -> float:
        """Training FLOPs per token of `length`-token samples (default model.seq_len; a bucket keeps
        the source's share): 6 x matmul params on the tokens they see (cross-attention's K/V
        projections see the source) + attention (PaLM appendix B)."""
        c = self.cfg
        length = length or c.seq_len
        source = length * split_lengths(c)[0] // c.seq_len
        target = length - source
        params = {"enc": 0, "dec": 0, "memory": 0}
        for name, p in self.named_parameters():
            if name.startswith("blocks."):
                encoder = int(name.split(".")[1]) < self.num_encoder
                memory = ".cross.k." in name or ".cross.v." in name
                params["enc" if encoder else "memory" if memory else "dec"] += p.numel()
        head = c.dim * c.vocab_size
        num_decoder = c.num_layers - self.num_encoder
        per_sample = 6.0 * ((params["enc"] + params["memory"]) * source + (params["dec"] + head) * target)
        per_sample += 12.0 * c.dim * (self.num_encoder * source * source + num_decoder * target * (target + source))
        return per_sample / length
