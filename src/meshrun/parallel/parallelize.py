"""Turn a model config into this rank's trainable part of the dp x tp x pp mesh.

`parallelize` applies the steps in one fixed order (torchtitan's: TP, recompute, compile, then FSDP):
  1. build the whole model on the meta device (no memory, no init cost);
  2. keep only this rank's pipeline stage(s) (embedding first, norm + head last);
  3. materialise on the device and initialise (per-parameter seeds: layout independent);
  3b. model.lora: peft's adapters on this stage's targeted layers, every other weight frozen
     (models/lora.py; adapters seeded per name), so DDP, FSDP and the optimizer see only them;
  4. tp > 1: split the model's planned modules over the tp mesh (tensor.py; a LoRA-wrapped layer
     with its adapter, split alike: tp_styles.py);
  5. wrap blocks for activation recompute;
  5a. parallel.ep > 1: keep this ep rank's experts of each MoE layer, their tokens routed by
     all-to-all (experts.py);
  5b. cp > 1: each attention core between two all-to-alls over the cp group (context.py);
  5c. train.compile: torch.compile each block's forward (compile.py);
  5d. train.offload_activations: the blocks it selects keep their saved tensors on the host (offload.py);
  6. data parallel over the dp group (dp x cp under context parallelism): each stage in DDP, or (dp_mode fsdp/hsdp, and
     ddp with tp > 1) fully_shard per block + the stage root (fsdp.py; 2-D with tp's DTensors);
     split experts left out of DDP (averaged by `ExpertGradients` after the backward), under FSDP
     sharded over ep_dp apart (fsdp.wrap_experts);
  7. pp > 1: PipelineStage + a torch.distributed.pipelining schedule;
  8. tied embeddings: the group that sums the first and last stage's gradients (tied.py).
Under tp the loss runs on vocabulary-sharded logits (`vocab_parallel`, forward and backward).
"""

from __future__ import annotations

import contextlib
import os
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from meshrun.config.schema import Config
from meshrun.files.console import say
from meshrun.launcher import progress
from meshrun.launcher.keeper import REPLACEMENT, ROLE_ENV
from meshrun.metrics import time_split
from meshrun.models.protocol import ProtocolModule
from meshrun.parallel.compile import apply_compile, compile_enabled, inductor_cache_dir
from meshrun.parallel.context import apply_context_parallel
from meshrun.parallel.experts import ExpertGradients, expert_param_names, shard_experts
from meshrun.parallel.fsdp import set_gradient_sync, wrap_fsdp
from meshrun.parallel.loss_fn import LossFn
from meshrun.parallel.materialise import materialise_part
from meshrun.parallel.mesh import Mesh
from meshrun.parallel.offload import apply_offload
from meshrun.parallel.stages import SPLIT_BACKWARD_SCHEDULES
from meshrun.parallel.tensor import tp_loss, vocab_parallel
from meshrun.parallel.tied import TiedEmbeddings

if TYPE_CHECKING:
    from meshrun.parallel.pipeline import PipelineModel

AmpContext = Callable[[], contextlib.AbstractContextManager]


