"""tp style `moe_block` where parallel.ep spans the tp ranks, without sequence parallel: each tp rank
routes its own 1/tp of the block's replicated positions and the output is gathered back whole
(parallel/experts.py says why; tp_styles.py's `moe_block` record picks this form)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle


class TokenShare(ParallelStyle):
    """tp style `moe_block` where ep spans tp, without sequence parallel: the block computes on this tp
    rank's 1/tp of its replicated input's positions, and its output is gathered back whole over tp
    (Megatron's scatter-to and gather-from the tp region: each backward the other's forward)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        module.register_forward_pre_hook(lambda _m, args: (_OwnPositions.apply(args[0], group), *args[1:]))
        module.register_forward_hook(lambda _m, _args, out: _AllPositions.apply(out, group))
        return module


def _positions_gathered(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every tp rank's positions (dim 1) of `x`, in rank order (equal shares: check_tensor_split)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _own_positions(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This tp rank's share of `x`'s positions (dim 1)."""
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


class _OwnPositions(torch.autograd.Function):
    """Forward: this rank's positions of a replicated tensor; backward: the gradient all-gathered (each
    tp rank's positions reached the loss through their own rank only)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _own_positions(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _positions_gathered(grad, ctx.group), None


class _AllPositions(torch.autograd.Function):
    """Forward: every rank's positions gathered; backward: this rank's positions' gradient (every tp
    rank holds the same whole gradient of a replicated tensor: summing them would count it tp times)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _positions_gathered(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _own_positions(grad, ctx.group), None
