"""A dp2 DDP worker that survives a lost peer (tests/parallel/test_regroup.py): a small model
trained with AdamW on batches that are a function of (step, rank), under meshrun.launcher.keeper,
joining the job's store at MASTER_ADDR:MASTER_PORT (hosted by the test). With
MESHRUN_TEST_KILL="RANK:STEP[,RANK:STEP]" that rank's first worker SIGKILLs itself just before the
backward of STEP, while its peer waits in the backward's all-reduce; the survivor rebuilds the group
with the replacement, which takes every weight and optimizer moment from it, and both retrain the
step that was in flight. Writes OUT/steps-RANK.jsonl (a row per step trained, a row per recovery)
and OUT/final-RANK.pt (the weights)."""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshrun.launcher.keeper import FIRST, ROLE_ENV
from meshrun.launcher.lifetime import end_worker
from meshrun.parallel import regroup

STEPS = 6
TIMEOUT = timedelta(seconds=60)  # a hung peer's bound; a killed one is noticed at once


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at `step`: a replacement reads the one its predecessor would have."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=generator), torch.randn(8, 1, generator=generator)


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, step: torch.Tensor) -> list[torch.Tensor]:
    """Everything a replica holds, in one order on every rank: the step, the weights, AdamW's moments
    (made here, as zeros, where no step has made them yet: a replacement's)."""
    tensors = [step]
    for param in model.parameters():
        state = optimizer.state[param]
        if not state:
            state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
        tensors += [param.data, state["step"], state["exp_avg"], state["exp_avg_sq"]]
    return tensors


def killed_here(rank: int, step: int) -> bool:
    kill = os.environ.get("MESHRUN_TEST_KILL", "")
    return f"{rank}:{step}" in kill.split(",") and os.environ[ROLE_ENV] == FIRST


def main(out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(
        int(os.environ[ROLE_ENV] != FIRST)
    )  # a replacement's own initial weights: the copy must replace them
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    replacement = regroup.is_replacement()  # a spare waits here, built, for its turn
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=TIMEOUT)
    step = torch.zeros((), dtype=torch.int64)
    log = (out / f"steps-{rank}.jsonl").open("a")
    if not replacement:
        number = 0
        regroup.join(store, number=number, rank=rank, world=world, timeout=TIMEOUT)
    else:  # the survivors' state, then the step that was in flight
        number = regroup.awaited_generation(store, timeout=TIMEOUT)
        source, seconds = regroup.recover(
            store,
            state_tensors(model, optimizer, step),
            number=number,
            rank=rank,
            world=world,
            timeout=TIMEOUT,
            holds=False,
        )
        log.write(json.dumps({"recovered": int(step), "source": source, "seconds": seconds}) + "\n")
    ddp = DistributedDataParallel(model, init_sync=False)  # the state is already the replicas'
    while int(step) < STEPS:
        try:
            loss = train_step(ddp, optimizer, rank, int(step))
        except RuntimeError as broken:
            if not regroup.lost_peer(broken):
                raise
            loss = None
        if loss is None:  # out of the except block: its traceback holds the broken step's frames
            optimizer.zero_grad(set_to_none=True)  # half-reduced gradients: the step is trained again
            del ddp  # before its group goes: a DDP freed after its group was destroyed hung the process
            number = regroup.next_generation(store, lost=number)
            tensors = state_tensors(model, optimizer, step)
            source, seconds = regroup.recover(
                store, tensors, number=number, rank=rank, world=world, timeout=TIMEOUT, holds=True
            )
            log.write(json.dumps({"recovered": int(step), "source": source, "seconds": seconds}) + "\n")
            ddp = DistributedDataParallel(model, init_sync=False)
            continue
        log.write(json.dumps({"step": int(step), "loss": loss}) + "\n")
        log.flush()
        step += 1
    torch.save(model.state_dict(), out / f"final-{rank}.pt")
    del ddp
    regroup.tear_down()


def train_step(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int, step: int) -> float:
    """One step on this rank's batch; its loss. Raises what a broken all-reduce raises."""
    x, y = batch(step, rank)
    loss = nn.functional.mse_loss(ddp(x), y)
    if killed_here(rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_worker(0)  # as meshrun's workers end: gloo can abort a finished process at finalization