class LocalModel:
    """pp = 1: gradient accumulation over microbatches, DDP all-reduce only on the last one."""

    tied: TiedEmbeddings  # set by parallelize
    experts: ExpertGradients  # set by parallelize

    def __init__(self, part: ProtocolModule, wrapped: nn.Module, *, loss: LossFn, amp: AmpContext, tp: int = 1) -> None:
        self.parts, self.wrapped, self.loss, self.amp = [part], wrapped, loss, amp
        self.tp = tp  # > 1: the loss runs on vocabulary-sharded logits (tensor.py)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, loss: LossFn | None = None) -> torch.Tensor:
        """Accumulate gradients of the whole local batch; returns its (unscaled) loss.

        `loss`: this step's (its token divisor and fp16 scale); None: the one given at construction.
        """
        loss_fn = tp_loss(self.loss if loss is None else loss, self.tp)
        n = loss_fn.num_microbatches
        with time_split.section("compute"):  # ends at this rank's last gradient: DDP's all-reduce after it waits
            losses = [self._microbatch(i, xm, ym, loss_fn) for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n)))]
        return loss_fn.unscaled(losses)

    def _microbatch(self, i: int, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of microbatch `i`; DDP and FSDP reduce the gradients on the last one."""
        n = loss_fn.num_microbatches
        ddp = self.wrapped if isinstance(self.wrapped, DistributedDataParallel) else None
        set_gradient_sync(self.wrapped, i == n - 1)  # fsdp: reduce-scatter once, after the last
        with ddp.no_sync() if ddp is not None and i < n - 1 else contextlib.nullcontext(), vocab_parallel(self.tp):
            progress.mark("forward", f"microbatch {i + 1} of {n}")
            with self.amp():
                logits = self.wrapped(x)
            microbatch_loss = loss_fn(logits, y)
            synced = " and the gradient reduction over dp" if i == n - 1 and self.wrapped is not self.parts[0] else ""
            progress.mark("backward", f"microbatch {i + 1} of {n}{synced}")
            microbatch_loss.backward()
        return microbatch_loss

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, *, loss: LossFn | None = None) -> torch.Tensor:
        loss_fn = tp_loss(self.loss if loss is None else loss, self.tp)
        n = loss_fn.num_microbatches
        with self.amp(), vocab_parallel(self.tp):
            return loss_fn.unscaled([loss_fn(self.wrapped(xm), ym) for xm, ym in zip(x.chunk(n), y.chunk(n))])

    def train(self, mode: bool = True) -> None:
        self.wrapped.train(mode)


def wrap_data_parallel(part: ProtocolModule, mesh: Mesh, cfg: Config, *, init_sync: bool | None = None) -> nn.Module:
    """Gradients reduced over the ranks that hold the same weights: the dp ranks and, under context
    parallel, the cp ranks (each holds a part of every sample's positions). `init_sync`: DDP sends
    rank 0's weights to the others; by default not in a replacement worker, nor in a survivor's
    rewrap (training/recovery.py): their weights come from a replica, not from rank 0."""
    if mesh.size("dp_cp") == 1:
        return part
    if mesh.data_mesh is not None:
        return wrap_fsdp(part, mesh, cfg.parallel)
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    if split := expert_param_names(part):  # each ep rank holds other experts: ExpertGradients averages them
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(part, split)
    if init_sync is None:
        init_sync = os.environ.get(ROLE_ENV) != REPLACEMENT
    ddp = DistributedDataParallel(part, process_group=mesh.group("dp_cp"), device_ids=device_ids, init_sync=init_sync)
    ddp.register_comm_hook(mesh.group("dp_cp"), timed_allreduce)
    return ddp


def timed_allreduce(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce (torch's `allreduce_hook`), once this rank's gradients in `bucket` are
    ready: the last bucket marks where its backward ended and waiting for the others began."""
    time_split.gradients_ready()
    return default_hooks.allreduce_hook(group, bucket)


# DDP refuses a hook whose annotations are not the classes themselves (here they are strings: PEP 563)
timed_allreduce.__annotations__ = typing.get_type_hints(timed_allreduce)


def local_part(cfg: Config, mesh: Mesh, *, layers: list[int] | None, first: bool, last: bool) -> ProtocolModule:
    """Steps 1-5d for one stage (layers=None: the whole model)."""
    ep_rank = (mesh.coordinates.ep, mesh.size("ep"))  # its experts only: made and loaded as such
    part = materialise_part(
        cfg, mesh.device, layers=layers, first=first, last=last, tp_mesh=mesh.view("tp"), ep_rank=ep_rank
    )
    shard_experts(part, mesh)
    return compiled(apply_context_parallel(part, mesh), mesh, cfg)


def compiled(part: ProtocolModule, mesh: Mesh, cfg: Config) -> ProtocolModule:
    """Step 5c: the part with its blocks compiled when train.compile says so on this device; one
    rank per stage (dp and tp index 0) warns of a block that runs eager. Then 5d: the blocks
    train.offload_activations selects wrapped for offload, outside their compiled forward (dynamo
    does not trace save_on_cpu; the compiled graph's saved tensors still pass through its hooks)."""
    if compile_enabled(cfg.train.compile, mesh.device):
        speaks = mesh.coordinates.dp == 0 and mesh.coordinates.tp == 0
        apply_compile(
            part.blocks,
            strict=cfg.train.compile is True,
            warn=say if speaks else lambda _: None,
            split_backward=mesh.size("pp") > 1 and cfg.parallel.schedule in SPLIT_BACKWARD_SCHEDULES,
        )
    apply_offload(part.blocks, cfg.train.offload_activations, recompute=cfg.recompute)
    return part


def parallelize(cfg: Config, mesh: Mesh, *, loss: LossFn, amp: AmpContext) -> LocalModel | PipelineModel:
    if mesh.rank == 0 and compile_enabled(cfg.train.compile, mesh.device):
        say(f"train.compile: the first step compiles each block (inductor cache {inductor_cache_dir()})")
    if mesh.size("pp") == 1:
        part = local_part(cfg, mesh, layers=None, first=True, last=True)
        local = LocalModel(part, wrap_data_parallel(part, mesh, cfg), loss=loss, amp=amp, tp=mesh.size("tp"))
        local.tied = TiedEmbeddings([part], [0], num_stages=1, mesh=mesh)
        local.experts = ExpertGradients([part], mesh)
        return local
    # torch.distributed.pipelining costs about 1.3 s of CPU to import: only pipelines pay it
    from meshrun.parallel.pipeline import PipelineModel, plan_for

    plan = plan_for(cfg, mesh)
    parts = [
        local_part(cfg, mesh, layers=plan.split[i], first=i == 0, last=i == plan.num_stages - 1)
        for i in plan.local_stages
    ]
    model = PipelineModel(cfg, mesh, plan, parts, [wrap_data_parallel(p, mesh, cfg) for p in parts], loss=loss, amp=amp)
    model.tied = TiedEmbeddings(parts, plan.local_stages, num_stages=plan.num_stages, mesh=mesh)
    model.experts = ExpertGradients(parts, mesh)
    return model
