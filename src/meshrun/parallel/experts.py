"""Expert parallelism (`parallel.ep`): each MoE layer's experts split over the ep ranks, every token
sent to the ranks of the experts its router chose and back.

An experts module is any module holding 3-D parameters `gate_up_proj` [E, 2 I, H] and `down_proj`
[E, H, I], called as `experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])`: transformers'
Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE (5.x) and meshrun's MoE GPT. Under ep each rank keeps E / ep
consecutive experts (ep rank e: experts e E/ep .. (e + 1) E/ep - 1) and the module's forward becomes
  1. dispatch: the (token, choice) pairs sorted by expert, the counts exchanged, the rows sent to the
     ranks holding their experts by `all_to_all_single` with uneven splits (dropless: no capacity);
  2. the module's own forward over its local experts on the rows it received (each row one expert,
     weight 1), so the family's activation and its implementation (grouped_mm or a loop) are kept;
  3. combine: the outputs sent back by the inverse all-to-all, weighted by the router's weights on
     the rank that routed them and summed per token, as the unsplit module does.
Both all-to-alls are differentiable (torch's functional collectives: the backward sends gradients
the opposite way). The router's weights multiply where they were computed: its gradient stays local.

Under tp (`parallel.tp`) with an ep that divides dp, each MoE block stays whole on every tp rank, as
plain tensors (tp style `moe_block`, parallel/tp_styles.py): the ranks of a tp group route the same
tokens (under sequence parallel the block gathers the whole sequence: the per-sequence balance loss
needs it) through the ep groups of their own tp coordinate, so their router and expert gradients are
equal and are reduced over dp alone, and the norm counts them once per tp group.

Where ep spans tp (ep = tp x a divisor of dp: `Layout.experts_over_tp`) each tp rank routes its own
share of the tokens: under sequence parallel the positions it already holds (nothing gathered),
without it its 1/tp of the replicated positions (token_share.py's `TokenShare`: its backward all-gathers the input's
gradient), the block's output all-gathered back over tp so the rest of the layer sees replicated
activations (its backward keeps this rank's positions' gradient). The ep group is whole tp groups, so
the same all-to-alls carry the tokens. The per-sequence balance loss sums its expert counts over tp
(models/moe_balance.py's `split_over`), and the router's (and a shared expert's) gradients, each from
this rank's tokens only, are summed over tp (`ExpertGradients`) before the dense reduction over dp.

Gradients. Dense weights reduce over dp as before (DDP or FSDP: the mean of the dp ranks'
gradients). An expert's gradient on its rank already sums every ep rank's contributions (the
all-to-all's backward brings them), so it is summed over `ep_dp` (the ranks holding the same experts)
and divided by dp: the mean over all dp ranks' losses a dense weight gets, so a step equals one
process's. Under ddp the experts are left out of DDP and `ExpertGradients` all-reduces them; under
fsdp / hsdp FSDP2 shards each experts module over `ep_dp` and its reduce-scatter does it
(fsdp.wrap_experts). The global gradient norm sums the experts' squares over `ep` (each rank holds
different ones).

Checkpoints: parallel/expert_shards.py names each shard as part of the whole tensor, so a resume at
another ep degree (ep 1 included) reads its own share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor

from meshrun.errors import ConfigError
from meshrun.models.moe import HeldExperts, held_experts, hold_experts
from meshrun.models.moe_balance import Balance
from meshrun.parallel.expert_shards import EXPERT_WEIGHTS, ExpertShard, experts_modules

if TYPE_CHECKING:
    from meshrun.parallel.layout import Layout
    from meshrun.parallel.mesh import Mesh


def check_experts_split(model: nn.Module, ep: int) -> None:
    """parallel.ep > 1 needs a model with MoE layers whose experts divide by ep (`model`: whole, on meta)."""
    if ep == 1:
        return
    found = experts_modules(model)
    if not found:
        raise ConfigError(
            f"parallel.ep is {ep} but the model has no MoE layers (no experts with 3-D gate_up_proj and down_proj) "
            "to split; set parallel.ep=1"
        )
    for name, module in found:
        total = module.get_parameter("gate_up_proj").shape[0]
        if total % ep:
            raise ConfigError(
                f"parallel.ep ({ep}) must divide the number of experts ({total} in {name}); "
                f"set parallel.ep to a divisor of {total}"
            )


def shard_experts(part: nn.Module, mesh: Mesh) -> None:
    """Route the forward of every experts module of `part` over the ep group; nothing at ep 1. A
    stage holds this ep rank's experts since its meta build (materialise.hold_rank_experts: only
    those are made and loaded); a module built whole (a test's block) is cut to them here."""
    ep = mesh.size("ep")
    if ep == 1:
        return
    balance = getattr(part, "balance", None)
    if mesh.layout.experts_over_tp and isinstance(balance, Balance):  # each tp rank routes its own positions
        balance.split_over = mesh.group("tp")
    for _, module in experts_modules(part):
        held = held_experts(module)
        if held.count == held.total:
            held = HeldExperts.of_rank(held.total, mesh.coordinates.ep, ep)
            hold_experts(module, held)
        shard = ExpertShard(
            first=held.first, count=held.count, total=held.total, mesh=mesh.view("ep"), grid=mesh.view("ep_dp", "ep")
        )
        setattr(module, "expert_shard", shard)  # noqa: B010 (nn.Module's __setattr__ is typed for tensors and modules)
        module.forward = functools.partial(routed_forward, module.forward, shard=shard)


def routed_forward(
    local_forward: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    shard: ExpertShard,
) -> torch.Tensor:
    """The experts module's output for `hidden` [T, H] routed to `top_k_index` [T, K] with
    `top_k_weights` [T, K], its experts spread over the ep ranks (see the module docstring)."""
    group, ep = shard.mesh.get_group(), shard.mesh.size()
    choices = top_k_index.reshape(-1)  # [T K]: pair p is token p // K's choice p % K
    order = torch.argsort(choices, stable=True)  # pairs by expert, so by the rank that holds it
    token = order // top_k_index.shape[1]
    sent_per_expert = torch.bincount(choices, minlength=shard.total)
    got_per_expert = torch.empty_like(sent_per_expert)  # [ep, count]: from each rank, per local expert
    dist.all_to_all_single(got_per_expert, sent_per_expert, group=group)
    sends = sent_per_expert.view(ep, shard.count).sum(1).tolist()  # a host sync: the splits are sizes
    gets = got_per_expert.view(ep, shard.count).sum(1).tolist()
    rows = all_to_all_single_autograd(hidden[token], gets, sends, group)
    local_ids = torch.arange(shard.count, device=hidden.device).repeat(ep).repeat_interleave(got_per_expert)
    ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=hidden.device)
    done = local_forward(rows, local_ids[:, None], ones)
    back = all_to_all_single_autograd(done, sends, gets, group)
    weighted = back * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))


