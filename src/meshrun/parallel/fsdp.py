"""FSDP2 / HSDP as the data-parallel dimension (`parallel.dp_mode: fsdp | hsdp`).

Each Transformer block, then the stage's root module (embedding, final norm, head), is wrapped
with `torch.distributed.fsdp.fully_shard` over the data mesh (mesh.py's `data_mesh`: the dp_shard
axis, or (dp_replicate, dp_shard) for hsdp). Parameters become DTensors sharded on dim 0; gradients and
AdamW moments follow, so a rank holds 1/dp_shard of its stage's training state.

Frozen parameters (model.lora's base) are left out (`ignored_params`): each rank holds them whole,
as loaded, and FSDP neither gathers nor reduces them. They have no gradient to reduce and no
optimizer state to shard, so sharding them would only buy memory (1/dp_shard of the base) at the
price of an all-gather of the whole base per forward (and backward, when resharded): the traffic
LoRA exists to avoid. The planner prices them whole on every rank (planner/memory.py).

When gradients are reduced and parameters resharded:
- pp = 1 (LocalModel): gradients reduce-scatter only after the last microbatch
  (`set_requires_gradient_sync`), as DDP's no_sync does: one reduction per step, not one per
  microbatch.
- pp > 1: torch's PipelineStage turns off gradient sync and reshard-after-backward for every
  microbatch's backward and reduces + reshards once after the last (`perform_reduce_grad`).
  Resharding after each forward as well would all-gather every block once more per microbatch
  in its backward (2 x microbatches gathers instead of 1); hence `fsdp_reshard_after_forward`
  defaults to off under pipelining: the gathered stage stays resident for the step, a stage is
  only 1/pp of the model.

ddp with tp > 1 runs here too, as HSDP with a shard degree of 1: every dp rank keeps a whole
replica of its tp shards and gradients are all-reduced over dp, DDP's arithmetic. torch 2.13's
DistributedDataParallel takes no DTensor parameters (its first broadcast has no DTensor rule), and
its private TP route (`tensor.parallel.ddp._pre_dp_module_transform`) leaves the module without
parameters after one forward (tests/parallel/test_tensor_parallel.py checks both on the installed torch).

Time split (metrics/time_split.py): `mark_collectives` counts each module's all-gathers and
reduce-scatters as waiting, not compute, from hooks around FSDP's own.

Mixed precision: by default FSDP casts nothing (autocast computes in bf16/fp16 exactly as
with ddp) and reduces in fp32, so fsdp and ddp run the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from meshrun.config.schema import Config, ParallelConfig
from meshrun.hardware.precision import DTYPES
from meshrun.metrics import time_split
from meshrun.models.protocol import ProtocolModule
from meshrun.parallel.expert_shards import EXPERTS_SHARD_DIM
from meshrun.parallel.experts import expert_params, split_experts
from meshrun.parallel.mesh import Mesh


def reshard_after_forward(par: ParallelConfig) -> bool:
    """The configured value, or: yes without a pipeline, no under pp (see the module docstring)."""
    if par.fsdp_reshard_after_forward is not None:
        return par.fsdp_reshard_after_forward
    return par.pp == 1


def mixed_precision(par: ParallelConfig) -> MixedPrecisionPolicy:
    """fp32 params = no cast at all (autocast alone picks compute dtypes, as under ddp)."""
    param_dtype = None if par.fsdp_param_dtype == "fp32" else DTYPES[par.fsdp_param_dtype]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[par.fsdp_reduce_dtype])


def wrap_fsdp(part: ProtocolModule, mesh: Mesh, par: ParallelConfig) -> nn.Module:
    """fully_shard every block (one all-gather per block: overlaps with the previous block's
    compute, and bounds what is gathered at once), then the stage root for the rest."""
    frozen = {p for p in part.parameters() if not p.requires_grad}  # model.lora's base: the module docstring
    options = {
        "mesh": mesh.data_mesh,
        "reshard_after_forward": reshard_after_forward(par),
        "mp_policy": mixed_precision(par),
    }
    options["ignored_params"] = wrap_experts(part, mesh, options) | frozen
    for block in part.blocks.values():
        fully_shard(block, **options)
        mark_collectives(block)
    fully_shard(part, **options)
    mark_collectives(part)
    return part


def wrap_experts(part: nn.Module, mesh: Mesh, options: dict[str, Any]) -> set[nn.Parameter]:
    """Split experts (parallel.ep) fully_shard-ed over `ep_dp`, the ranks holding the same experts, on
    dim 1 (dim 0 is split over ep): their gradients reduce-scattered there, summed and divided by dp,
    the mean over every dp rank's loss that a dense weight gets (parallel/experts.py). Returns the
    expert weights left out: all at ep_dp 1, where torch 2.13 divides a one-rank mesh's gradients
    twice, and under ddp with tp (FSDP2 keeps the dense replicas there; the experts stay replicas
    too); experts.ExpertGradients averages those."""
    split = expert_params(part)
    if not split or mesh.size("ep_dp") == 1 or mesh.layout.dp_shard == 1:
        return set(split)
    placement = Shard(EXPERTS_SHARD_DIM)
    for module in split_experts(part):
        sharded = fully_shard(module, **{**options, "mesh": mesh.view("ep_dp")}, shard_placement_fn=lambda _: placement)
        sharded.set_gradient_divide_factor(mesh.size("dp"))
        sharded.set_force_sum_reduction_for_comms(True)  # a divide apart: gloo has no PREMUL_SUM
        sharded.set_reduce_scatter_unused_params(True)  # zeros where no token reached an expert: every rank sends
        mark_collectives(module)
    return set()


def mark_collectives(module: nn.Module) -> None:
    """Count `module`'s FSDP all-gathers and reduce-scatters as waiting in the time split.

    FSDPModule has no hook around its collectives; these public hooks bracket FSDP's own, and so rely
    on where fully_shard (torch 2.13) puts them: its pre-forward hook (the all-gather) is prepended
    at fully_shard, so one of ours prepended after it runs first and one appended runs last; its
    forward hook hangs the backward's all-gather on the outputs as a tensor hook, between ours from
    a prepended and an appended forward hook; its reduce-scatter runs in the backward of the node its
    pre-forward wraps the inputs in, so a hook on the wrapped input starts that wait and one on the
    input itself ends it. Outside (compute): torch's end-of-backward callback, which reduce-scatters a
    root whose inputs take no gradient (token ids) and, on CUDA, waits for the reduce-scatters in
    flight. tests/metrics/test_time_split.py (fsdp2) fails if these stop bracketing them."""
    unwrapped: list[torch.Tensor] = []  # this forward's inputs, as FSDP's pre-forward found them

    def before_unshard(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        time_split.collective_starts()
        unwrapped[:] = _grad_tensors((*args, *kwargs.values()))
        _hook_each(unwrapped, _wait_ends)  # its gradient is complete: the reduce-scatter is over

    def after_unshard(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        time_split.collective_ends()
        wrapped = [t for t in _grad_tensors((*args, *kwargs.values())) if all(t is not u for u in unwrapped)]
        _hook_each(wrapped, _wait_starts)  # the backward reached FSDP's node: the reduce-scatter is next
        unwrapped.clear()

    module.register_forward_pre_hook(before_unshard, prepend=True, with_kwargs=True)
    module.register_forward_pre_hook(after_unshard, with_kwargs=True)
    module.register_forward_hook(lambda _, __, out: _hook_each(_grad_tensors((out,)), _wait_starts), prepend=True)
    module.register_forward_hook(lambda _, __, out: _hook_each(_grad_tensors((out,)), _wait_ends))


def _grad_tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors among `values` (and tuples of them: the encoder-decoder's state) that take a gradient."""
    if not torch.is_grad_enabled():
        return []
    flat = [v for value in values for v in (value if isinstance(value, tuple | list) else (value,))]
    return [v for v in flat if isinstance(v, torch.Tensor) and v.requires_grad]


