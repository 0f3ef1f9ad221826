"""Measured memory of real training steps, for comparison with the planner's model.

Each layout runs meshrun's own `parallelize` (the trainer's stage building, recompute, DDP,
PipelineStage and schedule) and AdamW, on every rank of a real gloo process group. Per rank:
parameter, gradient and optimizer-state bytes after a step (from the tensors themselves), and
the peak bytes autograd keeps for backward during the second step (saved-tensor hooks plus
checkpointed blocks' inputs), above what was live when that step began (the first step's
shape inference leaves one forward graph alive on the first stage for the whole run; what of it
is garbage is collected before the measured step begins).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._pytree import tree_leaves

import meshrun.parallel.recompute as recompute
from meshrun.config.schema import Config, load_config
from meshrun.hardware.precision import autocast
from meshrun.models.task_io import task_io
from meshrun.parallel.context import shard_batch
from meshrun.parallel.mesh import Mesh, mesh_on
from meshrun.parallel.parallelize import parallelize
from meshrun.planner.saved_bytes import SavedBytes, local
from meshrun.tasks import task_for
from meshrun.training.loss import MicrobatchLoss
from meshrun.training.optim import build_optimizer

MODEL = [
    "model.vocab_size=256",
    "model.num_layers=4",
    "model.dim=32",
    "model.num_heads=4",
    "model.seq_len=16",
    "precision=fp32",
    "parallel.dp=1",
    "parallel.pp=1",
    "recompute=none",
    "model.dropout=0.0",
]


def layout_config(overrides: list[str]) -> Config:
    return load_config(None, [*MODEL, *overrides])


def _tensor_bytes(tensors) -> int:
    """Bytes this rank holds (a DTensor's local shard)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure(cfg: Config, mesh: Mesh) -> dict[str, int]:
    """One layout on this rank: state bytes and the second step's peak saved bytes."""
    caches: list = []
    with _recording_selective_caches(caches):
        return _measure(cfg, mesh, caches)


def _measure(cfg: Config, mesh: Mesh, caches: list) -> dict[str, int]:
    torch.manual_seed(0)
    loss = MicrobatchLoss(cfg.accumulation_steps, summed=task_for(cfg.task).summed(cfg))
    model = parallelize(cfg, mesh, loss=loss, amp=lambda: autocast(cfg, mesh.device))  # precision's autocast
    optimizers = [build_optimizer(part, cfg.train) for part in model.parts]
    params = [p for part in model.parts for p in part.parameters()]
    counter = SavedBytes(exclude=params)
    for part in model.parts:
        _count_selective_caches(part, caches, counter)
        counter.count_checkpoint_inputs(part)
    local = cfg.train.global_batch // cfg.parallel.dp
    inputs, targets = task_io(cfg).batch(local, torch.Generator().manual_seed(1))  # the task's shapes
    inputs, targets = shard_batch(inputs, targets, mesh)  # this cp rank's positions (as is where cp is 1)
    peak = 0
    for _ in range(2):
        # garbage first: step 1's shape-inference graph, dropped without a backward, is a reference
        # cycle (a checkpointed block's node holds the hook that holds the node) that the cyclic
        # collector frees when its allocation counters say so; if that fell inside the measured
        # step, live bytes counted at its start vanished and the peak read 4096 bytes low (the
        # pp2-1f1b-mb2-full row under .ci/run's source tree: 12544, elsewhere 16640)
        gc.collect()
        counter.reset_peak()
        start = counter.live
        with counter.hooks():
            model.forward_backward(inputs, targets)
        peak = counter.peak - start
        for optimizer in optimizers:
            optimizer.step()
    return {
        "params": _tensor_bytes(params),
        "grads": _tensor_bytes(p.grad for p in params),
        "optimizer": sum(_tensor_bytes(state.values()) for o in optimizers for state in o.state.values()),
        "activations": peak,
        "pp_rank": mesh.coordinates.pp,
    }


@contextlib.contextmanager
def _recording_selective_caches(caches: list):
    """Each selective checkpoint's caching mode, as torch creates it (during every checkpointed
    forward): what it stores is read from torch's own cache, not from the planner's observer."""
    original = recompute.create_selective_checkpoint_contexts

    def recording(*args, **kwargs):
        contexts = original(*args, **kwargs)
        caches.append(contexts[0])
        return contexts

    recompute.create_selective_checkpoint_contexts = recording
    try:
        yield
    finally:
        recompute.create_selective_checkpoint_contexts = original


def _count_selective_caches(part: torch.nn.Module, caches: list, counter: SavedBytes) -> None:
    """After each checkpointed block's forward, the tensors its cache holds join the holders that
    ride on the block's graph node (this hook runs before count_checkpoint_inputs's, which
    attaches them), so they count until backward reaches the block."""

    def take(*_) -> None:
        while caches:
            storage = caches.pop().storage  # torch's _CachingTorchDispatchMode: op -> [outputs]
            leaves = [getattr(leaf, "val", leaf) for leaf in tree_leaves(dict(storage))]
            counter.cached += [counter.hold(t) for t in leaves if isinstance(t, torch.Tensor)]

    for block in part.modules():
        if isinstance(block, CheckpointWrapper):
            block.register_forward_hook(take)


def worker(rank: int, world: int, store_dir: str, layouts: list[list[str]], out: str) -> None:
    """torch.multiprocessing target: every layout (dp x cp x tp x pp = world) on this rank, results to OUT/rank{R}.json."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(store_dir) / "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        results = []
        for overrides in layouts:
            cfg = layout_config(overrides)
            results.append(measure(cfg, mesh_on(cfg.layout, torch.device("cpu"))))
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