class ExpertGradients:
    """The expert weights of this rank's parts: their gradients averaged like the dense weights', and
    their share of the gradient norm (see the module docstring). Empty at ep 1."""

    def __init__(self, parts: Sequence[nn.Module], mesh: Mesh) -> None:
        self.params = [p for part in parts for p in expert_params(part) if p.requires_grad]
        self.ep_dp_group = mesh.group("ep_dp") if self.params and mesh.size("ep_dp") > 1 else None
        self.ep_group = mesh.group("ep") if self.params else None
        self.dp = mesh.size("dp")
        self.reduced_by_fsdp = any(isinstance(p, DTensor) for p in self.params)  # fsdp.wrap_experts: over ep_dp
        # ep spanning tp: each tp rank's router (and shared expert) saw its own tokens only
        over_tp = mesh.layout.experts_over_tp and bool(self.params)
        self.routers = [p for part in parts for p in router_params(part) if p.requires_grad] if over_tp else []
        self.tp_group = mesh.group("tp") if self.routers else None

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """The routers' gradients summed over tp where ep spans it; the experts' summed over ep_dp and
        divided by dp (call after the backward, before unscale and clip; FSDP2's reduce-scatter did
        that for experts it shards)."""
        if self.tp_group is not None:  # linear: before or after dp's mean (DDP, FSDP) alike
            _all_reduce([p.grad for p in self.routers if p.grad is not None], self.tp_group)
        if not self.params or self.reduced_by_fsdp:
            return
        for param in self.params:  # a rank no token reached has no gradient: its peers still sum with it
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.ep_dp_group is not None:
            _all_reduce(grads, self.ep_dp_group)
        torch._foreach_div_(grads, self.dp)

    def dense(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """`params` without the expert weights: the part of the gradient norm every dp rank agrees on."""
        return [p for p in params if not any(p is e for e in self.params)]

    def squared_norm(self) -> torch.Tensor | None:
        """The squared norm of every expert gradient of this stage, summed over ep; None at ep 1."""
        if self.ep_group is None:
            return None
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        squared = (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(torch.float32) ** 2  # fsdp: over ep_dp
        dist.all_reduce(squared, group=self.ep_group)
        return squared


def _all_reduce(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum `grads` (this rank's shards of DTensors) over `group`, in place, in one message."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if not local:
        return
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(local, flat.split([g.numel() for g in local])):
        grad.copy_(summed.view_as(grad))


def router_params(part: nn.Module) -> list[nn.Parameter]:
    """The weights of `part`'s split MoE blocks other than their experts: the router, a shared expert
    (each experts module's parent holds them)."""
    found = []
    for name, module in experts_modules(part):
        if hasattr(module, "expert_shard"):
            block = part.get_submodule(name.rsplit(".", 1)[0]) if "." in name else part
            held = {id(p) for p in module.parameters()}
            found += [p for p in block.parameters() if id(p) not in held]
    return found


def split_experts(part: nn.Module) -> list[nn.Module]:
    """The experts modules of `part` that parallel.ep split."""
    return [module for _, module in experts_modules(part) if hasattr(module, "expert_shard")]


def expert_params(part: nn.Module) -> list[nn.Parameter]:
    """The split expert weights of `part` (left out of DDP; under FSDP, sharded over ep_dp apart)."""
    return [module.get_parameter(name) for module in split_experts(part) for name in EXPERT_WEIGHTS]


def expert_param_names(part: nn.Module) -> list[str]:
    """The names of `part`'s split expert weights (DDP's parameters to ignore)."""
    return [f"{name}.{n}" for name, m in experts_modules(part) if hasattr(m, "expert_shard") for n in EXPERT_WEIGHTS]


def describe_expert_parallel(layout: Layout, model: nn.Module) -> list[str]:
    """--dry-run lines: the ep groups and the experts each ep rank holds (`model`: whole, checked by
    check_experts_split); nothing at ep 1."""
    if layout.ep == 1:
        return []
    total = experts_modules(model)[0][1].get_parameter("gate_up_proj").shape[0]
    count = total // layout.ep
    groups = sorted({tuple(layout.group_ranks(r, "ep")) for r in layout.ranks_of_pp_rank(0)})
    held = "; ".join(
        f"ep rank {e}: " + (f"expert {e}" if count == 1 else f"experts {e * count}-{(e + 1) * count - 1}")
        for e in range(layout.ep)
    )
    lines = [
        "expert parallel:",
        (
            f"  ep {layout.ep} x ep_dp {layout.size('ep_dp')}: each MoE layer's {total} experts split over the ranks "
            f"of each ep group ({', '.join(str(list(g)) for g in groups)} on pipeline rank 0, in ep rank order; the other stages alike)"
        ),
        f"  {held}; tokens reach them by two all-to-alls per MoE layer forward, two backward",
    ]
    if layout.experts_over_tp:  # parallel/tp_styles.py's moe_block, its over_tp forms
        own = (
            "the positions it holds"
            if layout.sequence_parallel
            else "its 1/tp of the positions, the output gathered back"
        )
        lines.append(
            f"  tp {layout.tp}: ep spans the tp ranks (ep {layout.ep} = tp {layout.tp} x {layout.ep // layout.tp} dp ranks); "
            f"each tp rank holds its ep rank's experts and routes {own}"
        )
    elif layout.tp > 1:
        whole = "the whole sequence gathered first" if layout.sequence_parallel else "the same tokens"
        lines.append(
            f"  tp {layout.tp}: each MoE block whole on every rank of a tp group ({whole}); each tp rank routes through its own ep groups"
        )
    return lines
