"""Packed rows: several documents in one row, each attending only to itself. No distributed code.

A packed batch's input is one integer tensor (B, 2, T): token ids, then position ids that
restart at 0 where each document begins (data/packed.py makes it; a row's padding tail is one
more such run). Positions alone say where the documents are, as transformers reads packed
sequences (`position_ids` restarting at 0), so they are all that travels with the hidden states
between pipeline stages: a stage of a packed batch hands on (hidden, positions).

Attention within documents is causal attention computed on each document's slice of the row:
only the diagonal blocks of the row's attention, never a (T x T) mask (docs/guides/conversations.md
measured it on CPU against a dense block-diagonal mask and flex_attention, which has no CPU
backward in torch 2.13). The slices are read on the host from the positions: free on CPU; on a
GPU it is one device-to-host copy of (B, T) integers per layer call.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DIMS = 3  # (B, 2, T): ids and positions


def unpack(x: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ids or hidden states, positions): a packed input (B, 2, T) split in two; else as given."""
    if positions is None and x.dim() == PACKED_DIMS and not x.is_floating_point():
        return x[:, 0].contiguous(), x[:, 1].contiguous()  # positions travel to the next stage whole
    return x, positions


def handed_on(x: torch.Tensor, positions: torch.Tensor | None) -> Any:
    """What a stage that is not the last hands the next: its hidden states, with the positions of a packed batch."""
    return x if positions is None else (x, positions)


def document_lengths(positions: torch.Tensor) -> list[list[int]]:
    """Per row of positions (B, T), the lengths of its documents in order (a new one wherever a position is 0)."""
    starts = positions.eq(0)
    starts[:, 0] = True
    rows = []
    for row in starts.cpu():
        at = [*row.nonzero().flatten().tolist(), row.numel()]
        rows.append([b - a for a, b in pairwise(at)])
    return rows


def _attend_within_documents(
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    out_dim: int = 2,
) -> torch.Tensor:
    """`attend(q, k, v)` (causal, on tensors (1, H, t, D)) on each document's slice of each row,
    concatenated along the output's positions dimension `out_dim`."""
    rows = []
    for r, lengths in enumerate(document_lengths(positions)):
        pieces = zip(*(t[r : r + 1].split(lengths, dim=2) for t in (q, k, v)), strict=True)
        rows.append(torch.cat([attend(qs, ks, vs) for qs, ks, vs in pieces], dim=out_dim))
    return torch.cat(rows, dim=0)


def attend_within_documents(*args: Any, **kwargs: Any) -> torch.Tensor:
    """`_attend_within_documents` kept out of compiled graphs: a Python loop over slices whose
    lengths change every batch. meshrun compiles whole blocks (fullgraph), so dynamo stops at it with
    its own Unsupported error, which parallel/compile.py catches (auto: the block runs eager;
    tracing the loop would raise a data-dependent guard error it does not catch). train.compile
    true on documents data is refused before any worker (preflight.py)."""
    return _eager()(*args, **kwargs)


@cache
def _eager() -> Callable[..., torch.Tensor]:
    """torch.compiler.disable on first use, not at import: it imports torch._dynamo, which fixes
    inductor's cache folder (/tmp) before meshrun sets its own (parallel/compile.py)."""
    return torch.compiler.disable(_attend_within_documents)  # pyright: ignore[reportReturnType]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, *, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal SDPA (B, H, T, D): over the whole row, or within each document of a packed row."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)

    return attend(q, k, v) if positions is None else attend_within_documents(attend, q, k, v, positions)


HF_ATTENTION = "meshrun_sdpa"  # transformers' sdpa, within documents when the layer is given position_ids


def hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' layers (registered as HF_ATTENTION): its own
    `sdpa_attention_forward` (GQA and all), on the whole row or, given a packed row's
    `position_ids`, on each document's slice. Returns (B, T, H, D) as transformers' do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if position_ids is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0]

    return attend_within_documents(attend, query, key, value, position_ids, out_dim=1), None


def register_hf_attention() -> str:
    """Make HF_ATTENTION known to transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, hf_attention)
    return HF_ATTENTION
