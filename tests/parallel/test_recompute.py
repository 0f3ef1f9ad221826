"""Activation recompute changes memory, never gradients; selective reruns no tp collective it can keep."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from meshrun.config.schema import load_config
from meshrun.parallel.materialise import materialise_part
from meshrun.parallel.tensor import tp_loss, vocab_parallel
from meshrun.training.loss import MicrobatchLoss


def gradients(policy: str) -> dict[str, torch.Tensor]:
    cfg = load_config(
        None,
        [
            "model.num_layers=4",
            "model.dim=32",
            "model.num_heads=2",
            "model.seq_len=16",
            "precision=fp32",
            f"recompute={policy}",
        ],
    )
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    MicrobatchLoss(1)(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["full", "every:2", "selective"])
def test_recompute_gives_identical_gradients(policy: str) -> None:
    plain, recomputed = gradients("none"), gradients(policy)
    names = {n.replace("._checkpoint_wrapped_module", "") for n in recomputed}
    assert names == set(plain)
    for name, grad in recomputed.items():
        assert torch.allclose(grad, plain[name.replace("._checkpoint_wrapped_module", "")], atol=1e-6, rtol=0), name


def test_selective_hands_each_kept_output_to_on_saved() -> None:
    """apply_recompute's `on_saved` (the planner's count of what selective keeps) sees exactly the
    tensors torch's own cache stores: a matmul's output under the policy, nothing for an add.
    Also the loud failure if torch moves torch.utils._python_dispatch (SavedOutputs' base)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshrun.parallel.recompute import SavedOutputs, apply_recompute

    assert issubclass(SavedOutputs, TorchDispatchMode)
    seen: list[object] = []
    blocks = torch.nn.ModuleDict(
        {"0": torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))}
    )
    apply_recompute(blocks, "selective", on_saved=seen.append)
    x = torch.randn(3, 8, requires_grad=True)
    blocks["0"](x).sum().backward()
    # the two addmm outputs, once each (not again on recompute)
    assert [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in seen] == [(3, 16), (3, 8)]


def test_every_n_wraps_only_the_chosen_blocks() -> None:
    cfg = load_config(None, ["model.num_layers=4", "recompute=every:2"])
    model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
    wrapped = [key for key, block in model.blocks.items() if hasattr(block, "_checkpoint_wrapped_module")]
    assert wrapped == ["0", "2"]


TP2 = ["model.num_layers=2", "model.dim=32", "model.num_heads=2", "model.seq_len=16", "precision=fp32"]
TP2 += ["parallel.dp=1", "parallel.pp=1", "parallel.tp=2", "launch.nproc_per_node=2"]


def _backward_collectives(rank: int, store: str, counts: dict) -> None:
    """On tp rank `rank` of 2, for each policy with and without sequence parallel: the collectives
    that reach gloo in one backward of a 2-block GPT (rank 0 reports them in `counts`)."""
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
        for sp, policy in itertools.product((False, True), ("none", "selective", "full")):
            cfg = load_config(None, [*TP2, f"recompute={policy}", f"parallel.sequence_parallel={sp}"])
            model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True, tp_mesh=mesh)
            with vocab_parallel(2):
                loss = tp_loss(MicrobatchLoss(1), 2)(model(tokens[:, :-1]), tokens[:, 1:])
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    loss.backward()
            if rank == 0:  # gloo's events: a collective selective keeps is still dispatched (and profiled) above it
                counts[sp, policy] = Counter(
                    e.name.removeprefix("gloo:") for e in prof.events() if e.name.startswith("gloo:")
                )
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_selective_recompute_reruns_no_tp_sum_in_backward(tmp_path: Path) -> None:
    """Under tp a row-parallel output is summed over the tp ranks (all-reduce; reduce-scatter under
    sequence parallel, which gloo runs as an all-reduce): selective keeps the sum, so its backward
    runs as many as no recompute, where full recompute reruns one a block (selective did too).
    Sequence parallel's all-gathers of a block's input are rerun, as Megatron does. 2 gloo ranks."""
    counts = torch.multiprocessing.Manager().dict()
    torch.multiprocessing.spawn(_backward_collectives, args=(str(tmp_path / "store"), counts), nprocs=2)
    for sp in (False, True):
        none, selective, full = counts[sp, "none"], counts[sp, "selective"], counts[sp, "full"]
        assert full["all_reduce"] > none["all_reduce"] > 0, "the profiler no longer shows the rerun collectives"
        assert selective["all_reduce"] == none["all_reduce"], sp
    gathers = [counts[True, policy]["all_gather"] for policy in ("none", "selective", "full")]
    assert gathers[0] < gathers[1] == gathers[2]