def _hook_each(tensors: list[torch.Tensor], hook: Callable[[torch.Tensor], None]) -> None:
    for tensor in tensors:
        tensor.register_hook(hook)


def _wait_starts(_: torch.Tensor) -> None:
    time_split.collective_starts()


def _wait_ends(_: torch.Tensor) -> None:
    time_split.collective_ends()


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """FSDP2's no_sync: keep unsharded gradients locally until the microbatch that reduces them."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """A norm computed over sharded gradients (fsdp, tp) is a partial DTensor: reduce it over their mesh."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def measured_state_bytes(params: list[nn.Parameter], optimizers: Sequence[torch.optim.Optimizer]) -> tuple[int, int]:
    """Bytes this rank holds of parameters, their gradients and optimizer state (local shards), and
    of those the trainable parameters' (all but model.lora's frozen base, which has neither)."""
    total = 0
    for param in params:
        total += local(param.detach()).nbytes
        if param.grad is not None:
            total += local(param.grad).nbytes
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total, total - sum(local(p.detach()).nbytes for p in params if not p.requires_grad)


def describe_data_parallel(cfg: Config) -> list[str]:
    """--dry-run lines: the data mesh and, for fsdp/hsdp, what is gathered and reduced in which dtype."""
    par, layout = cfg.parallel, cfg.layout
    shard, cp = layout.shard_degree, layout.cp  # cp > 1: FSDP2 shards over dp_shard x cp (parallel/context.py)
    over_cp = f" and {cp} cp ranks" if cp > 1 else ""
    held = "each stage's dense weights" if par.ep > 1 else "each stage"  # ep: the experts split apart (below)
    copies = f"replicas of {held}" if par.ep > 1 else "full replicas per stage"
    mesh = {
        "ddp": (f"  ddp: {par.dp} {copies} (shard 1 x replicate {par.dp})" if par.dp > 1 else "  none (dp 1)")
        + (" kept by FSDP2 (DistributedDataParallel takes no tp DTensors)" if par.tp > 1 and par.dp > 1 else ""),
        "fsdp": f"  fsdp: {held} sharded over its {par.dp} dp ranks{over_cp} (shard {shard} x replicate 1)",
        "hsdp": f"  hsdp: shard {shard} x replicate {layout.dp_replicate} (a copy of {held} is sharded over neighbouring ranks)",
    }[par.dp_mode]
    lines = ["data parallel:", mesh]
    if cp > 1:  # cp ranks hold the same weights
        sharded = (
            f"; ddp with tp: FSDP2 shards each stage over the {cp} cp ranks"
            if par.dp_mode == "ddp" and shard > 1
            else ""
        )
        lines.append(f"  cp {cp}: gradients reduced over dp x cp = {layout.size('dp_cp')} ranks{sharded}")
    if par.dp_mode != "ddp":
        lines.append(
            f"  reshard after forward: {reshard_after_forward(par)}; "
            f"param dtype {par.fsdp_param_dtype}, reduce dtype {par.fsdp_reduce_dtype}"
        )
    return lines
