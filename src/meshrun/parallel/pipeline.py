"""Pipeline parallelism over Transformer blocks with torch.distributed.pipelining.

Stages are this rank's model parts (each possibly DDP-wrapped; PipelineStage runs DDP's
no_sync on all but the last microbatch). The schedule receives the whole local batch and
splits it into `accumulation_steps` microbatches: accumulation *is* microbatching here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    get_schedule_class,
)
from torch.nn.parallel import DistributedDataParallel

from meshrun.config.schema import Config
from meshrun.errors import ConfigError
from meshrun.launcher import progress
from meshrun.metrics import time_split
from meshrun.models.moe_balance import routing_recorded
from meshrun.models.protocol import ProtocolModule
from meshrun.parallel import timeline
from meshrun.parallel.loss_fn import LossFn
from meshrun.parallel.mesh import Mesh
from meshrun.parallel.stages import SPLIT_BACKWARD_SCHEDULES, TORCH_SCHEDULE_NAMES, static_split
from meshrun.parallel.tensor import tp_loss, vocab_parallel

if TYPE_CHECKING:
    from meshrun.parallel.experts import ExpertGradients
    from meshrun.parallel.tied import TiedEmbeddings


def schedule_class(name: str) -> type:
    """torch's class for a `parallel.schedule` name, from torch's own lookup."""
    return get_schedule_class(TORCH_SCHEDULE_NAMES[name])


def make_schedule(name: str, stages: list, *, n_microbatches: int, loss_fn: Callable):
    """torch's schedule over this rank's stages; its constructor's microbatch and stage rules are
    the authority (the torch-free preflight answers the same rules earlier), refused as one line."""
    cls = schedule_class(name)
    try:
        return cls(
            stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            scale_grads=False,  # the loss already divides by the microbatch count
        )
    except ValueError as exc:
        raise ConfigError(
            f"parallel.schedule {name} with {n_microbatches} microbatches: torch refuses it: {exc}"
        ) from None


def loss_of_step(output: torch.Tensor, target: torch.Tensor, *, loss: LossFn) -> torch.Tensor:
    """The schedules' loss_fn: each step hands in its own loss through `schedule.step(loss_kwargs=)`."""
    return loss(output, target)


class MarkedStage(PipelineStage):
    """A PipelineStage whose computations show up, named, in profiler traces, mark this worker's
    progress (the hang watchdog's: a slow pipeline step still moves action by action) and count as
    compute in the time split (receiving their inputs, outside these, is waiting).

    `split_backward` (zero-bubble, zbv) with a DDP stage: the weight pass computes gradients apart
    from DDP's hooks (pytorch #144530), so DDP would reduce only the first stage's (its weight pass
    is a full backward). No backward reduces then; `perform_reduce_grad`, after the stage's last
    backward, averages every gradient over DDP's group at once (the dp and cp ranks).
    """

    def __init__(self, *args: Any, split_backward: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.averages_after_backward = split_backward and isinstance(self.submod, DistributedDataParallel)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        last = last_backward and not self.averages_after_backward  # not last: under DDP's no_sync
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.averages_after_backward:
            average_gradients(self.submod)  # pyright: ignore[reportArgumentType]
        super().perform_reduce_grad(grad_scale_factor)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        progress.mark("forward", f"stage {self.stage_index} microbatch {fwd_chunk_id}")
        with timeline.action(self.stage_index, "F", fwd_chunk_id), time_split.section("compute"):
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        done("forward", f"stage {self.stage_index} microbatch {fwd_chunk_id}")
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        kind = "B" if kwargs.get("full_backward", True) else "I"
        progress.mark("backward", f"stage {self.stage_index} microbatch {bwd_chunk_id}")
        with (
            timeline.action(self.stage_index, kind, bwd_chunk_id),
            time_split.section("compute"),
            routing_recorded(True),
        ):
            super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        done("backward", f"stage {self.stage_index} microbatch {bwd_chunk_id}")

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        """The weight half of a split backward (zero-bubble, ZBV). The first stage's input needs no
        gradient, so torch runs its whole backward here: its MoE layers' routing counts here."""
        progress.mark("backward", f"stage {self.stage_index} microbatch {bwd_chunk_id} weights")
        with (
            timeline.action(self.stage_index, "W", bwd_chunk_id),
            time_split.section("compute"),
            routing_recorded(self.is_first),
        ):
            super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        done("backward", f"stage {self.stage_index} microbatch {bwd_chunk_id} weights")


def average_gradients(ddp: DistributedDataParallel) -> None:
    """DDP's arithmetic by hand: every gradient of the module (those DDP ignores, split experts,
    left to ExpertGradients) summed over its group in one all-reduce and divided by its size."""
    ignored = ddp.parameters_to_ignore
    grads = [p.grad for name, p in ddp.module.named_parameters() if p.grad is not None and name not in ignored]
    if not grads:
        return
    time_split.gradients_ready()
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ddp.process_group)
    flat /= dist.get_world_size(ddp.process_group)
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(reduced.view_as(grad))


def done(phase: str, action: str) -> None:
    """A stage action finished: until the next begins this rank waits on the schedule's transfers."""
    progress.mark(phase, f"{action} done; waiting for the next action's input", waiting=True)


