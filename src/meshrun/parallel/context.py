"""Context parallelism over positions, Ulysses style (DeepSpeed Ulysses / ALST), `parallel.cp`.

Outside attention each rank of a cp group holds T / cp contiguous positions of every sample (the
chunk at its cp coordinate: `shard_batch`). Inside attention an all-to-all over the cp group trades
positions for heads: a rank gets all T positions of heads / cp of the heads, attends (causally, or
within each document of a packed row, with the whole row's positions gathered: every rank sees
whole documents), and a second all-to-all hands each rank back its positions of every head.

Why this kind: torch's ring attention (`context_parallel`) has no CPU kernel; the head-scattering
kind runs on gloo and NCCL alike and composes with document masks. It needs the heads a rank holds
after tp divisible by cp (config/context.py refuses the rest before any worker).

Positions travel with the inputs: a plain batch becomes a packed-form one, (ids, positions) (B, 2,
T / cp), whose positions are the chunk's global ones, so learned and rotary position embeddings
read the same positions as one process (models/documents.py's packed input, which the supported
models take). The models hold no distributed code: this module wraps their attention core, the
built-in GPT's `Attention.core` and transformers' attention function (a layer's
`config._attn_implementation`, named `HF_CONTEXT_ATTENTION`). A block holding them does not
compile whole (`train.compile` compiles each block as one graph): under `auto` it runs eager.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshrun.models.documents import hf_attention
from meshrun.models.gpt import Attention
from meshrun.models.protocol import ProtocolModule
from meshrun.parallel.mesh import Mesh

HF_CONTEXT_ATTENTION = "meshrun_cp_sdpa"  # HF_ATTENTION (models/documents.py) between the two all-to-alls


def shard_batch(x: torch.Tensor, y: torch.Tensor, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's chunk of a batch: inputs (B, 2, T / cp), ids with their global positions (a
    plain (B, T) batch gains 0 .. T-1), targets (B, T / cp). The whole batch where cp is 1."""
    cp = mesh.size("cp")
    if cp == 1:
        return x, y
    if x.dim() == 2:  # plain rows: positions 0 .. T-1
        positions = torch.arange(x.shape[1], device=x.device, dtype=x.dtype).expand_as(x)
        x = torch.stack([x, positions], dim=1)
    rank = mesh.coordinates.cp
    return x.chunk(cp, dim=-1)[rank].contiguous(), y.chunk(cp, dim=-1)[rank].contiguous()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over equal pieces along dim 0 (piece j to rank j); its backward is the same
    exchange of the gradients (torch.distributed.nn's is deprecated, the functional one private)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grads[0].contiguous(), ctx.group), None


def exchange(x: torch.Tensor, group: dist.ProcessGroup, *, split: int, join: int) -> torch.Tensor:
    """`x` cut into cp pieces along dim `split`, piece j sent to cp rank j; the pieces received,
    in cp-rank order, joined along dim `join` (differentiable)."""
    pieces = torch.stack(x.chunk(dist.get_world_size(group), dim=split))
    return torch.cat(_AllToAll.apply(pieces, group).unbind(0), dim=join)


def whole_positions(positions: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole rows' positions (B, T) from every cp rank's chunk (B, T / cp): where documents are."""
    chunks = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(chunks, positions.contiguous(), group=group)
    return torch.cat(chunks, dim=1)


def gpt_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    core: Any,
    group: dist.ProcessGroup,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """GPT's attention core on (B, H, T / cp, D) q, k, v: all positions of H / cp heads, `core`
    on them, each rank's positions of every head back."""
    q, k, v = (exchange(t, group, split=1, join=2) for t in (q, k, v))  # (B, H / cp, T, D)
    y = core(q, k, v, whole_positions(positions, group), dropout_p=dropout_p)
    return exchange(y, group, split=2, join=1)  # (B, H, T / cp, D)


def hf_context_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function (registered as HF_CONTEXT_ATTENTION) for a layer whose
    `context_group` this module set: (B, H, T / cp, D) in, (B, T / cp, H, D) out, as theirs."""
    if position_ids is None:
        raise RuntimeError("context parallel attention needs the layer's position_ids (parallel/context.py)")
    group: dist.ProcessGroup = module.context_group  # pyright: ignore[reportAssignmentType]
    query, key, value = (exchange(t, group, split=1, join=2) for t in (query, key, value))
    out, _ = hf_attention(module, query, key, value, attention_mask, whole_positions(position_ids, group), **kwargs)
    return exchange(out, group, split=1, join=2), None  # (B, T, H / cp, D) -> (B, T / cp, H, D)


def apply_context_parallel(part: ProtocolModule, mesh: Mesh) -> ProtocolModule:
    """The part with every attention core wrapped in the two all-to-alls over the cp group (in place;
    nothing where cp is 1). The GPT blocks' `Attention`, and transformers' attention modules (those
    with a `config` naming their attention function), each given a config of its own naming
    HF_CONTEXT_ATTENTION."""
    if mesh.size("cp") == 1:
        return part
    group = mesh.group("cp")
    for module in part.modules():
        if isinstance(module, Attention):
            module.core = partial(gpt_core, core=module.core, group=group)
        elif type(module).__name__.endswith("Attention") and hasattr(module, "config"):
            register_hf_context_attention()
            layer: Any = module  # transformers' attention module: a config of its own, read at every call
            layer.config = copy.copy(layer.config)
            layer.config._attn_implementation = HF_CONTEXT_ATTENTION
            layer.context_group = group
    return part


def register_hf_context_attention() -> None:
    """Make HF_CONTEXT_ATTENTION known to transformers (idempotent; imported only for its models)."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_CONTEXT_ATTENTION, hf_context_attention)
