"""The optimizer (torch.optim's AdamW, Adam, SGD or RMSprop) with weight decay on matrices only,
linear warmup and cosine decay.

One optimizer per model part (a rank holds several parts under interleaved schedules), so the
checkpoint utilities can name every parameter by its model-wide name. The learning rate is a
pure function of the step: nothing to save, nothing to drift on resume.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.amp import GradScaler
from torch.distributed.tensor import DTensor

from meshrun.config.schema import TrainConfig
from meshrun.metrics import time_split
from meshrun.parallel.fsdp import full_norm, local


def build_optimizer(part: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """`cfg.optimizer`'s torch.optim class over `part`'s trainable parameters, matrices decayed."""
    decay, no_decay = [], []
    for param in part.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    # Each group on one mesh, or all plain tensors (torch's fused kernels refuse a mix): under fsdp the
    # experts parallel.ep splits are sharded over ep_dp (or stay plain) beside the dp-sharded DTensors.
    groups = [
        {"params": same, "weight_decay": weight_decay}
        for params, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0))
        for same in by_mesh(params)
    ]
    # Fused where torch has a fused kernel (AdamW, Adam, SGD; CPU and CUDA): it can skip a step on
    # the device (see step_unless), with no host sync. RMSprop has none: foreach.
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    if cfg.optimizer == "sgd":
        sgd = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, fused=True)
        # Fused SGD makes its momentum buffers uninitialised (empty_like) at the first step and
        # fills them in the kernel: a first step skipped on the device (found_inf) would keep that
        # garbage. Zeros are equal to a first step's buffers (0 * momentum + grad = grad, bit for bit).
        for param in (decay + no_decay) if cfg.momentum > 0 else []:
            sgd.state[param]["momentum_buffer"] = torch.zeros_like(param)
        return sgd
    # capturable on CUDA keeps its step counters on the device, where step_unless's torch.where runs
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.RMSprop(
        groups, lr=cfg.lr, alpha=cfg.alpha, eps=cfg.eps, momentum=cfg.momentum, foreach=True, capturable=on_cuda
    )


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`optimizer.step()`, except where the 0-d float `skip` is 1: then parameters, optimizer state
    and step counters stay as they were, decided on the device (no host sync).

    A fused optimizer reads the `found_inf` attribute that torch.amp.GradScaler sets on optimizers
    with `_step_supports_amp_scaling`; torch has no public argument for it, so it lives here only.
    Another (RMSprop) steps, then takes back what it changed with `torch.where`: the price is a
    copy of its parameters and state per step, instead of a host sync.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        _step_then_undo_unless(optimizer, skip)
        return
    # The attributes are GradScaler's protocol with fused optimizers, not declared on Optimizer: hence the ignores.
    optimizer.found_inf, optimizer.grad_scale = skip, None  # pyright: ignore[reportAttributeAccessIssue]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # pyright: ignore[reportAttributeAccessIssue]


def _step_then_undo_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Step, then restore every parameter and state tensor where `skip` is 1. State the step
    created (the first step) is restored to zeros, which is the state that optimizer starts from."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    before = {id(t): local(t.detach()).clone() for t in _tensors(optimizer, params)}  # the optimizer keeps t alive
    optimizer.step()
    keep = skip.bool()
    for tensor in _tensors(optimizer, params):
        now = local(tensor.detach())
        old = before.get(id(tensor))
        old = torch.zeros_like(now) if old is None else old
        now.copy_(torch.where(keep, old, now))


def _tensors(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """`params` and the tensors of their optimizer state."""
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return [*params, *state]


def clip_global_norm(
    params: Sequence[torch.Tensor],
    counted: Sequence[torch.Tensor],
    *,
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
    split_squared: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradients' global norm over every stage, and clipped to `max_norm` (0: not clipped).
    `counted`: the parameters whose gradients the norm counts (a tied matrix's two copies once);
    dp replicas already agree after DDP's all-reduce, fsdp and tp shards are summed over their
    meshes (fsdp.full_norm, one mesh at a time: under tp a MoE block's tensors, equal on every tp rank,
    are plain or on the dp mesh alone, and count once beside tp's), pipeline stages over `pp_group`
    (None: one stage). `split_squared`:
    the squared norm of gradients not in `counted`, already summed over the ranks that split them
    (parallel.experts: the experts over ep)."""
    grads = [p.grad for p in counted if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    norms = [full_norm(torch.nn.utils.get_total_norm(same, foreach=True)) for same in by_mesh(grads)]
    if len(norms) > 1:  # several meshes (a MoE block's plain tensors beside tp's DTensors): squares summed
        norms = [torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()]
    norm = norms[0] if norms else torch.zeros((), device=device)
    if split_squared is not None:
        norm = (norm.to(torch.float32) ** 2 + split_squared).sqrt()
    if pp_group is not None:
        squared = norm.to(torch.float32) ** 2
        with time_split.section("wait"):  # for the stage that finishes its backward last
            dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    for same in by_mesh(params) if max_norm > 0 else ():  # torch's foreach kernels refuse a mix of meshes
        torch.nn.utils.clip_grads_with_norm_(same, max_norm, norm, foreach=True)
    return norm


def by_mesh(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` in groups that torch's foreach and fused kernels take in one call: the DTensors of each
    mesh, the plain tensors (in first-seen order). No empty group: LoRA trains matrices only, and an
    empty group would break torch's flattened optimizer state on load."""
    groups: dict[object, list[torch.Tensor]] = {}
    for param in params:
        groups.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    return list(groups.values())


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def schedule_change_note(saved_steps: int | None, cfg: TrainConfig, step: int) -> str | None:
    """One line when a resume changes train.steps: the cosine is then stretched over the new length,
    so the lr from the resumed step on is not the one the checkpoint's run would have used."""
    if saved_steps is None or saved_steps == cfg.steps:
        return None
    before = lr_at(step, cfg.model_copy(update={"steps": saved_steps}))
    return (
        f"lr schedule re-stretched from {saved_steps} to {cfg.steps} steps (train.steps changed since the "
        f"checkpoint): lr at step {step + 1} is {lr_at(step, cfg):.3g} instead of {before:.3g}"
    )


class Optimizers:
    """The optimizers of this rank's parts, stepped together (through the fp16 scaler if any)."""

    def __init__(self, parts: Sequence[nn.Module], cfg: TrainConfig) -> None:
        self.parts, self.cfg = parts, cfg
        self.optimizers = [build_optimizer(part, cfg) for part in parts]

    def set_lr(self, step: int) -> float:
        lr = lr_at(step, self.cfg)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        return lr

    def unscale_(self, scaler: GradScaler) -> None:
        """fp16: every part's gradients unscaled and checked in one call, on their local shards: torch's
        foreach kernel refuses DTensors of different meshes side by side (parallel.ep's experts sharded
        over ep_dp beside the dense weights over dp), and the scaler reduces found_inf over the ranks."""
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]]
        shards = [local(p.detach()).detach() for p in params]  # share the parameters' memory, no copy
        for shard, param in zip(shards, params):
            shard.grad = None if param.grad is None else local(param.grad)  # the same memory: unscaled in place
        scaler.unscale_(torch.optim.SGD(shards, lr=0.0))  # the scaler reads only an optimizer's param_groups

    def step_unless(self, skip: torch.Tensor) -> None:
        """Every optimizer stepped, or none (where `skip` is 1), decided on the device."""
        for optimizer in self.optimizers:
            step_unless(optimizer, skip)

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