@dataclass(frozen=True)
class StagePlan:
    split: list[list[int]]  # blocks of every stage, in pipeline order
    local_stages: list[int]  # stage indices this rank runs

    @property
    def num_stages(self) -> int:
        return len(self.split)


def plan_for(cfg: Config, mesh: Mesh) -> StagePlan:
    """The same split on every rank: explicit, even, or measured on rank 0 and broadcast."""
    par = cfg.parallel
    split = static_split(cfg)
    if split is None:
        from meshrun.parallel.balance import (
            measured_split,  # fairscale: only when asked for
        )

        box = [measured_split(cfg, mesh.layout.num_stages, by=par.balance) if mesh.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        split = box[0]
        assert split is not None  # rank 0 measured it and broadcast it to every rank
    return StagePlan(split=split, local_stages=mesh.local_stages)


class PipelineModel:
    """pp > 1: one schedule step runs all microbatches' forward and backward on every stage."""

    tied: TiedEmbeddings  # set by parallelize
    experts: ExpertGradients  # set by parallelize

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        plan: StagePlan,
        parts: list[ProtocolModule],
        wrapped: list[nn.Module],
        *,
        loss: LossFn,
        amp: Callable[[], contextlib.AbstractContextManager],
    ) -> None:
        self.parts, self.wrapped, self.loss, self.amp, self.plan = parts, wrapped, loss, amp, plan
        self.device, self.pp_group, self.schedule_name = mesh.device, mesh.group("pp"), cfg.parallel.schedule
        self.tp = mesh.size("tp")  # > 1: the last stage's loss runs on vocabulary-sharded logits (tensor.py)
        self.schedules: dict[tuple, Any] = {}  # one per batch shape, see _schedule_for
        self.has_first = 0 in plan.local_stages
        self.has_last = plan.num_stages - 1 in plan.local_stages

    def _schedule_for(self, *shapes: tuple[int, ...]) -> Any:
        """The schedule (and stages) for batches of these shapes, made on first use.

        torch's stages infer their buffer shapes from the first step's batch and keep them, so a
        batch of another shape (a length bucket) needs its own stages; every rank of the pipeline
        sees the same global batch shape, so all build the same one at the same step. Buckets
        are few: one schedule per shape is kept for the run.
        """
        if shapes not in self.schedules:
            stages = [
                MarkedStage(
                    module,
                    index,
                    self.plan.num_stages,
                    self.device,
                    group=self.pp_group,
                    split_backward=self.schedule_name in SPLIT_BACKWARD_SCHEDULES,
                )
                for module, index in zip(self.wrapped, self.plan.local_stages)
            ]
            self.schedules[shapes] = make_schedule(
                self.schedule_name, stages, n_microbatches=self.loss.num_microbatches, loss_fn=loss_of_step
            )
        return self.schedules[shapes]

    def _inputs(self, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, tuple, torch.Tensor | None]:
        """The schedule for this batch's shape, the first stage's inputs and the last stage's targets."""
        schedule = self._schedule_for(tuple(x.shape), tuple(y.shape))
        return schedule, ((x,) if self.has_first else ()), (y if self.has_last else None)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, loss: LossFn | None = None) -> torch.Tensor:
        """Run the schedule; returns the local batch's (unscaled) loss on the last stage, else 0.

        `loss`: this step's (its token divisor and fp16 scale); None: the one given at construction.
        The step and each stage action are marked for the timeline and the profiler (see timeline.py).
        """
        schedule, args, target = self._inputs(x, y)
        loss_fn = tp_loss(self.loss if loss is None else loss, self.tp)
        losses: list[torch.Tensor] = []
        progress.mark(
            "forward",
            "pipeline step started, before this rank's first action (its input, from the stage before)",
            waiting=True,
        )
        with timeline.step(), self._ddp_no_sync(), self.amp(), vocab_parallel(self.tp), routing_recorded(False):
            schedule.step(*args, target=target, losses=losses, return_outputs=False, loss_kwargs={"loss": loss_fn})
        return self._total(losses, loss_fn)

    def _ddp_no_sync(self) -> contextlib.ExitStack:
        """Keep DDP from arming its reducer on any forward the stage runs directly.

        PipelineStage already runs microbatch forwards under no_sync and arms the reducer
        itself before the last backward; but its first-step shape inference calls the DDP
        module plainly, which leaves the reducer expecting hooks that never come (it then
        fails an internal assert on the next step). The gradient all-reduce is unaffected.
        """
        stack = contextlib.ExitStack()
        for module in self.wrapped:
            if isinstance(module, DistributedDataParallel):
                stack.enter_context(module.no_sync())
        return stack

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, *, loss: LossFn | None = None) -> torch.Tensor:
        schedule, args, target = self._inputs(x, y)
        loss_fn = tp_loss(self.loss if loss is None else loss, self.tp)
        losses: list[torch.Tensor] = []
        with self.amp(), vocab_parallel(self.tp):
            schedule.eval(*args, target=target, losses=losses, loss_kwargs={"loss": loss_fn})
        return self._total(losses, loss_fn)

    def _total(self, losses: list[torch.Tensor], loss: LossFn) -> torch.Tensor:
        return loss.unscaled(losses) if self.has_last else torch.zeros((), device=self.device)

    def train(self, mode: bool = True) -> None:
        for module in self.wrapped:
            module.train(mode)
